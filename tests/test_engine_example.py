"""examples/train_gpt.py under torchrun on CPU: trains, logs on rank 0 only, and stops every rank
with one message on a strategy that does not fit the launch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


def torchrun(*args: str, timeout_s: float = 240) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(ROOT / "examples" / "train_gpt.py"),
        "--layers",
        "2",
        "--hidden",
        "64",
        *args,
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=ROOT
    )


def test_example_trains_under_torchrun():
    run = torchrun(
        "--strategy", str(ROOT / "examples" / "strategy.yaml"), "--steps", "4", "--log-freq", "2"
    )
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert sum("step 2/4" in line for line in lines) == 1  # rank 0 only
    assert sum("step 4/4" in line for line in lines) == 1
    assert any(line.startswith("epoch 1/1 done: loss") and "val_loss" in line for line in lines)
    assert "Traceback" not in run.stderr


def test_example_stops_every_rank_with_one_message():
    run = torchrun("--strategy", "dp=4,micro_batch_size=2,global_batch_size=8", "--steps", "2")
    assert run.returncode != 0
    message = "needs dp*tp*pp = 4*1*1 = 4 processes but this run has 2"
    assert (run.stdout + run.stderr).count(message) == 1
    assert 'File "' + str(ROOT / "autosearch") not in run.stderr  # no traceback from the workers
