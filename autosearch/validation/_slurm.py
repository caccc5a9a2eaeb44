"""Run one candidate as a SLURM job at its real scale: `sbatch` a generated script whose `srun`
starts one torchrun per node (c10d rendezvous on the job's first node), wait for it, and say how
it ended, with the same records and classification as the local launcher (`_launch.py`).

Torch-free, and the commands are SLURM's own (`sbatch --parsable`, `squeue`, `scontrol`,
`scancel`). Every value in the script is quoted for the shell (`shlex.quote`); the run folder
must be on a file system every node sees (the ranks write their records there).

A job still pending after `pending_timeout_s` (the cluster is busy, or the request can never be
met) is cancelled and recorded as "pending"; one running longer than `timeout_s` is cancelled and
recorded as a timeout (SLURM's own `--time` limit is a little longer, as a backstop). Ctrl-C or
SIGTERM cancels the job in flight and waits until `squeue` no longer lists it.
"""

from __future__ import annotations

import json
import math
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autosearch.core.errors import SpecError
from autosearch.core.processes import clean_env
from autosearch.validation._launch import TIMEOUT, RunOutcome, _read_record, classify

PENDING = "pending"
# SLURM job states (squeue %T / scontrol JobState) that mean the job is over.
ENDED = {
    "BOOT_FAIL",
    "CANCELLED",
    "COMPLETED",
    "DEADLINE",
    "FAILED",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "TIMEOUT",
}
# Seconds SLURM's --time limit adds to the run's own timeout: imports, rendezvous, teardown.
STARTUP_MARGIN_S = 120.0


@dataclass(frozen=True, kw_only=True)
class SlurmOptions:
    """How candidates are submitted to SLURM.

    Args:
        partition, account, qos: passed to sbatch when given.
        pending_timeout_s: a job still waiting to start after this long is cancelled and
            recorded as "pending".
        poll_s: seconds between two `squeue` calls.
        gpus: request GPUs (``--gpus-per-node``); None: when the cluster's profile is a GPU's.
        cpus_per_task: CPUs for each node's torchrun and its workers (``--cpus-per-task``).
        sbatch_args: more sbatch options, each one argument (``--constraint=h100``).
        python: the interpreter on the nodes (default: this one, on a shared file system).
        port: the rendezvous port on the first node (default: 20000 + the job id modulo 20000,
            so that two jobs sharing a first node do not collide).
    """

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    pending_timeout_s: float = 1800.0
    poll_s: float = 5.0
    gpus: bool | None = None
    cpus_per_task: int | None = None
    sbatch_args: tuple[str, ...] = ()
    python: str = sys.executable
    port: int | None = None


def layout(world: int, gpus_per_node: int) -> tuple[int, int]:
    """(nodes, processes per node) of a run of `world` processes on nodes of `gpus_per_node`:
    whole nodes, as the cost model priced it (a run smaller than a node takes part of one)."""
    if world <= gpus_per_node:
        return 1, world
    if world % gpus_per_node:
        raise SpecError(
            f"a run of {world} processes does not fill whole nodes of {gpus_per_node}; choose "
            f"a strategy whose dp*tp*pp is a multiple of {gpus_per_node}"
        )
    return world // gpus_per_node, gpus_per_node


def check_slurm() -> None:
    """SpecError naming the command when SLURM's client commands are not on PATH."""
    missing = [c for c in ("sbatch", "squeue", "scancel", "scontrol") if shutil.which(c) is None]
    if missing:
        raise SpecError(
            f"--launcher slurm: {', '.join(missing)} not found on PATH; run validate on a "
            "machine with SLURM's client commands (a login node), or use --launcher local"
        )


