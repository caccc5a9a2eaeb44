"""`validate --launcher slurm` against a real SLURM (tests/slurm_cluster.py: one node, started
here and torn down after): the candidates run as jobs through srun + torchrun on CPU, their
measurements land in the same validation.csv as the local launcher's, a hang is cancelled at the
timeout, a job that never starts is recorded as pending, a refused job and an absent SLURM end in
one message naming the command, and Ctrl-C leaves no job queued."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import slurm_cluster

from autosearch import ModelSpec, Strategy
from autosearch.core.errors import SpecError
from autosearch.validation import validate
from autosearch.validation._slurm import SlurmOptions

FACTORIES = Path(__file__).resolve().parent / "validation_factories.py"
SPEC = ModelSpec.load("tiny-gpt").scaled(n_layers=2, seq_len=64)
S1 = Strategy(micro_batch_size=2, global_batch_size=4, amp="fp32")
S2 = Strategy(dp=2, micro_batch_size=2, global_batch_size=4, amp="fp32")
# A CPU profile: the jobs ask for no GPUs, and dp=2 runs as one node of two processes.
CLUSTER = str(
    Path(__file__).resolve().parent.parent / "results/calibration/example-amd-epyc-2c.yaml:1x2"
)
FAST = SlurmOptions(poll_s=0.5)


@pytest.fixture(scope="module")
def slurm():
    why = slurm_cluster.missing()
    if why:
        pytest.skip(why)
    with slurm_cluster.slurm_cluster() as env:
        saved = os.environ.get("SLURM_CONF")
        os.environ.update(env)
        try:
            yield env
        finally:
            if saved is None:
                os.environ.pop("SLURM_CONF", None)
            else:
                os.environ["SLURM_CONF"] = saved


@pytest.mark.slow
def test_candidates_run_as_slurm_jobs_into_the_same_table(slurm, tmp_path):
    result = validate(
        SPEC, [S1, S2], cluster=CLUSTER, steps=2, warmup=1, out=tmp_path, verbose=False,
        launcher="slurm", slurm=FAST, timeout_s=240,
    )  # fmt: skip
    table = pd.read_csv(tmp_path / "validation.csv")
    assert list(table.status) == ["ok", "ok"], list(table.reason)
    assert (table.measured_step_time_s > 0).all() and (table.predicted_step_time_s > 0).all()
    assert (table.measured_peak_memory_bytes > 0).all() and table.memory_error_pct.notna().all()
    assert list(table.slurm_state) == ["COMPLETED", "COMPLETED"]
    assert result.best is not None and slurm_cluster.queued(slurm) == []
    # dp=2 went through srun + torchrun: two rank records, one job
    run = tmp_path / f"run001_{S2.short()}"
    assert sorted(p.name for p in run.glob("rank*.json")) == ["rank0.json", "rank1.json"]
    script = (run / "job.sbatch").read_text()
    assert "torch.distributed.run --nnodes=1 --nproc_per_node=2" in script


@pytest.mark.slow
def test_a_hang_is_cancelled_and_a_job_that_never_starts_is_pending(slurm, tmp_path):
    hang = validate(
        SPEC, [S1], cluster=CLUSTER, steps=1, warmup=0, out=tmp_path / "hang", verbose=False,
        launcher="slurm", slurm=FAST, timeout_s=8, factory=f"{FACTORIES}:hang",
    )  # fmt: skip
    row = hang.table.iloc[0]
    assert row.status == "timeout" and "no result after 8 s" in row.reason
    later = SlurmOptions(poll_s=0.5, pending_timeout_s=3, sbatch_args=("--begin=now+1hour",))
    pending = validate(
        SPEC, [S1], cluster=CLUSTER, steps=1, warmup=0, out=tmp_path / "pending", verbose=False,
        launcher="slurm", slurm=later,
    )  # fmt: skip
    row = pending.table.iloc[0]
    assert row.status == "pending" and "still pending after" in row.reason, row.reason
    assert "BeginTime" in row.reason  # squeue's reason is kept
    assert slurm_cluster.queued(slurm) == []


@pytest.mark.slow
def test_a_refused_job_names_the_command(slurm, tmp_path):
    nowhere = SlurmOptions(partition="no-such-partition")
    with pytest.raises(SpecError, match=r"`sbatch --parsable .*--partition=no-such-partition"):
        validate(
            SPEC, [S1], cluster=CLUSTER, steps=1, out=tmp_path, verbose=False,
            launcher="slurm", slurm=nowhere,
        )  # fmt: skip
    assert slurm_cluster.queued(slurm) == []


@pytest.mark.slow
def test_ctrl_c_cancels_the_job_in_flight(slurm, tmp_path):
    cmd = [sys.executable, "-m", "autosearch", "validate", "--strategies"]
    strategy = tmp_path / "s.yaml"
    S1.to_yaml(strategy)
    cmd += [str(strategy), "--model", "tiny-gpt", "--cluster", CLUSTER, "--launcher", "slurm"]
    cmd += ["--factory", f"{FACTORIES}:hang", "--out", str(tmp_path / "out")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not any("RUNNING" in j for j in slurm_cluster.queued(slurm)):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
        time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out
    assert slurm_cluster.queued(slurm) == []


def test_no_slurm_is_one_message(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch here
    with pytest.raises(SpecError, match="sbatch, squeue, scancel, scontrol not found on PATH"):
        validate(SPEC, [S1], cluster=CLUSTER, out=tmp_path, verbose=False, launcher="slurm")
    with pytest.raises(SpecError, match="--launcher slurm needs --cluster"):
        validate(SPEC, [S1], out=tmp_path, verbose=False, launcher="slurm")
