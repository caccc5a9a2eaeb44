"""Every input a user can get wrong ends in one clear message, within bounded time and memory.

One table of bad inputs over the command line and the Python API (issues 11 and 13). Each case
runs in a child process forked from this one, in a fresh folder holding its fixture files, under
a memory limit (`MEMORY_HEADROOM_BYTES` above what this process maps) and a time limit
(`TIMEOUT_S`). A CLI case must exit with status 2 (130 for Ctrl-C), an API case must raise
SpecError or TypeError; the message must name the offending input (the `expect` substrings), no
traceback may appear, and the folder must hold exactly what it held before (nothing written
half-way).

Cases whose fix belongs to a file another part of the project owns are marked xfail with the
fix in the reason, so they can be flipped once it lands.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import resource
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

import pytest

TIMEOUT_S = 20.0
MEMORY_HEADROOM_BYTES = 2 << 30  # 2 GiB above what the test process maps when it forks
MAX_MESSAGE_CHARS = 3000  # a message is a few lines, never a dump of a huge value

# A minimal hardware profile (fields as in cost_models/profiles/h100-sxm.yaml), to break one
# number at a time.
PROFILE = """\
name: broken-gpu
gpus_per_node: 8
peak_flops: {bf16: 989.4e12, fp32: 67.0e12}
memory: {capacity_bytes: 85899345920, bandwidth_bytes_per_s: 3.35e12, efficiency: 0.88}
intra_node: {bandwidth_bytes_per_s: 450e9, latency_s: 8.0e-6, efficiency: 0.8}
inter_node: {bandwidth_bytes_per_s: 50e9, latency_s: 1.5e-5, efficiency: 0.9}
gemm: {max_efficiency: {bf16: 0.76, fp32: 0.76}, half_dim: 128}
attention: {flash_efficiency: {bf16: 0.45, fp32: 0.45}}
"""
MODEL = "n_layers: 4\nhidden_size: 256\nn_heads: 4\nvocab_size: 1000\nseq_len: 128\n"
STUDY_YAML = "study_name: someone-elses-study\nmodel: gpt3-175b\n"


HOSTILE_NAMES = (
    "m\ntouch MARK",
    "m'; touch MARK; '",
    "m]\n[table]",
    "$(touch MARK)",
    "`touch MARK`",
    "m\u2028touch MARK",
)
HF_TINY = {
    "model_type": "llama",
    "num_hidden_layers": 2,
    "hidden_size": 256,
    "num_attention_heads": 4,
    "intermediate_size": 512,
    "vocab_size": 1000,
    "max_position_embeddings": 128,
}
FIFO = object()  # a fixture "file" made as a named pipe (os.mkfifo)


def _user_db() -> bytes:
    """A SQLite database holding a table of the user's (not Optuna's)."""
    import sqlite3

    conn = sqlite3.connect(":memory:")
    conn.execute("CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT)")
    conn.execute("INSERT INTO customers (name) VALUES ('Ada')")
    conn.commit()
    data = conn.serialize()
    conn.close()
    return bytes(data)


USER_DB = _user_db()


def billion_laughs(key: str, levels: int = 30) -> str:
    """A YAML bomb: 2**levels leaves once its aliases are expanded, a few hundred bytes on disk."""
    lines = ["a0: &a0 [x, x]"]
    lines += [f"a{i}: &a{i} [*a{i - 1}, *a{i - 1}]" for i in range(1, levels)]
    lines.append(f"{key}: *a{levels - 1}")
    return "\n".join(lines) + "\n"


@dataclasses.dataclass(frozen=True)
class Case:
    """One bad input.

    Attributes:
        id: short name (the pytest id).
        cli: the command line after `autosearch`, or None for an API case.
        api: Python code for an API case (names from `API_NAMESPACE` are in scope).
        expect: substrings the message must contain (case-sensitive; whitespace runs are one).
        files: fixture files to create in the case's folder (path -> text or bytes; a path
            ending in "/" is a folder).
        exit_code: the CLI's expected status.
        raises: names of the exception types an API case may raise.
        as_user: run as this uid (root ignores permissions; read-only cases need a plain user).
        interrupt_after_s: send SIGINT to the case after this many seconds (Ctrl-C).
        may_write: paths (relative to the case's folder) the case may create or change, for a
            case whose right outcome keeps finished work (Ctrl-C keeps the finished trials).
        xfail: why the case fails today and the fix, for a file another part of the project owns.
    """

    id: str
    cli: tuple[str, ...] | None = None
    api: str | None = None
    expect: tuple[str, ...] = ()
    files: dict = dataclasses.field(default_factory=dict)
    exit_code: int = 2
    raises: tuple[str, ...] = ("SpecError",)
    as_user: int | None = None
    interrupt_after_s: float | None = None
    may_write: tuple[str, ...] = ()
    timeout_s: float = TIMEOUT_S
    xfail: str | None = None


def est(
    strategy: str = "dp=8,global_batch_size=64",
    *,
    model: str = "llama3-8b",
    cluster: str = "h100-sxm:1x8",
    extra: tuple[str, ...] = (),
) -> tuple[str, ...]:
    """`autosearch estimate` with one input changed from a valid command."""
    return ("estimate", "--model", model, "--cluster", cluster, *extra, "--strategy", strategy)


EST = ("estimate", "--model", "llama3-8b", "--cluster", "h100-sxm:1x8")
EST_S = EST + ("--strategy",)
OK_STRATEGY = "dp=8,global_batch_size=64"
TUNE = ("tune", "--model", "llama3-8b", "--cluster", "h100-sxm:1x8", "--quiet")
TUNE_B = TUNE + ("--global-batch-size", "64")
SWEEP = ("sweep", "--models", "llama3-8b", "--global-batch-sizes", "64", "--quiet")
EXPORT = ("export", "--to", "megatron", "--strategy")
VALIDATE = ("validate", "--strategies", "s.yaml", "--model", "llama3-8b")
CONFIG_OK = "model: llama3-8b\ncluster: h100-sxm:1x8\nglobal_batch_size: 64\n"
HAS_PSYCOPG = importlib.util.find_spec("psycopg") is not None
HAS_PYMYSQL = importlib.util.find_spec("pymysql") is not None
NOBODY = 65534
STORAGE = "tuning/_storage.py (tuning helper, storage integrity): "

CASES = [
    # ---- issue 11: tracebacks -------------------------------------------------------------------
    Case(
        "i11.1-strategy-not-utf8",
        cli=EST_S + ("s.yaml",),
        files={"s.yaml": b"dp: 8\n\xff\xfe\x00\x81 tp: 1\n"},
        expect=("s.yaml", "not UTF-8"),
    ),
    Case(
        "i11.2-sweep-out-under-a-file",
        cli=SWEEP + ("--clusters", "h100-sxm:1x8", "--out", "README.md/sweep.csv"),
        files={"README.md": "# a file\n"},
        expect=("README.md", "is a file"),
    ),
    Case(
        "i11.2-tune-out-is-a-file",
        cli=TUNE_B + ("--out", "README.md"),
        files={"README.md": "# a file\n"},
        expect=("README.md", "is a file"),
    ),
    Case(
        "i11.3-storage-unknown-scheme",
        cli=TUNE_B + ("--storage", "foo://bar"),
        expect=("foo://bar", "unknown storage scheme 'foo'"),
    ),
    Case(
        "i11.4-storage-postgresql-without-driver",
        cli=TUNE_B + ("--storage", "postgresql://me:secret@127.0.0.1:1/db"),
        expect=("postgresql",)
        + (("cannot connect",) if HAS_PSYCOPG else ("pip install -e '.[postgres]'",)),
    ),
    Case(
        "i11.4-storage-mysql-without-driver",
        cli=TUNE_B + ("--storage", "mysql+pymysql://me@127.0.0.1:1/db"),
        expect=("mysql",) + (("cannot connect",) if HAS_PYMYSQL else ("pip install pymysql",)),
    ),
    Case(
        "i11.5-journal-torn-last-line",
        cli=TUNE_B + ("--n-trials", "3", "--storage", "s.journal", "--out", "o"),
        files={"s.journal": '{"op_code": 0, "worker_id": "x", "study_name": "s", "dir'},
        # dropped with a TornJournalWarning naming the file (pytest captures warnings here;
        # tests/test_storage.py checks its text); the run goes on, nothing was lost but the
        # torn record itself, so the exit status is 0 and the study is written
        expect=(),
        exit_code=0,
        may_write=("s.journal", "o"),
        timeout_s=120,  # a whole tune with report.md's plots: ~2 s alone, > 20 s at load 9
    ),
    Case(
        "i11.6-journal-garbage-in-the-middle",
        cli=TUNE_B + ("--n-trials", "3", "--storage", "s.journal", "--out", "o"),
        files={"s.journal": "\x00\x00garbage\n{not json}\n"},
        expect=("s.journal", "line 1"),
    ),
    Case(
        "i13.16-sqlite-file-corrupt",
        cli=TUNE_B + ("--n-trials", "3", "--storage", "s.db", "--out", "o"),
        files={"s.db": b"SQLite format 3\x00" + b"\xde\xad" * 500},
        expect=("s.db",),
    ),
    Case(
        "i11.7-strategy-file-empty",
        cli=EST_S + ("e.yaml",),
        files={"e.yaml": ""},
        expect=("e.yaml", "empty"),
    ),
    Case("i11.7-strategy-empty-string", cli=EST_S + ("",), expect=("--strategy", "empty")),
    Case("i11.7-strategy-blank-string", cli=EST_S + ("   ",), expect=("--strategy", "empty")),
    Case(
        "i11.7-strategy-file-only-comments",
        cli=EST_S + ("c.yaml",),
        files={"c.yaml": "# nothing here\n"},
        expect=("c.yaml", "empty"),
    ),
    Case(
        "i11.8-cluster-yaml-without-gpus-per-node",
        cli=("estimate", "--model", "llama3-8b", "--cluster", "c.yaml", "--strategy", OK_STRATEGY),
        files={"c.yaml": "gpu: h100-sxm\nn_nodes: 1\n"},
        expect=("c.yaml", "gpus_per_node"),
    ),
    Case(
        "i11.8-cluster-gpu-colon-n-is-ambiguous",
        cli=est(cluster="h100-sxm:8"),
        expect=("h100-sxm:8", "h100-sxm:8x8", "h100-sxm:1x8"),
    ),
    Case(
        "i11.8-cluster-bare-gpu-name",
        cli=est(cluster="h100-sxm"),
        expect=("'h100-sxm'", "h100-sxm:1x8", "--nnodes"),
    ),
    Case(
        "i11.8-api-cluster-gpu-colon-n",
        api="Cluster.parse('h100-sxm:8')",
        expect=("h100-sxm:8", "NODESxGPUS"),
    ),
    Case(
        "i11.8-api-cluster-dict-without-gpus-per-node",
        api="Cluster.from_dict({'gpu': 'h100-sxm', 'n_nodes': 2})",
        expect=("gpus_per_node",),
    ),
    Case(
        "i11.8-a100-is-two-profiles",
        cli=est(cluster="a100:1x8"),
        expect=("a100", "a100-sxm4-40gb", "a100-sxm4-80gb"),
    ),
    Case(
        "i11.9-tune-into-another-study",
        cli=TUNE_B + ("--n-trials", "3", "--out", "o"),
        files={"o/study.yaml": STUDY_YAML, "o/trials.csv": "trial\n1\n"},
        expect=("'o'", "another study", "someone-elses-study"),
    ),
    Case(
        "i11.11-api-estimate-dict-strategy",
        api="estimate('llama3-8b', 'h100-sxm:1x8', {'dp': 8, 'global_batch_size': 'x'})",
        expect=("global_batch_size",),
    ),
    Case(
        "i11.11-api-estimate-int-strategy",
        api="estimate('llama3-8b', 'h100-sxm:1x8', 64)",
        raises=("TypeError",),
        expect=("strategy", "int"),
    ),
    Case(
        "i11.12-estimate-without-global-batch",
        cli=EST_S + ("dp=8",),
        expect=("dp=8", "--global-batch-size"),
    ),
    Case(
        "i11.12-estimate-global-batch-disagrees",
        cli=EST_S + ("dp=8,global_batch_size=64", "--global-batch-size", "128"),
        expect=("--global-batch-size 128", "global_batch_size=64"),
    ),
    Case(
        "i11.13-eight-million-gpus",
        cli=est(cluster="h100-sxm:1000000x8"),
        expect=("h100-sxm:1000000x8", "8,000,000 devices", "1,048,576"),
    ),
    Case(
        "i11.13-eight-million-gpus-nnodes",
        cli=est(
            cluster="h100-sxm",
            extra=(
                "--nnodes",
                "1000000",
                "--gpus-per-node",
                "8",
            ),
        ),
        expect=("8,000,000 devices",),
    ),
    Case(
        "i11.13-api-eight-million-gpus",
        api="Cluster(gpu='h100-sxm', n_nodes=1_000_000)",
        expect=("8,000,000",),
    ),
    Case(
        "i11.13-tune-global-batch-1e12",
        cli=TUNE + ("--global-batch-size", "1000000000000"),
        expect=("--global-batch-size", "16,777,216"),
    ),
    Case(
        "i11.13-estimate-global-batch-1e12",
        cli=EST_S + ("dp=8,global_batch_size=1000000000000",),
        expect=("global_batch_size", "16,777,216"),
    ),
    Case(
        "i11.13-api-strategy-global-batch-1e12",
        api="Strategy(dp=8, global_batch_size=10**12)",
        expect=("global_batch_size", "limit"),
    ),
    # ---- issue 13: truncated strategy files -----------------------------------------------------
    Case(
        "i13.4-export-empty-best-strategy",
        cli=EXPORT + ("b.yaml",),
        files={"b.yaml": ""},
        expect=("b.yaml", "empty"),
    ),
    Case(
        "i13.4-export-best-strategy-cut-after-tp",
        cli=EXPORT + ("b.yaml",),
        files={"b.yaml": "# The best strategy\nstrategy:\n  dp: 8\n  tp: 4\n"},
        expect=("b.yaml", "pp"),
    ),
    Case(
        "i13.4-estimate-strategy-cut-after-tp",
        cli=EST_S + ("b.yaml",),
        files={"b.yaml": "dp: 2\ntp: 4\n"},
        expect=("b.yaml", "does not name pp"),
    ),
    Case(
        "i13.4-export-best-strategy-only-header",
        cli=EXPORT + ("b.yaml",),
        files={"b.yaml": "# The best strategy found by `autosearch tune`\nstrategy:\n"},
        expect=("b.yaml", "empty"),
    ),
    Case(
        "i13.4-api-strategy-from-empty-yaml",
        api="Strategy.from_yaml('b.yaml')",
        files={"b.yaml": ""},
        expect=("b.yaml", "empty"),
    ),
    Case(
        "i13.4-api-strategy-from-cut-yaml",
        api="Strategy.from_yaml('b.yaml')",
        files={"b.yaml": "dp: 8\ntp: 4\n"},
        expect=("b.yaml", "pp"),
    ),
    # ---- issue 13: hostile input ----------------------------------------------------------------
    Case(
        "i13.13-billion-laughs-in-amp",
        cli=EST_S + ("s.yaml",),
        files={"s.yaml": billion_laughs("amp") + "dp: 8\ntp: 1\npp: 1\n"},
        expect=("s.yaml", "aliases"),
    ),
    Case(
        "i13.13-billion-laughs-in-dp",
        cli=EST_S + ("s.yaml",),
        files={"s.yaml": billion_laughs("dp") + "tp: 1\npp: 1\n"},
        expect=("s.yaml", "aliases"),
    ),
    Case(
        "i13.13-billion-laughs-in-model-name",
        cli=est(model="m.yaml"),
        files={"m.yaml": billion_laughs("name") + MODEL},
        expect=("m.yaml", "aliases"),
    ),
    Case(
        "i13.13-billion-laughs-in-cluster",
        cli=("estimate", "--model", "llama3-8b", "--cluster", "c.yaml", "--strategy", OK_STRATEGY),
        files={"c.yaml": billion_laughs("gpu") + "n_nodes: 1\ngpus_per_node: 8\n"},
        expect=("c.yaml", "aliases"),
    ),
    Case(
        "i13.13-api-billion-laughs-strategy",
        api="Strategy.from_yaml('s.yaml')",
        files={"s.yaml": billion_laughs("amp")},
        expect=("s.yaml", "aliases"),
    ),
    Case(
        "i13.13-api-billion-laughs-model",
        api="ModelSpec.load('m.yaml')",
        files={"m.yaml": billion_laughs("name") + MODEL},
        expect=("m.yaml", "aliases"),
    ),
    Case(
        "i13.13-deep-nesting",
        cli=EST_S + ("s.yaml",),
        files={"s.yaml": "amp: " + "[" * 5000 + "]" * 5000 + "\n"},
        expect=("s.yaml", "nested too deeply"),
    ),
    Case(
        "i13.13-file-over-1-mib",
        cli=EST_S + ("s.yaml",),
        files={"s.yaml": "dp: 8\n" + "# padding\n" * 120_000},
        expect=("s.yaml", "larger than 1 MiB"),
    ),
    Case(
        "i13.13-cluster-2-to-the-59-nodes",
        cli=est(cluster="h100-sxm:576460752303423488x8"),
        expect=("n_nodes", "576,460,752,303,423,488", "limit"),
    ),
    Case(
        "i13.13-tune-cluster-2-to-the-59-nodes",
        cli=(
            "tune",
            "--model",
            "llama3-8b",
            "--cluster",
            "h100-sxm:576460752303423488x8",
            "--global-batch-size",
            "64",
        ),
        expect=("n_nodes", "limit"),
    ),
    Case(
        "i13.13-tune-global-batch-2-to-the-62",
        cli=TUNE + ("--global-batch-size", "4611686018427387904"),
        expect=("--global-batch-size", "limit"),
    ),
    Case(
        "i13.13-api-tune-global-batch-2-to-the-62",
        api="tune('llama3-8b', 'h100-sxm:1x8', global_batch_size=4611686018427387904, n_trials=2)",
        expect=("global_batch_size",),
        timeout_s=5.0,  # it hangs today: do not wait the full limit
    ),
    Case(
        "i13.13-model-10-to-the-12-layers",
        cli=(
            "tune",
            "--model",
            "m.yaml",
            "--cluster",
            "h100-sxm:1x8",
            "--global-batch-size",
            "64",
        ),
        files={"m.yaml": MODEL.replace("n_layers: 4", "n_layers: 1000000000000")},
        expect=("m.yaml", "n_layers", "limit"),
    ),
    Case(
        "i13.13-api-model-10-to-the-12-layers",
        api="ModelSpec(n_layers=10**12, hidden_size=256, n_heads=4, vocab_size=1000, seq_len=128)",
        expect=("n_layers", "limit"),
    ),
    Case(
        "i13.13-api-cluster-2-to-the-59-nodes",
        api="Cluster.parse('h100-sxm:576460752303423488x8')",
        expect=("n_nodes", "limit"),
    ),
    Case(
        "i13.14-study-name-escapes-out",
        cli=TUNE_B + ("--study-name", "../../x", "--n-trials", "2"),
        expect=("--study-name", "../../x"),
    ),
    Case(
        "i13.14-study-name-absolute",
        cli=TUNE_B + ("--study-name", "/tmp/x", "--n-trials", "2"),
        expect=("--study-name", "/tmp/x"),
    ),
    # ---- issue 13 item 16: numbers, binary files, outputs, Ctrl-C -------------------------------
    Case(
        "i13.16-nan-in-strategy",
        cli=EST_S + ("s.yaml",),
        files={"s.yaml": "dp: .nan\ntp: 1\npp: 1\nglobal_batch_size: 8\n"},
        expect=("s.yaml", "dp", "nan"),
    ),
    Case(
        "i13.16-inf-in-model",
        cli=est(model="m.yaml"),
        files={"m.yaml": MODEL.replace("seq_len: 128", "seq_len: .inf")},
        expect=("m.yaml", "seq_len", "inf"),
    ),
    Case(
        "i13.16-overflowing-float-in-profile",
        cli=est(cluster="p.yaml:1x8"),
        files={"p.yaml": PROFILE.replace("3.35e12", "1e400")},
        expect=("p.yaml", "memory.bandwidth_bytes_per_s", "inf"),
    ),
    Case(
        "i13.16-nan-in-profile",
        cli=est(cluster="p.yaml:1x8"),
        files={"p.yaml": PROFILE.replace("0.88", ".nan")},
        expect=("p.yaml", "memory.efficiency", "nan"),
    ),
    Case(
        "i13.16-int-beyond-64-bits",
        cli=EST_S + ("s.yaml",),
        files={"s.yaml": f"dp: {2**70}\ntp: 1\npp: 1\nglobal_batch_size: 8\n"},
        expect=("s.yaml", "dp", "64 bits"),
    ),
    Case(
        "i13.16-binary-yaml",
        cli=EST_S + ("s.yaml",),
        files={"s.yaml": b"\x00\x01\x02\x03binary\x7f\x00"},
        expect=("s.yaml", "not valid YAML"),
    ),
    Case(
        "i13.16-binary-model-file",
        cli=est(model="m.yaml"),
        files={"m.yaml": bytes(range(256))},
        expect=("m.yaml", "not UTF-8"),
    ),
    Case(
        "i13.16-read-only-out-folder",
        cli=TUNE_B + ("--n-trials", "2", "--out", "ro/study"),
        files={"ro/": 0o555},
        as_user=NOBODY,
        expect=("ro/study", "read-only"),
    ),
    Case(
        "i13.16-read-only-sweep-csv-folder",
        cli=SWEEP + ("--clusters", "h100-sxm:1x8", "--out", "ro/sweep.csv"),
        files={"ro/": 0o555},
        as_user=NOBODY,
        expect=("ro/sweep.csv", "read-only"),
    ),
    Case(
        "i13.16-folder-where-best-strategy-goes",
        cli=TUNE_B + ("--n-trials", "2", "--out", "o"),
        files={"o/best_strategy.yaml/": 0o755},
        expect=("'o'", "best_strategy.yaml"),
    ),
    Case(
        "i13.16-folder-where-sweep-csv-goes",
        cli=SWEEP + ("--clusters", "h100-sxm:1x8", "--out", "sweep.csv"),
        files={"sweep.csv/": 0o755},
        expect=("sweep.csv", "is a folder"),
    ),
    Case(
        "i13.16-out-is-root",
        cli=TUNE_B + ("--n-trials", "2", "--out", "/"),
        expect=("--out '/'", "root"),
    ),
    Case(
        "i13.16-ctrl-c-during-tune",
        cli=(
            "tune",
            "--model",
            "llama3-70b",
            "--cluster",
            "h100-sxm:32x8",
            "--global-batch-size",
            "512",
            "--n-trials",
            "100000",
            "--sampler",
            "random",
            "--out",
            "o",
        ),
        interrupt_after_s=3.0,
        may_write=("o",),
        exit_code=130,
        expect=("interrupted",),
    ),
    # ---- the rest of the CLI --------------------------------------------------------------------
    Case(
        "cli-unknown-model",
        cli=est(model="gpt-99"),
        expect=("gpt-99",),
    ),
    Case(
        "cli-empty-model",
        cli=("estimate", "--model", "", "--cluster", "h100-sxm:1x8", "--strategy", OK_STRATEGY),
        expect=("--model", "empty"),
    ),
    Case(
        "cli-model-file-missing",
        cli=est(model="m.yaml"),
        expect=("m.yaml", "does not exist"),
    ),
    Case(
        "cli-model-file-missing-keys",
        cli=est(model="m.yaml"),
        files={"m.yaml": "n_layers: 4\nhidden_size: 256\n"},
        expect=("m.yaml", "n_heads", "vocab_size", "seq_len"),
    ),
    Case(
        "cli-model-file-unknown-key",
        cli=est(model="m.yaml"),
        files={"m.yaml": MODEL + "num_layers: 4\n"},
        expect=("m.yaml", "num_layers"),
    ),
    Case(
        "cli-model-file-is-a-list",
        cli=est(model="m.yaml"),
        files={"m.yaml": "- 1\n- 2\n"},
        expect=("m.yaml", "mapping"),
    ),
    Case(
        "cli-model-heads-do-not-divide-hidden",
        cli=est(model="m.yaml"),
        files={"m.yaml": MODEL.replace("n_heads: 4", "n_heads: 3")},
        expect=("hidden_size 256", "n_heads 3"),
    ),
    Case(
        "cli-model-float-seq-len",
        cli=est(model="m.yaml"),
        files={"m.yaml": MODEL.replace("seq_len: 128", "seq_len: 127.5")},
        expect=("seq_len", "127.5"),
    ),
    Case(
        "cli-model-activation",
        cli=est(model="m.yaml"),
        files={"m.yaml": MODEL + "ffn_activation: relu\n"},
        expect=("ffn_activation", "relu"),
    ),
    Case(
        "cli-model-file-is-a-folder",
        cli=est(model="m.yaml"),
        files={"m.yaml/": 0o755},
        expect=("m.yaml", "folder"),
    ),
    Case(
        "cli-unknown-gpu",
        cli=est(cluster="l40s:1x8"),
        expect=("l40s",),
    ),
    Case(
        "cli-empty-cluster",
        cli=("estimate", "--model", "llama3-8b", "--cluster", "", "--strategy", OK_STRATEGY),
        expect=("--cluster", "empty"),
    ),
    Case(
        "cli-zero-nodes",
        cli=est(cluster="h100-sxm:0x8"),
        expect=("n_nodes", ">= 1"),
    ),
    Case(
        "cli-cluster-garbage",
        cli=est(cluster="h100-sxm:eightxeight"),
        expect=("h100-sxm:eightxeight", "GPU:NODESxGPUS"),
    ),
    Case(
        "cli-nnodes-without-gpus-per-node",
        cli=est(
            cluster="h100-sxm",
            extra=(
                "--nnodes",
                "2",
            ),
        ),
        expect=("--nnodes", "--gpus-per-node"),
    ),
    Case(
        "cli-nnodes-with-full-cluster",
        cli=est(
            extra=(
                "--nnodes",
                "2",
                "--gpus-per-node",
                "8",
            )
        ),
        expect=("h100-sxm:1x8", "--nnodes"),
    ),
    Case(
        "cli-nnodes-zero",
        cli=EST + ("--nnodes", "0", "--strategy", OK_STRATEGY),
        expect=("--nnodes", ">= 1"),
    ),
    Case(
        "cli-cluster-file-invalid-yaml",
        cli=("estimate", "--model", "llama3-8b", "--cluster", "c.yaml", "--strategy", OK_STRATEGY),
        files={"c.yaml": "gpu: [h100\n"},
        expect=("c.yaml", "not valid YAML"),
    ),
    Case(
        "cli-profile-negative-bandwidth",
        cli=est(cluster="p.yaml:1x8"),
        files={"p.yaml": PROFILE.replace("450e9", "-450e9")},
        expect=("p.yaml", "intra_node.bandwidth_bytes_per_s"),
    ),
    Case(
        "cli-profile-missing-keys",
        cli=est(cluster="p.yaml:1x8"),
        files={"p.yaml": "name: x\npeak_flops: {bf16: 1e15}\n"},
        expect=("p.yaml", "missing key"),
    ),
    Case(
        "cli-profile-string-number",
        cli=est(cluster="p.yaml:1x8"),
        files={"p.yaml": PROFILE.replace("3.35e12", "fast")},
        expect=("p.yaml", "fast"),
    ),
    Case("cli-strategy-not-key-value", cli=EST_S + ("dp8",), expect=("dp8", "key=value")),
    Case(
        "cli-strategy-unknown-key",
        cli=EST_S + ("dp=8,global_batch_size=64,foo=1",),
        expect=("foo",),
    ),
    Case(
        "cli-strategy-zero-dp",
        cli=EST_S + ("dp=0,global_batch_size=8",),
        expect=("dp must be >= 1",),
    ),
    Case(
        "cli-strategy-word-dp",
        cli=EST_S + ("dp=eight,global_batch_size=8",),
        expect=("dp", "eight"),
    ),
    Case(
        "cli-strategy-amp",
        cli=EST_S + ("dp=8,global_batch_size=64,amp=int4",),
        expect=("amp", "int4"),
    ),
    Case(
        "cli-strategy-schedule",
        cli=EST_S + ("dp=8,global_batch_size=64,pipeline_schedule=zb",),
        expect=("pipeline_schedule", "zb"),
    ),
    Case(
        "cli-strategy-recompute",
        cli=EST_S + ("dp=8,global_batch_size=64,recompute=maybe",),
        expect=("recompute", "maybe"),
    ),
    Case(
        "cli-strategy-zero-stage",
        cli=EST_S + ("dp=8,global_batch_size=64,zero_stage=5",),
        expect=("zero_stage", "5"),
    ),
    Case(
        "cli-strategy-sp-word",
        cli=EST_S + ("dp=8,global_batch_size=64,sequence_parallel=maybe",),
        expect=("sequence_parallel", "maybe"),
    ),
    Case(
        "cli-strategy-world-size",
        cli=EST_S + ("dp=4,global_batch_size=64",),
        expect=("dp*tp*pp", "8 devices"),
    ),
    Case(
        "cli-strategy-tp-heads",
        cli=EST_S + ("tp=8,global_batch_size=64",) + ("--model", "m.yaml"),
        files={"m.yaml": MODEL},
        expect=("tp=8", "n_heads=4"),
    ),
    Case(
        "cli-strategy-file-missing", cli=EST_S + ("s.yaml",), expect=("s.yaml", "does not exist")
    ),
    Case(
        "cli-strategy-file-is-a-folder",
        cli=EST_S + ("s.yaml",),
        files={"s.yaml/": 0o755},
        expect=("s.yaml", "folder"),
    ),
    Case(
        "cli-strategy-file-is-a-list",
        cli=EST_S + ("s.yaml",),
        files={"s.yaml": "[8, 1, 1]\n"},
        expect=("s.yaml", "mapping"),
    ),
    Case(
        "cli-strategy-file-invalid-yaml",
        cli=EST_S + ("s.yaml",),
        files={"s.yaml": "dp: 8\ntp: [2\n"},
        expect=("s.yaml", "not valid YAML at line"),
    ),
    Case(
        "cli-strategy-file-unknown-key",
        cli=EST_S + ("s.yaml",),
        files={"s.yaml": "dp: 8\ntp: 1\npp: 1\nglobal_batch_size: 8\nmicro_batch: 1\n"},
        expect=("s.yaml", "micro_batch"),
    ),
    Case("cli-estimate-runtime", cli=EST_S + (OK_STRATEGY, "--runtime", "jax"), expect=("jax",)),
    Case(
        "cli-estimate-gbs-zero",
        cli=EST_S + ("dp=8", "--global-batch-size", "0"),
        expect=("--global-batch-size", ">= 1"),
    ),
    Case(
        "cli-tune-n-trials-zero", cli=TUNE_B + ("--n-trials", "0"), expect=("--n-trials", ">= 1")
    ),
    Case(
        "cli-tune-n-trials-word",
        cli=TUNE_B + ("--n-trials", "many"),
        expect=("--n-trials", "many"),
    ),
    Case("cli-tune-sampler", cli=TUNE_B + ("--sampler", "cmaes"), expect=("--sampler", "cmaes")),
    Case(
        "cli-tune-cost-without-price",
        cli=TUNE_B + ("--objective", "throughput-cost", "--n-trials", "2"),
        expect=("price",),
    ),
    Case(
        "cli-tune-negative-price",
        cli=TUNE_B + ("--price-per-gpu-hour", "-2"),
        expect=("--price-per-gpu-hour", "-2"),
    ),
    Case(
        "cli-tune-nan-price",
        cli=TUNE_B + ("--price-per-gpu-hour", "nan"),
        expect=("--price-per-gpu-hour", "nan"),
    ),
    # issue 18: --memory-margin, --seq-len, --fp8 and what the runtime cannot run
    Case(
        "cli-tune-memory-margin-negative",
        cli=TUNE_B + ("--memory-margin", "-0.1"),
        expect=("--memory-margin", "from 0 to 0.9", "-0.1"),
    ),
    Case(
        "cli-tune-memory-margin-whole-device",
        cli=TUNE_B + ("--memory-margin", "100%"),
        expect=("--memory-margin", "from 0 to 0.9"),
    ),
    Case(
        "cli-tune-memory-margin-word",
        cli=TUNE_B + ("--memory-margin", "some"),
        expect=("--memory-margin", "'some'", "0.1 or 10%"),
    ),
    Case(
        "config-memory-margin-list",
        cli=("tune", "--config", "c.yaml"),
        files={
            "c.yaml": "model: llama3-8b\ncluster: h100-sxm:1x8\nglobal_batch_size: 64\n"
            "memory_margin: [0.1]\n"
        },
        expect=("memory_margin", "single value"),
    ),
    Case("cli-tune-seq-len-zero", cli=TUNE_B + ("--seq-len", "0"), expect=("--seq-len", ">= 1")),
    Case(
        "cli-tune-seq-len-huge",
        cli=TUNE_B + ("--seq-len", str(1 << 40)),
        expect=("--seq-len", "above the limit"),
    ),
    Case(
        "cli-estimate-seq-len-word",
        cli=EST_S + (OK_STRATEGY, "--seq-len", "long"),
        expect=("--seq-len", "'long'"),
    ),
    Case(
        "cli-tune-seq-len-not-split-by-cp",
        cli=TUNE_B + ("--seq-len", "4097", "--pin", "cp=2", "--runtime", "torchtitan"),
        expect=("cp", "4097"),
        xfail="search_spaces/_parallel.py (the lead's tree): the empty-space message names the "
        "first level's rule only; it should name the rule that emptied the cp level "
        "(rules.context_parallel_problem: seq_len 4097 not divisible by 2*cp)",
    ),
    Case(
        "config-fp8-word",
        cli=("tune", "--config", "c.yaml"),
        files={
            "c.yaml": "model: llama3-8b\ncluster: h100-sxm:1x8\nglobal_batch_size: 64\n"
            "fp8: sometimes\n"
        },
        expect=("fp8", "true or false", "sometimes"),
    ),
    Case(
        "cli-tune-fp8-on-a-runtime-without-it",
        cli=TUNE_B + ("--fp8", "--runtime", "megatron-sc21"),
        expect=("fp8", "megatron-sc21", "does not run", "drop --fp8"),
    ),
    Case(
        "cli-tune-fp8-pinned-none",
        cli=TUNE_B + ("--fp8", "--runtime", "torchtitan", "--pin", "fp8=none"),
        expect=("fp8", "keeps fp8 to [none]", "drop that pin"),
    ),
    Case(
        "cli-tune-pin-what-the-runtime-cannot-run",
        cli=TUNE_B + ("--pin", "compile=true", "--runtime", "megatron-sc21", "--n-trials", "2"),
        expect=("compile [true]", "megatron-sc21", "does not run", "use --runtime"),
    ),
    Case(
        "cli-tune-pin-supported-on-pp",
        cli=TUNE_B + ("--pin", "pp=supported", "--n-trials", "2"),
        expect=("pp", "'supported' is only for"),
    ),
    Case(
        "api-tune-memory-margin",
        api="tune('llama3-8b', 'h100-sxm:1x8', global_batch_size=64, memory_margin=1.5)",
        expect=("memory_margin", "from 0 to 0.9"),
    ),
    Case(
        "api-tune-seq-len",
        api="tune('llama3-8b', 'h100-sxm:1x8', global_batch_size=64, seq_len=-4)",
        expect=("seq_len", ">= 1"),
    ),
    Case(
        "cli-tune-pin-not-key-value",
        cli=TUNE_B + ("--pin", "tp"),
        expect=("--pin 'tp'", "KEY=VALUE"),
    ),
    Case(
        "cli-tune-pin-unknown",
        cli=TUNE_B + ("--pin", "warp=3", "--n-trials", "2"),
        expect=("warp",),
    ),
    Case(
        "cli-tune-space-missing",
        cli=TUNE_B + ("--space", "nope.yaml", "--n-trials", "2"),
        expect=("nope.yaml",),
    ),
    Case("cli-tune-top-k-zero", cli=TUNE_B + ("--top-k", "0"), expect=("--top-k", ">= 1")),
    Case(
        "cli-tune-runtime", cli=TUNE_B + ("--runtime", "jax", "--n-trials", "2"), expect=("jax",)
    ),
    Case(
        "cli-tune-storage-suffix",
        cli=TUNE_B + ("--storage", "study.txt", "--n-trials", "2"),
        expect=("study.txt",),
    ),
    Case(
        "cli-tune-storage-not-a-url",
        cli=TUNE_B + ("--storage", "not a url://x"),
        expect=("not a url://x",),
    ),
    Case("cli-tune-no-global-batch", cli=TUNE, expect=("--global-batch-size",)),
    Case(
        "cli-sweep-batches-word",
        cli=(
            "sweep",
            "--models",
            "llama3-8b",
            "--clusters",
            "h100-sxm:1x8",
            "--global-batch-sizes",
            "64,lots",
        ),
        expect=("--global-batch-sizes", "lots"),
    ),
    Case(
        "cli-sweep-batches-huge",
        cli=(
            "sweep",
            "--models",
            "llama3-8b",
            "--clusters",
            "h100-sxm:1x8",
            "--global-batch-sizes",
            "64,99999999999",
        ),
        expect=("--global-batch-sizes", "16,777,216"),
    ),
    Case(
        "cli-sweep-gpus-without-nodes",
        cli=SWEEP + ("--gpus", "h100-sxm"),
        expect=("--gpus", "--nodes"),
    ),
    Case(
        "cli-sweep-nodes-zero",
        cli=SWEEP + ("--gpus", "h100-sxm", "--nodes", "0,8"),
        expect=("--nodes", ">= 1"),
    ),
    Case("cli-sweep-no-clusters", cli=SWEEP, expect=("--clusters",)),
    Case(
        "cli-sweep-ambiguous-cluster",
        cli=SWEEP + ("--clusters", "h100-sxm:8"),
        expect=("h100-sxm:8", "h100-sxm:8x8"),
    ),
    Case(
        "cli-sweep-out-with-other-columns",
        cli=SWEEP + ("--clusters", "h100-sxm:1x8", "--out", "old.csv"),
        files={"old.csv": "model,cluster,global_batch_size,status\nllama3-8b,x,64,ok\n"},
        expect=("old.csv", "other columns"),
    ),
    Case(
        "cli-sweep-empty-models",
        cli=("sweep", "--models", ",", "--clusters", "h100-sxm:1x8", "--global-batch-sizes", "64"),
        expect=("--models",),
    ),
    Case(
        "cli-export-unknown-runtime",
        cli=("export", "--to", "jax", "--strategy", OK_STRATEGY),
        expect=("jax", "megatron"),
    ),
    Case(
        "cli-export-no-global-batch",
        cli=("export", "--to", "megatron", "--strategy", "dp=8,tp=2"),
        expect=("--global-batch-size",),
    ),
    Case(
        "cli-export-model-mismatch",
        cli=(
            "export",
            "--to",
            "megatron",
            "--strategy",
            "tp=3,global_batch_size=8",
            "--model",
            "llama3-8b",
        ),
        expect=("tp=3", "n_heads"),
    ),
    Case("cli-no-command", cli=(), expect=("COMMAND",)),
    Case("cli-unknown-command", cli=("search",), expect=("search",)),
    # ---- tune --config (issue 11 item 5) -------------------------------------------------------
    Case(
        "cfg-file-missing",
        cli=("tune", "--config", "c.yaml"),
        expect=("c.yaml", "does not exist"),
    ),
    Case(
        "cfg-unknown-key",
        cli=("tune", "--config", "c.yaml"),
        files={"c.yaml": "model: llama3-8b\nbatch: 64\n"},
        expect=("c.yaml", "'batch'", "global_batch_size"),
    ),
    Case(
        "cfg-word-for-a-number",
        cli=("tune", "--config", "c.yaml"),
        files={"c.yaml": "model: llama3-8b\nn_trials: many\n"},
        expect=("c.yaml", "n_trials", "many"),
    ),
    Case(
        "cfg-number-for-a-switch",
        cli=("tune", "--config", "c.yaml"),
        files={"c.yaml": "quiet: 3\n"},
        expect=("c.yaml", "quiet", "true or false"),
    ),
    Case(
        "cfg-bad-choice",
        cli=("tune", "--config", "c.yaml"),
        files={"c.yaml": "sampler: cmaes\n"},
        expect=("c.yaml", "sampler", "cmaes"),
    ),
    Case(
        "cfg-huge-batch",
        cli=("tune", "--config", "c.yaml"),
        files={"c.yaml": "global_batch_size: 4611686018427387904\n"},
        expect=("c.yaml", "global_batch_size", "limit"),
    ),
    Case(
        "cfg-list-for-a-value",
        cli=("tune", "--config", "c.yaml"),
        files={"c.yaml": "model: [llama3-8b, llama3-70b]\n"},
        expect=("c.yaml", "model", "single value"),
    ),
    Case(
        "cfg-missing-required",
        cli=("tune", "--config", "c.yaml"),
        files={"c.yaml": "model: llama3-8b\n"},
        expect=("--cluster", "--global-batch-size", "--config"),
    ),
    Case(
        "cfg-cluster-mapping-without-gpus-per-node",
        cli=("tune", "--config", "c.yaml"),
        files={"c.yaml": "model: llama3-8b\nglobal_batch_size: 64\ncluster: {gpu: h100-sxm}\n"},
        expect=("--cluster", "gpus_per_node"),
    ),
    Case(
        "cfg-model-mapping-missing-keys",
        cli=("tune", "--config", "c.yaml"),
        files={"c.yaml": "model: {n_layers: 2}\ncluster: h100-sxm:1x8\nglobal_batch_size: 64\n"},
        expect=("--model", "hidden_size"),
    ),
    Case("tune-without-model", cli=TUNE_B[:1] + TUNE_B[3:], expect=("--model",)),
    Case("tune-dry-run-bad-pin", cli=TUNE_B + ("--pin", "tp=3", "--dry-run"), expect=("tp",)),
    # ---- issue 22: names that would become code -------------------------------------------------
    *(
        Case(
            f"i22.1-model-name-{i}",
            cli=EXPORT + ("dp=8,global_batch_size=64", "--model", "m.yaml", "--out", "e"),
            files={"m.yaml": MODEL + f"name: {json.dumps(name)}\n"},
            expect=("model name", "not allowed"),
        )
        for i, name in enumerate(HOSTILE_NAMES)
    ),
    Case(
        "i22.1-profile-name",
        cli=est(cluster="gpu.yaml:1x8"),
        files={"gpu.yaml": PROFILE.replace("name: broken-gpu", 'name: "g\\ntouch MARK"')},
        expect=("name", "not allowed"),
    ),
    Case(
        "i22.1-api-model-name",
        api="ModelSpec(name='m]\\n[table]', n_layers=2, hidden_size=64, n_heads=4, "
        "vocab_size=10, seq_len=8)",
        expect=("model name",),
    ),
    # ---- issue 22: folders that are not autosearch's --------------------------------------------
    Case(
        "i22.2-tune-out-folder-of-user-files",
        cli=TUNE_B + ("--n-trials", "3", "--out", "mine"),
        files={"mine/notes.txt": "precious", "mine/data/x.csv": "1,2\n"},
        expect=("--out 'mine'", "autosearch did not write", "notes.txt"),
    ),
    Case(
        "i22.2-tune-out-cwd-of-user-files",
        cli=TUNE_B + ("--n-trials", "3", "--out", "."),
        files={"notes.txt": "precious"},
        expect=("autosearch did not write",),
    ),
    Case(
        "i22.2-export-out-folder-of-user-files",
        cli=("export", "--strategy", OK_STRATEGY, "--to", "all", "--out", "mine"),
        files={"mine/megatron.sh": "#!/bin/sh\necho mine\n"},
        expect=("--out 'mine'", "autosearch did not write"),
    ),
    # ---- issue 22: storage that is not the study's ----------------------------------------------
    Case(
        "i22.4-sqlite-with-user-tables",
        cli=TUNE_B + ("--n-trials", "3", "--storage", "sqlite:///app.db", "--out", "o"),
        files={"app.db": USER_DB},
        expect=("customers", "--storage"),
    ),
    Case(
        "i22.4-sqlite-path-with-user-tables",
        cli=TUNE_B + ("--n-trials", "3", "--storage", "app.db", "--out", "o"),
        files={"app.db": USER_DB},
        expect=("customers", "not Optuna's"),
    ),
    Case(
        "i22.4-sqlite-url-without-path",
        cli=TUNE_B + ("--n-trials", "3", "--storage", "sqlite://", "--out", "o"),
        expect=("--storage", "names no file"),
    ),
    Case(
        "i22.4-database-url-without-database",
        cli=TUNE_B + ("--n-trials", "3", "--storage", "postgresql+psycopg://me@127.0.0.1:1"),
        expect=("--storage", "names no database"),
    ),
    # ---- issue 22: inputs that are not regular files --------------------------------------------
    *(
        Case(f"i22.5-fifo-{flag.strip('-')}", cli=cli, files={exp[0]: FIFO}, expect=exp)
        for flag, cli, exp in (
            ("--config", ("tune", "--config", "p.yaml"), ("p.yaml", "named pipe")),
            ("--space", TUNE_B + ("--space", "p.yaml"), ("p.yaml", "named pipe")),
            ("--cluster", est(cluster="p.yaml"), ("p.yaml", "named pipe")),
            ("--model", est(model="p.yaml"), ("p.yaml", "named pipe")),
            ("--strategy", est("p.yaml"), ("p.yaml", "named pipe")),
            ("--storage", TUNE_B + ("--storage", "p.journal"), ("p.journal", "named pipe")),
        )
    ),
    Case(
        "i22.5-fifo-hf-config",
        cli=est(model="config.json"),
        files={"config.json": FIFO},
        expect=("config.json", "named pipe"),
    ),
    Case("i22.5-device-as-config", cli=("tune", "--config", "/dev/zero"), expect=("device",)),
    Case("i22.5-device-as-model", cli=est(model="/dev/zero"), expect=("device",)),
    Case(
        "i22.5-folder-as-strategy", cli=est("d.yaml"), files={"d.yaml/": 0o755}, expect=("folder",)
    ),
    *(
        Case(
            f"i22.5-sweep-out-{dev.rsplit('/', 1)[1]}",
            cli=SWEEP + ("--clusters", "h100-sxm:1x8", "--out", dev),
            expect=(dev, "character device"),
        )
        for dev in ("/dev/full", "/dev/null", "/dev/zero")
    ),
    Case(
        "i22.5-sweep-out-fifo",
        cli=SWEEP + ("--clusters", "h100-sxm:1x8", "--out", "s.csv"),
        files={"s.csv": FIFO},
        expect=("s.csv", "named pipe"),
    ),
    # ---- issue 22: processes bounded by the machine ---------------------------------------------
    Case(
        "i22.6-calibrate-world-sizes-typo",
        cli=("calibrate", "--device", "cpu", "--world-sizes", "1,100000", "--out", "c.yaml"),
        expect=("--world-sizes", "100,000 processes", "--force"),
        timeout_s=120,  # refused before any process starts, after torch's import (slow if loaded)
    ),
    # ---- issue 22: what YAML and JSON would read otherwise than written -------------------------
    Case(
        "i22.8-strategy-file-duplicate-key",
        cli=est("s.yaml"),
        files={"s.yaml": "dp: 8\ntp: 1\npp: 1\ndp: 4\nglobal_batch_size: 64\n"},
        expect=("s.yaml", "'dp' is given twice", "lines 1 and 4"),
    ),
    Case(
        "i22.8-strategy-file-octal",
        cli=est("s.yaml"),
        files={"s.yaml": "dp: 010\ntp: 1\npp: 1\nglobal_batch_size: 64\n"},
        expect=("s.yaml", "'010'", "octal"),
    ),
    Case(
        "i22.8-strategy-file-base-60",
        cli=est("s.yaml"),
        files={"s.yaml": "dp: 8\ntp: 1\npp: 1\nglobal_batch_size: 1:04\n"},
        expect=("s.yaml", "'1:04'", "base 60"),
    ),
    Case(
        "i22.8-model-file-duplicate-key",
        cli=est(model="m.yaml"),
        files={"m.yaml": MODEL + "n_layers: 8\n"},
        expect=("m.yaml", "'n_layers' is given twice"),
    ),
    Case(
        "i22.8-space-duplicate-key",
        cli=TUNE_B + ("--space", "s.yaml"),
        files={"s.yaml": "tp: [1, 2]\ntp: [8]\n"},
        expect=("s.yaml", "'tp' is given twice"),
    ),
    Case(
        "i22.8-config-duplicate-key",
        cli=("tune", "--config", "c.yaml"),
        files={"c.yaml": "model: llama3-8b\nmodel: llama3-70b\n"},
        expect=("c.yaml", "'model' is given twice"),
    ),
    Case(
        "i22.8-cluster-duplicate-key",
        cli=est(cluster="c.yaml"),
        files={"c.yaml": "gpu: h100-sxm\nn_nodes: 1\ngpus_per_node: 8\nn_nodes: 2\n"},
        expect=("c.yaml", "'n_nodes' is given twice"),
    ),
    Case(
        "i22.8-key-value-duplicate",
        cli=est("dp=8,global_batch_size=64,dp=4"),
        expect=("'dp' twice",),
    ),
    Case(
        "i22.8-hf-boolean-as-string",
        cli=est(model="config.json"),
        files={"config.json": json.dumps({**HF_TINY, "tie_word_embeddings": "false"})},
        expect=("tie_word_embeddings", "true or false", "'false'"),
    ),
    Case(
        "i22.8-hf-zero-kv-heads",
        cli=est(model="config.json"),
        files={"config.json": json.dumps({**HF_TINY, "num_key_value_heads": 0})},
        expect=("num_key_value_heads", ">= 1"),
    ),
    Case(
        "i22.8-hf-head-dim-mapping",
        cli=est(model="config.json"),
        files={"config.json": json.dumps({**HF_TINY, "head_dim": {}})},
        expect=("head_dim", ">= 1"),
    ),
    Case(
        "i22.8-hf-duplicate-key",
        cli=est(model="config.json"),
        files={"config.json": json.dumps(HF_TINY)[:-1] + ', "hidden_size": 128}'},
        expect=("'hidden_size'", "twice"),
    ),
    Case(
        "i22.8-api-key-value-duplicate",
        api="Strategy.parse('dp=8,tp=2,tp=4')",
        expect=("'tp' twice",),
    ),
    # ---- the Python API -------------------------------------------------------------------------
    Case("api-strategy-string-degree", api="Strategy(dp='8')", expect=("dp", "'8'")),
    Case("api-strategy-bool-degree", api="Strategy(dp=True)", expect=("dp", "True")),
    Case("api-strategy-huge-degree", api="Strategy(dp=2**70)", expect=("dp", "limit")),
    Case("api-strategy-nan-degree", api="Strategy(dp=float('nan'))", expect=("dp", "nan")),
    Case("api-strategy-inf-degree", api="Strategy(tp=float('inf'))", expect=("tp", "inf")),
    Case("api-strategy-amp-none", api="Strategy(amp=None)", expect=("amp", "None")),
    Case(
        "api-strategy-positional", api="Strategy(8)", raises=("TypeError",), expect=("positional",)
    ),
    Case("api-strategy-parse-garbage", api="Strategy.parse('dp8')", expect=("dp8",)),
    Case("api-strategy-from-dict-unknown", api="Strategy.from_dict({'dpp': 8})", expect=("dpp",)),
    Case(
        "api-strategy-nan-yaml",
        api="Strategy.from_yaml('s.yaml')",
        files={"s.yaml": "dp: .nan\n"},
        expect=("s.yaml", "nan"),
    ),
    Case(
        "api-model-missing-fields",
        api="ModelSpec(n_layers=4)",
        raises=("TypeError",),
        expect=("hidden_size",),
    ),
    Case("api-model-load-int", api="ModelSpec.load(123)", raises=("TypeError",), expect=("int",)),
    Case("api-model-unknown", api="ModelSpec.load('gpt-99')", expect=("gpt-99",)),
    Case(
        "api-model-kv-heads",
        api="ModelSpec(n_layers=2, hidden_size=256, n_heads=4, n_kv_heads=3, vocab_size=10, "
        "seq_len=8)",
        expect=("n_kv_heads 3",),
    ),
    Case(
        "api-model-huge-vocab",
        api="ModelSpec(n_layers=2, hidden_size=256, n_heads=4, vocab_size=2**40, seq_len=8)",
        expect=("vocab_size", "limit"),
    ),
    Case("api-cluster-unknown-gpu", api="Cluster(gpu='l40s')", expect=("l40s",)),
    Case("api-cluster-zero-nodes", api="Cluster(gpu='h100-sxm', n_nodes=0)", expect=("n_nodes",)),
    Case(
        "api-cluster-huge-gpus-per-node",
        api="Cluster(gpu='h100-sxm', gpus_per_node=10**9)",
        expect=("gpus_per_node", "limit"),
    ),
    Case(
        "api-cluster-profile-inf",
        api="Cluster(gpu='p.yaml')",
        files={"p.yaml": PROFILE.replace("989.4e12", ".inf")},
        expect=("p.yaml", "inf"),
    ),
    Case(
        "api-estimate-world-size",
        api="estimate('llama3-8b', 'h100-sxm:1x8', 'dp=4,global_batch_size=8')",
        expect=("8 devices",),
    ),
    Case(
        "api-estimate-bad-key",
        api="estimate('llama3-8b', 'h100-sxm:1x8', 'dp=8,foo=1')",
        expect=("foo",),
    ),
    Case(
        "api-tune-zero-batch",
        api="tune('llama3-8b', 'h100-sxm:1x8', global_batch_size=0)",
        expect=("global_batch_size",),
    ),
    Case(
        "api-tune-zero-trials",
        api="tune('llama3-8b', 'h100-sxm:1x8', global_batch_size=64, n_trials=0)",
        expect=("n_trials",),
    ),
    Case(
        "api-tune-sampler",
        api="tune('llama3-8b', 'h100-sxm:1x8', global_batch_size=64, sampler='cmaes')",
        expect=("cmaes",),
    ),
    Case(
        "api-tune-objective",
        api="tune('llama3-8b', 'h100-sxm:1x8', global_batch_size=64, objective='speed')",
        expect=("speed",),
    ),
    Case(
        "api-tune-space-missing",
        api="tune('llama3-8b', 'h100-sxm:1x8', global_batch_size=64, space='nope.yaml')",
        expect=("nope.yaml",),
    ),
    Case(
        "api-tune-storage-scheme",
        api="tune('llama3-8b', 'h100-sxm:1x8', global_batch_size=64, storage='foo://bar')",
        expect=("foo",),
    ),
    Case(
        "api-space-negative-batch",
        api="SearchSpace('llama3-8b', 'h100-sxm:1x8', global_batch_size=-1)",
        expect=("global_batch_size",),
    ),
    Case(
        "api-space-bad-pin",
        api="SearchSpace('llama3-8b', 'h100-sxm:1x8', global_batch_size=64, tp=3)",
        expect=("tp",),
    ),
    Case(
        "api-space-unknown-config",
        api="SearchSpace('llama3-8b', 'h100-sxm:1x8', global_batch_size=64, config='nope')",
        expect=("nope",),
    ),
    # ---- issue 22: the Engine's numbers and types, refused before anything runs ----------------
    # (ENGINE is a model factory no case reaches: each is refused before a model is built.)
    *[
        Case(f"api-engine-{name}", api=f"Engine(ENGINE, {arg}).prepare()", expect=words)
        for name, arg, words in [
            ("clip-negative", "grad_clip_norm=-1.0", ("grad_clip_norm=-1.0", "> 0", "None")),
            ("clip-zero", "grad_clip_norm=0", ("grad_clip_norm=0", "> 0")),
            ("clip-nan", "grad_clip_norm=float('nan')", ("grad_clip_norm=nan",)),
            ("clip-string", "grad_clip_norm='1.0'", ("grad_clip_norm='1.0'",)),
            ("clip-bool", "grad_clip_norm=True", ("grad_clip_norm=True",)),
            ("metrics-int", "metrics=5", ("metrics=5", "Accuracy()")),
            ("metrics-list-of-str", "metrics=['accuracy']", ("metrics=['accuracy']", "Metric")),
            ("loss-string", "loss='mse'", ("loss='mse'", "callable")),
            ("optimizer-string", "optimizer='adamw'", ("optimizer='adamw'", "AdamW")),
            ("scheduler-int", "lr_scheduler=100", ("lr_scheduler=100", "recipe optimizer")),
            ("seed-float", "seed=1.5", ("seed=1.5", "integer")),
            ("seed-huge", "seed=2**70", ("seed=", "2**64")),
            ("meta-init-string", "meta_init='yes'", ("meta_init='yes'", "True or False")),
            ("loss-parallel-int", "loss_parallel=1", ("loss_parallel=1", "True or False")),
        ]
    ],
    Case("api-engine-model-none", api="Engine(None).prepare()", expect=("model=None", "factory")),
    *[
        Case(f"api-fit-{name}", api=f"Engine(ENGINE).fit([], {arg})", expect=words)
        for name, arg, words in [
            ("epochs-negative", "epochs=-1", ("epochs=-1", "integer >= 1")),
            ("epochs-zero", "epochs=0", ("epochs=0",)),
            ("epochs-float", "epochs=2.0", ("epochs=2.0",)),
            ("batch-size-zero", "batch_size=0", ("batch_size=0", "None for the strategy's")),
            ("batch-size-negative", "batch_size=-8", ("batch_size=-8",)),
            ("steps-per-epoch-zero", "steps_per_epoch=0", ("steps_per_epoch=0",)),
            ("valid-steps-zero", "valid_steps=0", ("valid_steps=0",)),
            ("valid-freq-zero", "valid_freq=0", ("valid_freq=0",)),
            ("log-freq-zero", "log_freq=0", ("log_freq=0",)),
            ("save-freq-negative", "save_freq=-1", ("save_freq=-1",)),
            ("save-steps-zero", "save_steps=0, save_dir='ck'", ("save_steps=0",)),
            ("verbose-string", "verbose='yes'", ("verbose='yes'",)),
            ("shuffle-string", "shuffle='yes'", ("shuffle='yes'", "True or False")),
            ("tensorboard-string", "tensorboard='no', log_dir='l'", ("tensorboard='no'",)),
            ("callbacks-one-object", "callbacks=object()", ("callbacks=", "callbacks=[...]")),
            ("collate-fn-string", "collate_fn='stack'", ("collate_fn='stack'",)),
            ("resume-int", "resume=3", ("resume=3", "checkpoint path")),
            ("save-dir-int", "save_dir=7", ("save_dir=7", "folder path")),
            ("resume-without-save-dir", "resume=True", ("resume=True", "save_dir")),
        ]
    ],
    Case(
        "api-fit-two-problems",
        api="Engine(ENGINE).fit([], epochs=-1, batch_size=0)",
        expect=("2 problems", "epochs=-1", "batch_size=0"),
    ),
    Case(
        "api-evaluate-steps-zero",
        api="Engine(ENGINE).evaluate([], steps=0)",
        expect=("steps=0", "batches per epoch"),
    ),
    Case(
        "api-predict-batch-size-zero",
        api="Engine(ENGINE).predict([], batch_size=0)",
        expect=("batch_size=0",),
    ),
    Case(
        "api-dataloader-num-workers-negative",
        api="Engine(ENGINE).dataloader([], num_workers=-1)",
        expect=("num_workers=-1",),
    ),
    # ---- issue 35: one typed schema at every entry point, the table grown by class -------------
    # Each class lists the cases that exercise it across every entry point that reads that kind
    # of input (a CLI flag, a --config file, a YAML / JSON file, the Python API); the ids say the
    # class: i35.type-, i35.number-, i35.spelling-, i35.engine-, i35.fault-.
    # -- types: a file or a call gives the wrong kind of value
    *[
        Case(f"i35.type-cluster-file-gpu-{name}", cli=est(cluster="c.yaml"), files=files, expect=e)
        for name, files, e in [
            (
                "list",
                {"c.yaml": "gpu: [h100-sxm]\nn_nodes: 1\ngpus_per_node: 8\n"},
                ("c.yaml", "gpu", "['h100-sxm'] (a list)"),
            ),
            (
                "int",
                {"c.yaml": "gpu: 8\nn_nodes: 1\ngpus_per_node: 8\n"},
                ("c.yaml", "gpu", "8 (an int)"),
            ),
        ]
    ],
    Case(
        "i35.type-config-cluster-gpu-list",
        cli=("tune", "--config", "c.yaml"),
        files={
            "c.yaml": "model: llama3-8b\nglobal_batch_size: 64\n"
            "cluster: {gpu: [h100-sxm], n_nodes: 1, gpus_per_node: 8}\n"
        },
        expect=("--cluster", "gpu", "(a list)"),
    ),
    *[
        Case(f"i35.type-api-{name}", api=code, expect=e, raises=raises)
        for name, code, e, raises in [
            ("cluster-gpu-list", "Cluster(gpu=['h100-sxm'])", ("gpu", "(a list)"), ("SpecError",)),
            (
                "cluster-dict-gpu-int",
                "Cluster.from_dict({'gpu': 5, 'n_nodes': 1, 'gpus_per_node': 8})",
                ("gpu", "5 (an int)"),
                ("SpecError",),
            ),
            (
                "cluster-parse-mapping-gpu-list",
                "Cluster.parse({'gpu': ['h100-sxm'], 'n_nodes': 1, 'gpus_per_node': 8})",
                ("gpu", "(a list)"),
                ("SpecError",),
            ),
            (
                "cluster-from-list",
                "Cluster.from_dict([1])",
                ("mapping", "(a list)"),
                ("SpecError",),
            ),
            ("cluster-parse-none", "Cluster.parse(None)", ("cluster", "None"), ("SpecError",)),
            (
                "estimate-cluster-none",
                f"estimate('llama3-8b', None, {OK_STRATEGY!r})",
                ("cluster", "None"),
                ("SpecError",),
            ),
            (
                "estimate-model-none",
                f"estimate(model=None, cluster='h100-sxm:1x8', strategy={OK_STRATEGY!r})",
                ("model", "None (a NoneType)"),
                ("TypeError",),
            ),
            ("model-load-none", "ModelSpec.load(None)", ("model", "None"), ("TypeError",)),
            (
                "strategy-from-list",
                "Strategy.from_dict([1, 2])",
                ("strategy", "mapping", "(a list)"),
                ("SpecError",),
            ),
            (
                "tune-progress-text",
                "tune('llama3-8b', 'h100-sxm:1x8', global_batch_size=64, progress='yes')",
                ("progress", "'yes'", "callable"),
                ("SpecError",),
            ),
            (
                "tune-pin-int",
                "tune('llama3-8b', 'h100-sxm:1x8', global_batch_size=64, pin=5)",
                ("pin", "KEY=VALUE"),
                ("SpecError",),
            ),
        ]
    ],
    # a hardware profile's lists and mappings, through --cluster and through Cluster(gpu=...)
    *[
        Case(
            f"i35.type-profile-{key}", cli=est(cluster="p.yaml:1x8"), files={"p.yaml": p}, expect=e
        )
        for key, p, e in [
            ("sources", PROFILE + "sources: 5\n", ("p.yaml", "sources", "list of texts")),
            ("measured", PROFILE + "measured: 5\n", ("p.yaml", "measured", "list of texts")),
            ("calibration", PROFILE + "calibration: [1]\n", ("p.yaml", "calibration", "mapping")),
            (
                "op-efficiency",
                PROFILE.replace("latency_s: 8.0e-6,", "latency_s: 8.0e-6, op_efficiency: [1],"),
                ("p.yaml", "intra_node.op_efficiency", "mapping"),
            ),
            (
                "attention-kernels",
                PROFILE.replace("fp32: 0.45}}", "fp32: 0.45}, kernels: 3}"),
                ("p.yaml", "attention.kernels", "mapping"),
            ),
            ("description", PROFILE + "description: [a]\n", ("p.yaml", "description", "text")),
        ]
    ],
    Case(
        "i35.type-api-profile-measured",
        api="Cluster(gpu='p.yaml')",
        files={"p.yaml": PROFILE + "measured: 5\n"},
        expect=("p.yaml", "measured", "list of texts"),
    ),
    # a JSON nested thousands deep, wherever JSON is read
    Case(
        "i35.type-hf-config-nested-deep",
        cli=est(model="config.json"),
        files={"config.json": '{"a":' * 5000 + "1" + "}" * 5000},
        expect=("config.json", "nested too deeply"),
    ),
    Case(
        "i35.type-api-hf-config-nested-deep",
        api="ModelSpec.load('config.json')",
        files={"config.json": "[" * 5000 + "]" * 5000},
        expect=("config.json", "nested too deeply"),
    ),
    Case(
        "i35.type-config-json-nested-deep",
        cli=("tune", "--config", "c.json"),
        files={"c.json": '{"a":' * 5000 + "1" + "}" * 5000},
        expect=("c.json", "nested too deeply"),
    ),
    Case(
        "i35.type-space-not-a-mapping",
        cli=TUNE_B + ("--space", "s.yaml"),
        files={"s.yaml": "space: [1, 2]\n"},
        expect=("s.yaml", "space must be a mapping"),
    ),
    # binary files where a CSV is read: refused, and left as they are
    Case(
        "i35.type-sweep-out-binary",
        cli=SWEEP + ("--clusters", "h100-sxm:1x8", "--out", "s.csv"),
        files={"s.csv": bytes(range(128, 256)) * 8},
        expect=("s.csv", "not UTF-8"),
    ),
    Case(
        "i35.type-calibrate-from-csv-binary",
        cli=("calibrate", "--from-csv", "m.csv", "--out", "c.yaml"),
        files={"m.csv": bytes(range(128, 256)) * 8},
        expect=("--from-csv", "m.csv", "not UTF-8"),
        timeout_s=120,  # calibrate's imports (slow when the machine is loaded)
    ),
    # -- numbers outside their domain: finite, signs, bounds
    *[
        Case(f"i35.number-validate-{name}", cli=VALIDATE + flags, expect=e)
        for name, flags, e in [
            ("memory-limit-nan", ("--memory-limit-gib", "nan"), ("--memory-limit-gib", "nan")),
            ("memory-limit-inf", ("--memory-limit-gib", "inf"), ("--memory-limit-gib", "inf")),
            ("timeout-negative", ("--timeout-s", "-5"), ("--timeout-s", "> 0", "-5")),
        ]
    ],
    Case(
        "i35.number-validate-config-timeout-negative",
        cli=("validate", "--config", "c.yaml"),
        files={"c.yaml": "strategies: [s.yaml]\nmodel: llama3-8b\ntimeout_s: -1\n"},
        expect=("c.yaml", "timeout_s", "> 0"),
    ),
    *[
        Case(f"i35.number-api-{name}", api=code, expect=e)
        for name, code, e in [
            (
                "validate-timeout-negative",
                "validate('llama3-8b', [Strategy()], timeout_s=-1)",
                ("timeout_s", "> 0", "-1"),
            ),
            (
                "validate-memory-limit-nan",
                "validate('llama3-8b', [Strategy()], memory_limit_bytes=float('nan'))",
                ("memory_limit_bytes", "nan"),
            ),
            ("engine-tune-timeout-negative", "Engine(ENGINE).tune(timeout_s=-5)", ("timeout_s",)),
            (
                "engine-tune-validate-top-k-negative",
                "Engine(ENGINE).tune(validate_top_k=-1)",
                ("validate_top_k", ">= 0"),
            ),
            (
                "tune-price-1e308",
                "tune('llama3-8b', 'h100-sxm:1x8', global_batch_size=64, "
                "price_per_gpu_hour=1e308)",
                ("price_per_gpu_hour", "100,000"),
            ),
            (
                "tune-seed-negative",
                "tune('llama3-8b', 'h100-sxm:1x8', global_batch_size=64, seed=-1)",
                ("seed", ">= 0"),
            ),
        ]
    ],
    *[
        Case(f"i35.number-{name}", cli=cli, expect=e)
        for name, cli, e in [
            ("tune-price-1e308", TUNE_B + ("--price-per-gpu-hour", "1e308"), ("100,000",)),
            (
                "sweep-price-1e308",
                SWEEP + ("--clusters", "h100-sxm:1x8", "--price-per-gpu-hour", "1e308"),
                ("--price-per-gpu-hour", "100,000"),
            ),
            (
                "sweep-price-per-gpu-1e308",
                SWEEP + ("--clusters", "h100-sxm:1x8", "--price-per-gpu-hour", "h100-sxm=1e308"),
                ("--price-per-gpu-hour (h100-sxm)", "100,000"),
            ),
            ("tune-seed-negative", TUNE_B + ("--seed", "-1"), ("--seed", ">= 0")),
            ("tune-seed-huge", TUNE_B + ("--seed", str(1 << 40)), ("--seed", "above the limit")),
            (
                "sweep-seed-negative",
                SWEEP + ("--clusters", "h100-sxm:1x8", "--seed", "-1"),
                ("--seed", ">= 0"),
            ),
        ]
    ],
    *[
        Case(f"i35.number-config-{name}", cli=("tune", "--config", "c.yaml"), files=f, expect=e)
        for name, f, e in [
            (
                "price-1e308",
                {"c.yaml": CONFIG_OK + "price_per_gpu_hour: 1.0e+308\n"},
                ("c.yaml", "price_per_gpu_hour", "100,000"),
            ),
            ("seed-negative", {"c.yaml": CONFIG_OK + "seed: -1\n"}, ("c.yaml", "seed", ">= 0")),
            (
                "seed-float",
                {"c.yaml": CONFIG_OK + "seed: 1.5\n"},
                ("c.yaml", "seed", "integer"),
            ),
        ]
    ],
    # -- two spellings of one thing: refused, naming both
    *[
        Case(f"i35.spelling-config-{cmd}", cli=(cmd, "--config", "c.yaml"), files=f, expect=e)
        for cmd, f, e in [
            (
                "tune",
                {
                    "c.yaml": CONFIG_OK.replace("global_batch_size", "global-batch-size")
                    + "global_batch_size: 128\n"
                },
                ("'global-batch-size' and 'global_batch_size'", "given twice"),
            ),
            (
                "estimate",
                {
                    "c.yaml": "model: llama3-8b\ncluster: h100-sxm:1x8\nstrategy: dp=8\n"
                    "global-batch-size: 64\nglobal_batch_size: 64\n"
                },
                ("'global-batch-size' and 'global_batch_size'", "given twice"),
            ),
            (
                "sweep",
                {
                    "c.yaml": "models: llama3-8b\nclusters: h100-sxm:1x8\n"
                    "global-batch-sizes: 64\nglobal_batch_sizes: 64\n"
                },
                ("'global-batch-sizes' and 'global_batch_sizes'", "given twice"),
            ),
        ]
    ],
    Case(
        "i35.spelling-pin-through-alias",
        cli=TUNE_B + ("--pin", "mp=2", "--pin", "tp=4"),
        expect=("tp is pinned twice", "as mp and as tp"),
    ),
    Case(
        "i35.spelling-api-pin-through-alias",
        api="tune('llama3-8b', 'h100-sxm:1x8', global_batch_size=64, pin={'mp': 2, 'tp': 4})",
        expect=("tp is pinned twice",),
    ),
    Case(
        "i35.spelling-api-space-alias",
        api="SearchSpace('llama3-8b', 'h100-sxm:1x8', global_batch_size=64, mp=2, tp=4)",
        expect=("'mp' and 'tp' both set tp",),
    ),
    Case(
        "i35.spelling-space-file-alias",
        cli=TUNE_B + ("--space", "s.yaml"),
        files={"s.yaml": "mp: [2]\ntp: [4]\n"},
        expect=("s.yaml", "'mp' and 'tp' both set tp"),
    ),
    Case(
        "i35.spelling-space-file-keys-beside-space",
        cli=TUNE_B + ("--space", "s.yaml"),
        files={"s.yaml": "space:\n  tp: [1, 2]\npp: [1]\n"},
        expect=("s.yaml", "pp beside 'space'"),
    ),
    Case(
        "i35.spelling-strategy-file-alias",
        cli=est("s.yaml"),
        files={"s.yaml": "dp: 1\nmp: 8\ntp: 8\npp: 1\nglobal_batch_size: 64\n"},
        expect=("s.yaml", "'tp' is given twice"),
    ),
    Case(
        "i35.spelling-api-strategy-alias",
        api="Strategy.from_dict({'mp': 2, 'tp': 2})",
        expect=("'tp' is given twice",),
    ),
    Case(
        "i35.spelling-hf-dense-family-with-experts",
        cli=est(model="config.json"),
        files={"config.json": json.dumps({**HF_TINY, "model_type": "qwen2", "num_experts": 8})},
        expect=("config.json", "qwen2", "dense family", "num_experts = 8", "qwen2_moe"),
    ),
    Case(
        "i35.spelling-api-hf-dense-family-with-experts",
        api="ModelSpec.load('config.json')",
        files={"config.json": json.dumps({**HF_TINY, "n_routed_experts": 4})},
        expect=("llama", "dense family", "n_routed_experts"),
    ),
    *[
        Case(f"i35.spelling-sweep-{flag.strip('-')}", cli=cli, expect=(flag, "twice") + e)
        for flag, cli, e in [
            (
                "--clusters",
                SWEEP + ("--clusters", "h100:1x8,h100-sxm:1x8"),
                ("'h100:1x8' and 'h100-sxm:1x8'",),
            ),
            (
                "--models",
                ("sweep", "--models", "llama3-8b,llama3-8b", "--global-batch-sizes", "64")
                + ("--clusters", "h100-sxm:1x8"),
                (),
            ),
            (
                "--global-batch-sizes",
                ("sweep", "--models", "llama3-8b", "--global-batch-sizes", "64,64")
                + ("--clusters", "h100-sxm:1x8"),
                (),
            ),
        ]
    ],
    # -- the Engine's inputs, refused before a model is built
    *[
        Case(f"i35.engine-{name}", api=code, expect=e, files=files)
        for name, code, e, files in [
            ("fit-none", "Engine(ENGINE).fit(None)", ("fit", "train_data=None", "dataset"), {}),
            ("evaluate-int", "Engine(ENGINE).evaluate(5)", ("valid_data=5", "dataset"), {}),
            ("predict-text", "Engine(ENGINE).predict('data')", ("test_data='data'",), {}),
            ("dataloader-none", "Engine(ENGINE).dataloader(None)", ("dataset=None",), {}),
            (
                "load-text-file",
                "Engine(ENGINE).load('t.txt')",
                ("t.txt", "not a checkpoint"),
                {"t.txt": "hello world\n"},
            ),
            ("load-none", "Engine(ENGINE).load(None)", ("path=None", "checkpoint"), {}),
            ("save-int", "Engine(ENGINE).save(5)", ("path=5",), {}),
            *[
                (
                    f"world-size-{n}",
                    f"import os; os.environ['WORLD_SIZE'] = {v!r}; Engine(ENGINE).prepare()",
                    (f"WORLD_SIZE={v!r}", "torchrun"),
                    {},
                )
                for n, v in (("word", "abc"), ("zero", "0"), ("float", "2.5"))
            ],
        ]
    ],
    Case(
        "i35.engine-hf-family-not-wrapped",
        api="import transformers; c = transformers.OPTConfig(num_hidden_layers=1, hidden_size=32,"
        " num_attention_heads=2, ffn_dim=64, vocab_size=64, word_embed_proj_dim=32);"
        " Engine(transformers.OPTForCausalLM(c)).prepare()",
        expect=("OPTForCausalLM", "'opt'", "llama"),
        timeout_s=120,  # transformers' import
    ),
    # -- faults: paths checked before anything is made
    *[
        Case(f"i35.fault-long-out-{name}", cli=cli, expect=("--out", "cannot be made") + e)
        for name, cli, e in [
            ("tune-name", TUNE_B + ("--out", "a/" + "x" * 300 + "/o"), ("300 bytes",)),
            ("export-name", EXPORT + (OK_STRATEGY, "--out", "a/" + "x" * 300), ("300 bytes",)),
            (
                "sweep-name",
                SWEEP + ("--clusters", "h100-sxm:1x8", "--out", "a/" + "x" * 300 + ".csv"),
                ("304 bytes",),
            ),
            (
                "sweep-report-name",
                SWEEP + ("--clusters", "h100-sxm:1x8", "--out", "a/" + "x" * 250 + ".csv"),
                ("_report", "257 bytes"),
            ),
            ("tune-path", TUNE_B + ("--out", "/".join(["y" * 200] * 25)), ("over the 4095",)),
        ]
    ],
]


def _api_namespace() -> dict:
    from autosearch import Cluster, Engine, ModelSpec, SpecError, Strategy, estimate, tune
    from autosearch.validation import validate
    from search_spaces import SearchSpace

    def never_built():
        raise AssertionError("the case reached the model; its input should have been refused")

    return dict(
        Engine=Engine,
        ENGINE=never_built,
        Cluster=Cluster,
        ModelSpec=ModelSpec,
        SpecError=SpecError,
        Strategy=Strategy,
        SearchSpace=SearchSpace,
        estimate=estimate,
        tune=tune,
        validate=validate,
    )


def _write_files(folder: Path, files: dict) -> None:
    for rel, content in files.items():
        path = folder / rel
        if rel.endswith("/"):
            path.mkdir(parents=True, exist_ok=True)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        if content is FIFO:
            os.mkfifo(path)
        elif isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8")
    # Permissions last (a read-only folder cannot be filled).
    for rel, content in files.items():
        if rel.endswith("/"):
            os.chmod(folder / rel, content)


def _snapshot(folder: Path) -> dict[str, tuple]:
    """Every path under `folder` with its size and modification time."""
    out = {}
    for root, dirs, names in os.walk(folder):
        for name in dirs + names:
            path = os.path.join(root, name)
            st = os.lstat(path)
            out[os.path.relpath(path, folder)] = (st.st_size, st.st_mtime_ns, st.st_mode)
    return out


def _vm_size_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def _child(case: Case, folder: Path, out_path: Path, err_path: Path, result_path: Path) -> None:
    """Runs in the forked child: never returns."""
    code = 99
    try:
        os.chdir(folder)
        for fd, path in ((1, out_path), (2, err_path)):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
            os.dup2(target, fd)
            os.close(target)
        sys.stdout = open(1, "w", encoding="utf-8", closefd=False, buffering=1)
        sys.stderr = open(2, "w", encoding="utf-8", closefd=False, buffering=1)
        result_fd = os.open(result_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        limit = _vm_size_bytes() + MEMORY_HEADROOM_BYTES
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if case.as_user is not None and os.geteuid() == 0:
            # Read what the case needs while root still can (the Python install may sit in a
            # folder only root reads).
            import autosearch.tuning  # noqa: F401
            import cost_models.analytic  # noqa: F401
            import search_spaces  # noqa: F401
            from autosearch import Cluster
            from autosearch.cli import build_parser
            from autosearch.core import model_catalog

            build_parser()
            model_catalog()
            Cluster.parse("h100-sxm:1x8")

            os.setgid(case.as_user)
            os.setuid(case.as_user)
        if case.interrupt_after_s is not None:
            timer = threading.Timer(case.interrupt_after_s, os.kill, (os.getpid(), signal.SIGINT))
            timer.daemon = True
            timer.start()
        result: dict = {}
        if case.cli is not None:
            from autosearch.cli import main

            try:
                result["exit_code"] = main(list(case.cli))
            except SystemExit as exc:  # argparse
                result["exit_code"] = exc.code
        else:
            try:
                exec(case.api, _api_namespace())
                result["raised"] = None
            except Exception as exc:
                result["raised"] = type(exc).__name__
                result["message"] = str(exc)
                result["is_value_error"] = isinstance(exc, ValueError)
        sys.stdout.flush()
        sys.stderr.flush()
        with open(result_fd, "w") as f:
            json.dump(result, f)
        code = 0
    except BaseException:  # noqa: B036 - the child reports everything, then exits
        try:
            traceback.print_exc()
            sys.stderr.flush()
        finally:
            code = 98
    os._exit(code)


def run_case(case: Case, base: Path) -> dict:
    folder = base / "case"
    folder.mkdir()
    _write_files(folder, case.files)
    if case.as_user is not None and os.geteuid() == 0:
        os.chmod(base, 0o777)
        for root, _, names in os.walk(folder):
            for name in names:
                os.chmod(os.path.join(root, name), 0o666)
    out_path, err_path, result_path = base / "stdout", base / "stderr", base / "result.json"
    before = _snapshot(folder)
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        _child(case, folder, out_path, err_path, result_path)
    status = None
    while time.monotonic() - t0 < case.timeout_s:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.02)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail(f"{case.id}: still running after {case.timeout_s} s (killed)")
    elapsed = time.monotonic() - t0
    stdout = out_path.read_text(errors="replace") if out_path.exists() else ""
    stderr = err_path.read_text(errors="replace") if err_path.exists() else ""
    text = result_path.read_text() if result_path.exists() else ""
    result = json.loads(text) if text else None
    return dict(
        status=status,
        stdout=stdout,
        stderr=stderr,
        result=result,
        elapsed_s=elapsed,
        before=before,
        after=_snapshot(folder),
    )


@pytest.fixture(scope="module", autouse=True)
def _imported_once():
    """Import what the cases use once, here, so that each forked case starts warm (a case's time
    is then its own work, not Python's imports)."""
    import optuna  # noqa: F401
    import sqlalchemy.dialects.sqlite  # noqa: F401

    import autosearch.tuning  # noqa: F401
    import cost_models.analytic  # noqa: F401
    import search_spaces  # noqa: F401
    from autosearch import Cluster
    from autosearch.cli import build_parser
    from autosearch.core import model_catalog

    build_parser()
    model_catalog()
    Cluster.parse("h100-sxm:1x8")


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def _params() -> list:
    return [
        pytest.param(
            case,
            id=case.id,
            marks=[pytest.mark.xfail(reason=case.xfail, strict=False)] if case.xfail else [],
        )
        for case in CASES
    ]


@pytest.mark.parametrize("case", _params())
def test_bad_input(case: Case, tmp_path: Path) -> None:
    run = run_case(case, tmp_path)
    output = run["stdout"] + run["stderr"]
    assert "Traceback" not in output, output[-4000:]
    assert os.WIFEXITED(run["status"]) and os.WEXITSTATUS(run["status"]) == 0, (
        f"the case's child died: status {run['status']}\n{output[-4000:]}"
    )
    result = run["result"]
    if case.cli is not None:
        assert result["exit_code"] == case.exit_code, output[-4000:]
        message = run["stderr"]
    else:
        assert result["raised"] in case.raises, (
            f"expected {case.raises}, got {result['raised']}: {result.get('message')}"
        )
        if result["raised"] == "SpecError":
            assert result["is_value_error"]
        message = result["message"]
    for word in case.expect:
        assert _norm(word) in _norm(message), f"{word!r} not in the message:\n{message}"
    assert len(message) <= MAX_MESSAGE_CHARS, f"message of {len(message)} characters"
    changed = set(run["after"].items()) ^ set(run["before"].items())
    changed = {c for c in changed if not c[0].startswith(case.may_write or ("\0",))}
    assert not changed, "files changed:\n" + "\n".join(sorted(map(str, changed)))


def test_the_table_covers_enough_cases() -> None:
    """Issue 13 asks for at least 80 cases over the CLI and the Python API."""
    cli = sum(c.cli is not None for c in CASES)
    api = sum(c.api is not None for c in CASES)
    assert cli + api == len(CASES) and len({c.id for c in CASES}) == len(CASES)
    assert len(CASES) >= 80 and cli >= 40 and api >= 20
