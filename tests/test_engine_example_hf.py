"""examples/finetune_hf.py, short: tune (2 candidates validated), train on a token file, save DCP
and save_pretrained; then this test loads both and checks they hold the same model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def test_finetune_hf_example_short(tmp_path):
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        str(ROOT / "examples" / "finetune_hf.py"),
        "--out",
        str(out),
        "--steps",
        "8",
        "--seq-len",
        "32",
        "--n-trials",
        "8",
        "--validate-top-k",
        "2",
        "--save-steps",
        "4",
        "--log-freq",
        "4",
    ]
    # the committed example calibration as this machine's (a quick calibration of a busy CI
    # machine may fail its checks, and then tune refuses to search: tests/test_engine_tune.py)
    from test_engine_tune import profiles_with_quality

    folder = profiles_with_quality(tmp_path / "calibration", ok=True)
    env = {**os.environ, "AUTOSEARCH_CALIBRATION_DIR": str(folder)}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "best measured" in proc.stdout and "trained to step 8" in proc.stdout
    assert sorted(os.listdir(out / "ckpt")) == ["final", "step00000004", "step00000008"]
    rows = (out / "metrics.csv").read_text().splitlines()
    assert len(rows) == 1 + 8
    # the transformers folder and the DCP checkpoint hold the same weights
    hf = transformers.AutoModelForCausalLM.from_pretrained(out / "hf")
    from autosearch import Engine

    engine = Engine(
        transformers.LlamaForCausalLM(hf.config),
        strategy="micro_batch_size=1,global_batch_size=1,amp=fp32",
    )
    engine.load(str(out / "dcp"), load_optimizer=False)
    theirs = hf.state_dict()
    ours = engine.main_program.state_dict()
    assert set(theirs) == set(ours)
    assert all(torch.equal(theirs[k], ours[k]) for k in theirs)
    # rerunning the same command resumes from the last checkpoint: nothing left to train
    again = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stdout
