"""Run one candidate strategy as a real training job under torchrun, with a timeout, and say how
it ended. Torch-free: the job runs in a child process (`autosearch.validation.worker`).

How a run ended is decided from facts, not from its log text: the exit status of the launcher,
the signal that killed a worker, the timeout, and the exception type each rank records in its
result file before exiting.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OK, OOM, CRASHED, TIMEOUT = "ok", "oom", "crashed", "timeout"


@dataclass
class RunOutcome:
    """How one real run ended, and what each rank measured."""

    status: str  # ok | oom | crashed | timeout
    reason: str = ""
    exit_code: int | None = None
    wall_s: float = 0.0
    ranks: list[dict[str, Any]] = field(default_factory=list)
    log_path: str = ""


def launch(config: dict[str, Any], *, nproc: int, run_dir: Path, timeout_s: float) -> RunOutcome:
    """Start `nproc` workers on this machine (torchrun for nproc > 1), wait at most `timeout_s`."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for old in run_dir.glob("rank*.json"):
        old.unlink()
    config_path = run_dir / "config.json"
    config_path.write_text(json.dumps({**config, "result_dir": str(run_dir)}, indent=2))
    worker = [sys.executable, "-m", "autosearch.validation.worker", str(config_path)]
    if nproc > 1:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            "--module",
            "autosearch.validation.worker",
            str(config_path),
        ]
    else:
        cmd = worker
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    log_path = run_dir / "log.txt"
    start = time.perf_counter()
    with open(log_path, "w") as log:
        # A session of its own, so that a timeout kills torchrun and every worker it started.
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            code = proc.wait(timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            code, timed_out = proc.returncode, True
    wall = time.perf_counter() - start
    ranks = [json.loads(p.read_text()) for p in sorted(run_dir.glob("rank*.json"))]
    outcome = classify(code, ranks, nproc=nproc, timed_out=timed_out, timeout_s=timeout_s)
    outcome.wall_s, outcome.log_path = wall, str(log_path)
    return outcome


def _kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue


def classify(
    exit_code: int | None,
    ranks: list[dict[str, Any]],
    *,
    nproc: int,
    timed_out: bool,
    timeout_s: float,
) -> RunOutcome:
    """Decide how a run ended from its exit status, the timeout and the per-rank result records."""
    failed = [r for r in ranks if r.get("status") != OK]
    if timed_out:
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
    if exit_code == 0 and len(ranks) == nproc:
        return RunOutcome(OK, "", exit_code, ranks=ranks)
    # A rank died without writing its record: killed by a signal, or a native crash.
    if exit_code is not None and exit_code < 0:
        sig = signal.Signals(-exit_code).name
        hint = (
            " (the kernel's out-of-memory killer sends SIGKILL)"
            if exit_code == -signal.SIGKILL
            else ""
        )
        return RunOutcome(CRASHED, f"worker killed by {sig}{hint}", exit_code, ranks=ranks)
    return RunOutcome(
        CRASHED,
        f"exit status {exit_code} with {len(ranks)}/{nproc} rank results; see the log",
        exit_code,
        ranks=ranks,
    )