def sbatch_command(
    *, script: Path, run_dir: Path, nodes: int, per_node: int, gpus: bool, timeout_s: float,
    name: str, options: SlurmOptions,
) -> list[str]:  # fmt: skip
    """The sbatch command line of one run: the job's shape as arguments (no #SBATCH lines to
    parse), `options.sbatch_args` last so they override."""
    minutes = max(1, math.ceil((timeout_s + STARTUP_MARGIN_S) / 60))
    cmd = [
        "sbatch",
        "--parsable",
        f"--job-name={name}",
        f"--nodes={nodes}",
        "--ntasks-per-node=1",
        f"--time={minutes}",
        f"--output={str(run_dir / 'log.txt').replace('%', '%%')}",  # % starts a file pattern
    ]
    if gpus:
        cmd.append(f"--gpus-per-node={per_node}")
    if options.cpus_per_task:
        cmd.append(f"--cpus-per-task={int(options.cpus_per_task)}")
    cmd += [f"--{k}={v}" for k in ("partition", "account", "qos") if (v := getattr(options, k))]
    return [*cmd, *options.sbatch_args, str(script)]


def batch_script(*, config_path: Path, nodes: int, per_node: int, options: SlurmOptions) -> str:
    """The job script: one torchrun per node through srun (every value shell-quoted). The job
    inherits the submitting shell's environment (sbatch's default ``--export=ALL``): the
    virtual environment, PYTHONPATH, CUDA settings."""
    q = shlex.quote
    worker = ["-m", "autosearch.validation.worker", str(config_path)]
    if nodes * per_node == 1:
        launch = " ".join(q(a) for a in [options.python, *worker])
    else:
        port = int(options.port) if options.port else "$((20000 + SLURM_JOB_ID % 20000))"
        launch = " ".join(
            q(a)
            for a in [
                options.python,
                "-m",
                "torch.distributed.run",
                f"--nnodes={nodes}",
                f"--nproc_per_node={per_node}",
                "--rdzv_backend=c10d",
            ]
        )
        launch += f' --rdzv_id="$SLURM_JOB_ID" --rdzv_endpoint="$head:{port}" --module '
        launch += " ".join(q(a) for a in worker[1:])
    return "\n".join(
        [
            "#!/bin/bash",
            "# Written by `autosearch validate --launcher slurm`; submitted with sbatch.cmd.",
            "set -eu",
            "export PYTHONUNBUFFERED=1",
            'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
            f"srun --kill-on-bad-exit=1 {launch}",
            "",
        ]
    )


def launch_slurm(
    config: dict[str, Any],
    *,
    nproc: int,
    gpus_per_node: int,
    gpus: bool,
    run_dir: Path,
    timeout_s: float,
    options: SlurmOptions,
    name: str = "autosearch-validate",
) -> RunOutcome:
    """Submit one run, wait for it, classify it (a RunOutcome, as `_launch.launch` returns)."""
    nodes, per_node = layout(nproc, gpus_per_node)
    run_dir = run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    for old in run_dir.glob("rank*.json*"):
        old.unlink()
    config_path = run_dir / "config.json"
    config_path.write_text(json.dumps({**config, "result_dir": str(run_dir)}, indent=2))
    script = run_dir / "job.sbatch"
    script.write_text(
        batch_script(config_path=config_path, nodes=nodes, per_node=per_node, options=options)
    )
    (run_dir / "log.txt").write_text("")
    cmd = sbatch_command(
        script=script,
        run_dir=run_dir,
        nodes=nodes,
        per_node=per_node,
        gpus=gpus,
        timeout_s=timeout_s,
        name=name,
        options=options,
    )
    (run_dir / "sbatch.cmd").write_text(shlex.join(cmd) + "\n")
    job = _run(cmd).split(";")[0].strip()  # "ID" or "ID;cluster"
    (run_dir / "slurm_job_id").write_text(job + "\n")
    start = time.perf_counter()
    with _cancel_on_exit(job):
        state, exit_code, waited_s, ran_s, reason = _wait(job, timeout_s, options)
    ranks = [_read_record(p) for p in sorted(run_dir.glob("rank*.json"))]
    if state == PENDING:
        outcome = RunOutcome(
            PENDING,
            f"SLURM job {job} still pending after {waited_s:.0f} s ({reason or 'no reason'}); "
            "cancelled. Raise --slurm-pending-timeout-s, or ask for fewer nodes or another "
            "partition",
            None,
        )
    else:
        timed_out = state in (TIMEOUT.upper(), "OURS_TIMEOUT")
        if exit_code is None and state == "UNKNOWN" and len(ranks) == nproc:
            exit_code = 0 if all(r.get("status") == "ok" for r in ranks) else 1
        outcome = classify(exit_code, ranks, nproc=nproc, timed_out=timed_out, timeout_s=timeout_s)
        if state == "OUT_OF_MEMORY" and outcome.status != "ok":
            outcome = RunOutcome(
                "oom", f"SLURM job {job}: OUT_OF_MEMORY (host memory)", exit_code, ranks=ranks
            )
        elif outcome.status == "crashed" and not any(r.get("status") for r in ranks):
            outcome.reason = f"SLURM job {job} ended {state} (exit {exit_code}); {outcome.reason}"
    outcome.wall_s = time.perf_counter() - start
    outcome.log_path = str(run_dir / "log.txt")
    outcome.slurm = {"job_id": job, "state": state, "pending_s": waited_s, "running_s": ran_s}
    return outcome


