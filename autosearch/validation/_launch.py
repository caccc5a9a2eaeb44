"""Run one candidate strategy as a real training job under torchrun, with a timeout, and say how
it ended. Torch-free: the job runs in child processes started by module name
(`python -m autosearch.validation.worker`), so this package never imports the Engine.

How a run ended is decided from facts, not from its log text: the exit status of the launcher,
the signal that killed a worker, the timeout, and the exception type each rank records in its
result file before exiting.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autosearch.core.processes import ProcessGroup, ProcessTimeout, signal_name

OK, OOM, CRASHED, TIMEOUT = "ok", "oom", "crashed", "timeout"
STOPPED = "stopped"  # a rank record: ended by the launcher after another rank failed


@dataclass
class RunOutcome:
    """How one real run ended, and what each rank measured."""

    status: str  # ok | oom | crashed | timeout | pending (SLURM: never started)
    reason: str = ""
    exit_code: int | None = None
    wall_s: float = 0.0
    ranks: list[dict[str, Any]] = field(default_factory=list)
    log_path: str = ""
    slurm: dict[str, Any] = field(default_factory=dict)  # job id, state, pending and running s


def launch(config: dict[str, Any], *, nproc: int, run_dir: Path, timeout_s: float) -> RunOutcome:
    """Start `nproc` workers on this machine (torchrun for nproc > 1), wait at most `timeout_s`.

    The launch is owned by `autosearch.core.processes.ProcessGroup`: torchrun and every worker
    end with it (timeout, Ctrl-C, SIGTERM, or this process killed), and they get a clean
    environment, so a validation started inside a torchrun job does not join that job; torchrun
    ``--standalone`` rendezvouses on a free port of its own.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    for old in run_dir.glob("rank*.json*"):
        old.unlink()
    config_path = run_dir / "config.json"
    config_path.write_text(json.dumps({**config, "result_dir": str(run_dir)}, indent=2))
    worker = ["-m", "autosearch.validation.worker", str(config_path)]
    if nproc > 1:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            "--module",
            *worker[1:],
        ]
    else:
        cmd = [sys.executable, *worker]
    env = {"PYTHONUNBUFFERED": "1", **os.environ}
    if config.get("threads"):  # the worker sets torch's too; this covers OpenMP and torchrun's
        env["OMP_NUM_THREADS"] = str(config["threads"])
    log_path = run_dir / "log.txt"
    log_path.write_text("")
    start = time.perf_counter()
    timed_out, code = False, None
    with ProcessGroup([cmd], envs=env, logs=[log_path], timeout_s=timeout_s, grace_s=10) as group:
        try:
            (ended,) = group.wait()
            code = ended.returncode
        except ProcessTimeout:
            timed_out = True
    wall = time.perf_counter() - start
    ranks = [_read_record(p) for p in sorted(run_dir.glob("rank*.json"))]
    outcome = classify(code, ranks, nproc=nproc, timed_out=timed_out, timeout_s=timeout_s)
    outcome.wall_s, outcome.log_path = wall, str(log_path)
    return outcome


def _read_record(path: Path) -> dict[str, Any]:
    try:
        record = json.loads(path.read_text())
        if isinstance(record, dict):
            return record
    except (OSError, ValueError):
        pass
    rank = path.stem.removeprefix("rank")
    return {
        "rank": rank,
        "status": CRASHED,
        "error_type": "record",
        "message": f"{path} unreadable",
    }


def classify(
    exit_code: int | None,
    ranks: list[dict[str, Any]],
    *,
    nproc: int,
    timed_out: bool,
    timeout_s: float,
) -> RunOutcome:
    """Decide how a run ended from its exit status, the timeout and the per-rank result records."""
    failed = [r for r in ranks if r.get("status") not in (OK, STOPPED)]
    # A rank that ran out of memory can leave its peers waiting in a collective (NCCL) until
    # the timeout: the OOM is the cause, the timeout its consequence.
    if timed_out and not any(r.get("status") == OOM for r in failed):
        done = sum(1 for r in ranks if r.get("status") == OK)
        return RunOutcome(
            TIMEOUT,
            f"no result after {timeout_s:.0f} s ({done}/{nproc} ranks finished); "
            "killed. Raise --timeout-s if the strategy is just slow",
            exit_code,
            ranks=ranks,
        )
    if any(r.get("status") == OOM for r in failed):
        r = next(r for r in failed if r.get("status") == OOM)
        return RunOutcome(
            OOM,
            f"rank {r.get('rank')}: out of memory ({r.get('error_type')}): {r.get('message', '')}",
            exit_code,
            ranks=ranks,
        )
    if failed:
        r = failed[0]
        return RunOutcome(
            CRASHED,
            f"rank {r.get('rank')}: {r.get('error_type')}: {r.get('message', '')}",
            exit_code,
            ranks=ranks,
        )
    if exit_code == 0 and sum(r.get("status") == OK for r in ranks) == nproc:
        return RunOutcome(OK, "", exit_code, ranks=ranks)
    # No rank says why (each rank's guard records signals): the launcher itself was killed.
    if exit_code is not None and exit_code < 0:
        sig = signal_name(-exit_code)
        if exit_code == -signal.SIGKILL:
            return RunOutcome(
                OOM,
                "the launcher was killed by SIGKILL, as the kernel's out-of-memory killer does",
                exit_code,
                ranks=ranks,
            )
        return RunOutcome(CRASHED, f"the launcher was killed by {sig}", exit_code, ranks=ranks)
    return RunOutcome(
        CRASHED,
        f"exit status {exit_code} with {len(ranks)}/{nproc} rank results; see the log",
        exit_code,
        ranks=ranks,
    )
