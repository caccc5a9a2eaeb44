"""Outputs that cannot be written (issue 22, item 5): a disk that fills during `sweep`, `tune`
and `export`, and devices given as outputs, end in one message (exit 2) at once, with the work
finished before kept.

A full disk is made with a file-size limit (RLIMIT_FSIZE, with SIGXFSZ ignored: the write fails
with EFBIG, as it fails with ENOSPC on a full disk, after the bytes that fit), set in the child
before it runs the command.
"""

from __future__ import annotations

import csv
import os
import resource
import signal
import subprocess
import sys

import pytest

SWEEP = ["sweep", "--models", "llama3-8b", "--clusters", "h100-sxm:1x8", "--n-trials", "4"]
SWEEP += ["--quiet"]


def autosearch(args, *, cwd, fsize: int | None = None, timeout: float = 120):
    def limit():  # runs in the child before exec
        if fsize is not None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    return subprocess.run(
        [sys.executable, "-m", "autosearch", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=limit,
    )


def rows(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_a_disk_that_fills_during_a_sweep_keeps_the_rows_done(tmp_path):
    one = autosearch(SWEEP + ["--global-batch-sizes", "64", "--out", "one.csv"], cwd=tmp_path)
    assert one.returncode == 0, one.stderr
    size = os.path.getsize(tmp_path / "one.csv")  # the header and one row
    args = SWEEP + ["--global-batch-sizes", "64,128,256", "--out", "s.csv"]
    full = autosearch(args, cwd=tmp_path, fsize=size + 20)
    assert full.returncode == 2, full.stderr
    assert "Traceback" not in full.stderr
    assert "cannot write --out 's.csv'" in full.stderr and "rows written before" in full.stderr
    again = autosearch(args, cwd=tmp_path)  # room again: the same command continues
    assert again.returncode == 0, again.stderr
    done = rows(tmp_path / "s.csv")
    assert sorted(int(r["global_batch_size"]) for r in done) == [64, 128, 256]
    first = rows(tmp_path / "one.csv")[0]  # the row written before the disk filled is kept
    assert (done[0]["strategy"], done[0]["tokens_per_s"]) == (
        first["strategy"],
        first["tokens_per_s"],
    )


@pytest.mark.parametrize("device", ["/dev/full", "/dev/null", "/dev/zero"])
def test_a_device_as_the_sweep_output_is_refused_at_once(tmp_path, device):
    res = autosearch(SWEEP + ["--global-batch-sizes", "64", "--out", device], cwd=tmp_path)
    assert res.returncode == 2 and "character device" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


def test_a_fifo_as_the_sweep_output_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "s.csv")
    res = autosearch(SWEEP + ["--global-batch-sizes", "64", "--out", "s.csv"], cwd=tmp_path)
    assert res.returncode == 2 and "named pipe" in res.stderr, res.stderr


@pytest.mark.parametrize("fsize", [4_000, 40_000], ids=["during-the-search", "outputs"])
def test_a_disk_that_fills_during_tune_ends_in_one_message_and_keeps_the_trials(tmp_path, fsize):
    """A limit the journal reaches during the search (the trials stored before stay and the
    same command continues), or one the outputs reach (report plots)."""
    args = ["tune", "--model", "llama3-8b", "--cluster", "h100-sxm:1x8"]
    args += ["--global-batch-size", "64", "--n-trials", "30", "--quiet", "--out", "o"]
    res = autosearch(args, cwd=tmp_path, fsize=fsize)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "Traceback" not in res.stderr and "cannot write" in res.stderr, res.stderr
    assert "File too large" in res.stderr
    journal = (tmp_path / "o" / "study.journal").read_bytes()
    assert journal.endswith(b"\n")  # no torn record
    again = autosearch(args, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "o" / "study.journal").read_bytes().startswith(journal)
    assert not [n for n in os.listdir(tmp_path / "o") if n.endswith(".tmp")]


def test_a_disk_that_fills_during_export_ends_in_one_message(tmp_path):
    strategy = "dp=8,global_batch_size=64,zero_stage=3,recompute=full"  # fits everywhere
    args = ["export", "--strategy", strategy, "--to", "all"]
    args += ["--model", "llama3-8b", "--cluster", "h100-sxm:1x8", "--out", "e"]
    res = autosearch(args, cwd=tmp_path, fsize=600)
    assert res.returncode == 2 and "cannot write" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
    # the export removes what it added: the folder it made, with no partial file left
    assert not (tmp_path / "e").exists()


PLANT = """
import os, sys
from autosearch.cli import main
out = sys.argv[1]
os.makedirs(out)
names = ["trials.csv", "top_k.csv", "best_strategy.yaml", "study.yaml", "report.md",
         "megatron.sh", "ds_config.json", "deepspeed_launch.sh", "torchtitan.toml",
         "time_breakdown.png", "throughput_memory.png", "importances.png"]
for name in names:  # where earlier versions wrote their temporary files: <name>.tmp<pid>
    os.symlink(sys.argv[2], os.path.join(out, f"{name}.tmp{os.getpid()}"))
open(os.path.join(out, ".autosearch"), "w").write("written by autosearch: study\\n")
args = ["--model", "llama3-8b", "--cluster", "h100-sxm:1x8", "--global-batch-size", "64"]
sys.exit(main(["tune", *args, "--n-trials", "4", "--quiet", "--out", out]))
"""


def test_links_planted_at_temporary_names_are_never_followed(tmp_path):
    """Symbolic links at the predictable names `<file>.tmp<pid>` of the writing process: every
    output is written through an unpredictable name (mkstemp, O_EXCL), the victim is untouched."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    res = subprocess.run(
        [sys.executable, "-c", PLANT, str(tmp_path / "o"), str(victim)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert victim.read_text() == "precious"
    assert (tmp_path / "o" / "study.yaml").is_file() and (tmp_path / "o" / "megatron.sh").is_file()