def _wait(
    job: str, timeout_s: float, options: SlurmOptions
) -> tuple[str, int | None, float, float, str]:
    """Poll until the job ends; cancel it when pending or running too long.

    Returns (state, exit code, seconds pending, seconds running, pending reason)."""
    submitted = time.monotonic()
    started: float | None = None
    reason = ""
    while True:
        state, reason_now, code = _state(job)
        now = time.monotonic()
        if state in ENDED or state == "UNKNOWN":
            pending = (started or now) - submitted
            return state, code, pending, now - (started or now), reason
        if state in ("RUNNING", "COMPLETING") and started is None:
            started = now
        if started is None:
            reason = reason_now or reason
            if now - submitted > options.pending_timeout_s:
                _cancel(job)
                return PENDING, None, now - submitted, 0.0, reason
        elif now - started > timeout_s:
            _cancel(job)
            return "OURS_TIMEOUT", None, started - submitted, now - started, reason
        time.sleep(options.poll_s)


def _state(job: str) -> tuple[str, str, int | None]:
    """(state, pending reason, exit code) of a job: squeue while it is queued or running, then
    scontrol (a finished job stays there for MinJobAge, 300 s by default); UNKNOWN when neither
    lists it any more (the rank records then tell how it ended)."""
    out = _run(["squeue", "-h", "-j", job, "-t", "all", "-o", "%T|%r"], check=False).strip()
    state, _, reason = out.splitlines()[0].partition("|") if out else ("", "", "")
    if state and state not in ENDED:
        return state, "" if reason in ("None", "(null)") else reason, None
    info = _run(["scontrol", "show", "job", "-o", job], check=False)
    fields = dict(kv.split("=", 1) for kv in info.split() if "=" in kv)
    state = fields.get("JobState") or state or "UNKNOWN"
    code, _, sig = fields.get("ExitCode", "").partition(":")
    exit_code = None
    if sig.isdigit() and int(sig):
        exit_code = -int(sig)  # killed by a signal, as Popen reports it
    elif code.isdigit():
        exit_code = int(code)
    return state, "", exit_code


def _cancel(job: str, *, wait_s: float = 60.0) -> None:
    """scancel, then wait until squeue no longer lists the job as pending or running."""
    _run(["scancel", job], check=False)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        out = _run(["squeue", "-h", "-j", job, "-o", "%T"], check=False).strip()
        if not out or out.splitlines()[0] in ENDED:
            return
        time.sleep(0.5)


@contextmanager
def _cancel_on_exit(job: str) -> Iterator[None]:
    """Ctrl-C, SIGTERM or an error while waiting cancels the job before going on."""
    previous = None
    if hasattr(signal, "SIGTERM") and _in_main_thread():
        previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        yield
    except BaseException:
        _cancel(job)
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _run(cmd: list[str], *, check: bool = True) -> str:
    """A SLURM command's stdout; SpecError naming the command when it fails (check=True)."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=clean_env())
    except (OSError, subprocess.TimeoutExpired) as exc:
        if not check:
            return ""
        raise SpecError(f"`{shlex.join(cmd)}` failed: {exc}") from None
    if check and done.returncode != 0:
        raise SpecError(
            f"`{shlex.join(cmd)}` failed with exit status {done.returncode}: "
            f"{(done.stderr or done.stdout).strip()[:600]}"
        )
    return done.stdout
