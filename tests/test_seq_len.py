"""`--seq-len` on estimate, tune and sweep, and `seq_len` in a --config file (issue 18 item 5): a
Hugging Face config without it trains at its maximum positions, said in one note line above 32k
tokens (not a Python warning with a file and line)."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

from autosearch import TuneConfig, tune

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HF = {  # a small Llama-family config with Qwen2-7B's 131,072 maximum positions
    "model_type": "llama",
    "num_hidden_layers": 2,
    "hidden_size": 256,
    "num_attention_heads": 4,
    "intermediate_size": 512,
    "vocab_size": 1000,
    "max_position_embeddings": 131072,
}


def _cli(*args, cwd):
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run(
        [sys.executable, "-m", "autosearch", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def _estimate(tmp_path, *extra):
    (tmp_path / "small.json").write_text(json.dumps(HF))
    return _cli(
        "estimate",
        "--model",
        "small.json",
        "--cluster",
        "h100-sxm:1x8",
        "--strategy",
        "dp=8",
        "--global-batch-size",
        "8",
        *extra,
        cwd=tmp_path,
    )


def test_a_hugging_face_config_trains_at_its_positions_with_one_note_line(tmp_path):
    run = _estimate(tmp_path)
    assert run.returncode == 0, run.stderr
    assert "seq 131072" in run.stdout
    notes = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(notes) == 1 and notes[0].startswith("note: ")
    assert "131,072 tokens" in notes[0] and "--seq-len" in notes[0]
    assert "Warning" not in run.stderr and ".py:" not in run.stderr


def test_seq_len_replaces_it_and_silences_the_note(tmp_path):
    run = _estimate(tmp_path, "--seq-len", "4096")
    assert run.returncode == 0, run.stderr
    assert "seq 4096" in run.stdout and run.stderr.strip() == ""
    catalog = _cli(
        "estimate",
        "--model",
        "llama3-8b",
        "--cluster",
        "h100-sxm:1x8",
        "--strategy",
        "dp=8,zero_stage=3",  # fits (estimate exits 1 for a strategy that does not)
        "--global-batch-size",
        "8",
        "--seq-len",
        "2048",
        cwd=tmp_path,
    )
    assert catalog.returncode == 0 and "seq 2048" in catalog.stdout


def test_tune_takes_seq_len_as_a_setting_and_records_it(tmp_path):
    config = TuneConfig(
        model="llama3-8b", cluster="h100-sxm:1x8", global_batch_size=64, seq_len=2048, seed=0
    )
    result = tune(config.replace(out=str(tmp_path / "out")))
    assert result.space.model.seq_len == 2048
    assert result.config.seq_len == 2048
    again = TuneConfig.from_dict(result.config.to_dict())
    assert again.seq_len == 2048
    (tmp_path / "c.yaml").write_text(
        "model: small.json\ncluster: h100-sxm:1x8\nglobal_batch_size: 8\nseq_len: 1024\n"
        "n_trials: 3\n"
    )
    (tmp_path / "small.json").write_text(json.dumps(HF))
    run = _cli("tune", "--config", "c.yaml", "--quiet", "--out", "o", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "note:" not in run.stderr
    study = (tmp_path / "o" / "study.yaml").read_text()
    assert "seq_len: 1024" in study


def test_sweep_takes_seq_len_and_writes_it(tmp_path):
    run = _cli(
        "sweep",
        "--models",
        "llama3-8b",
        "--clusters",
        "h100-sxm:1x8",
        "--global-batch-sizes",
        "64",
        "--seq-len",
        "2048",
        "--n-trials",
        "5",
        "--out",
        "s.csv",
        "--quiet",
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr
    with open(tmp_path / "s.csv", newline="") as f:
        (row,) = list(csv.DictReader(f))
    assert row["seq_len"] == "2048" and int(row["tokens_per_step"]) == 64 * 2048
