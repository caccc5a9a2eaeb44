"""Run the microbenchmarks of a calibration: one worker process per rank, for each world size.

A world size of 1 runs `python -m autosearch.calibration._worker`; larger ones start N such
processes with torchrun's environment (or under torchrun itself, `launcher="torchrun"`). The
parent process never imports torch except to detect the device, so the benchmarks run in fresh
processes whose thread settings are their own.

On CPU a "device" is one process: with N processes per node each gets cores // N threads
(processes x threads <= cores; more oversubscribes and slows everything down), so compute rates
are measured per world size, with all N processes computing at the same time, as they do in a
data-parallel job. On a GPU, compute is measured once on one GPU and the larger world sizes only
run collectives.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import sys
from dataclasses import dataclass
from typing import Any, Callable

import pandas as pd

from autosearch.core.errors import SpecError
from cost_models.calibration.machine import (  # noqa: F401 - re-exported: the runner's names
    ISA_FLAGS,
    cpu_cores,
    cpu_isa,
    cpu_model_name,
    cpu_time_sample,
    load_average,
    load_between,
)

PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What one calibration measures. Built by `make_plan`; pure data (written to JSON for the
    workers)."""

    device: str
    quick: bool
    precisions: tuple[str, ...]
    gemm_shapes: tuple[tuple[int, int, int], ...]
    memory_array_bytes: tuple[int, ...]
    attention_configs: tuple[tuple[int, int, int, int], ...]  # (batch, heads, seq_len, head_dim)
    collective_bytes: tuple[int, ...]
    collective_ops: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")
    budget_s: float = 0.3
    min_reps: int = 3
    max_reps: int = 30
    max_call_s: float = 0.5

    def worker_plan(self, *, suites: list[str], threads: int | None) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d.update(suites=suites, threads=threads)
        return d


def make_plan(device: str, *, quick: bool) -> Plan:
    """The grids: shapes of a transformer's GEMMs (tokens x hidden-like sizes), STREAM arrays from
    in-cache to well beyond the last-level cache, attention from short to long sequences, and
    messages from 4 bytes to hundreds of MB (capped on CPU, where 256 MB all-reduces take
    ~0.3 s)."""
    if device == "cuda":
        if quick:
            return Plan(
                device="cuda",
                quick=True,
                precisions=("fp32", "tf32", "bf16", "fp16"),
                gemm_shapes=_grid((256, 4096), (1024, 8192), (1024, 8192)),
                memory_array_bytes=(1 << 20, 64 << 20, 512 << 20),
                attention_configs=((1, 16, 1024, 128), (4, 16, 4096, 128)),
                collective_bytes=tuple(4 * 16**i for i in range(8)),
                budget_s=0.05,
                min_reps=5,
                max_reps=50,
                max_call_s=0.2,
            )
        return Plan(
            device="cuda",
            quick=False,
            precisions=("fp32", "tf32", "bf16", "fp16"),
            gemm_shapes=_grid(
                (128, 512, 2048, 8192, 16384),
                (256, 1024, 4096, 8192, 16384),
                (256, 1024, 4096, 8192),
            ),
            memory_array_bytes=tuple(1 << p for p in range(20, 33, 2)),  # 1 MiB .. 4 GiB
            attention_configs=tuple(
                (b, 16, s, d) for b in (1, 8) for s in (512, 2048, 8192) for d in (64, 128)
            ),
            collective_bytes=tuple(4 * 4**i for i in range(15)),  # 4 B .. 1 GiB
            budget_s=0.1,
            min_reps=5,
            max_reps=100,
            max_call_s=0.5,
        )
    if quick:
        return Plan(
            device="cpu",
            quick=True,
            precisions=("fp32", "bf16", "fp16"),
            gemm_shapes=_grid((32, 256), (64, 256), (64, 256)),
            memory_array_bytes=(256 << 10, 4 << 20, 32 << 20),
            attention_configs=((1, 4, 64, 32), (2, 4, 128, 64)),
            collective_bytes=(4, 256, 16 << 10, 1 << 20, 4 << 20),
            budget_s=0.04,
            min_reps=3,
            max_reps=10,
            max_call_s=0.1,
        )
    return Plan(
        device="cpu",
        quick=False,
        precisions=("fp32", "bf16", "fp16"),
        gemm_shapes=_grid((16, 64, 256, 1024, 4096), (64, 256, 1024), (64, 256, 1024)),
        memory_array_bytes=tuple(1 << p for p in range(16, 29, 2)),  # 64 KiB .. 256 MiB
        attention_configs=tuple(
            (b, 8, s, d) for b in (1, 4) for s in (64, 128, 256, 512, 1024) for d in (32, 64)
        ),
        collective_bytes=tuple(4 * 4**i for i in range(14)),  # 4 B .. 256 MiB
        budget_s=0.3,
        min_reps=3,
        max_reps=30,
        max_call_s=0.5,
    )


def _grid(ms, ns, ks) -> tuple[tuple[int, int, int], ...]:
    return tuple((m, n, k) for m in ms for n in ns for k in ks)


# ---------------------------------------------------------------------------------------------
# Machine description
# ---------------------------------------------------------------------------------------------


def resolve_device(device: str) -> str:
    if device not in ("auto", "cuda", "cpu"):
        raise SpecError(f"--device must be auto, cuda or cpu, got {device!r}")
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise SpecError(
            "--device cuda: torch sees no CUDA device here (torch.cuda.is_available() is False); "
            "use --device cpu or auto"
        )
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def with_compute_world_size(
    device: str, world_sizes: list[int], log: Callable[[str], None]
) -> list[int]:
    """On a GPU, compute (GEMM, memory, attention) is measured on one GPU: world size 1 is
    always run, also when only collective sizes were asked (``--world-sizes 8``)."""
    if device != "cuda" or 1 in world_sizes:
        return world_sizes
    log("calibrate: world size 1 added: compute is measured on one GPU")
    return [1, *world_sizes]


def describe_machine(device: str) -> dict[str, Any]:
    """Device, software and load, for the profile's `calibration` record."""
    import torch

    info: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host_cpu": cpu_model_name(),
        "cpu_cores": cpu_cores(),
        "memory_total_bytes": _meminfo_bytes("MemTotal"),
        "last_level_cache_bytes": _llc_bytes(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "load_average_at_start": load_average(),
        **cpu_isa(),
    }
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(
            device_name=props.name,
            device_count=torch.cuda.device_count(),
            device_memory_bytes=float(props.total_memory),
            device_l2_cache_bytes=float(getattr(props, "L2_cache_size", 0) or 0),
            cuda=torch.version.cuda,
            nccl=_nccl_version(torch),
            backend="nccl",
        )
    else:
        info.update(
            device_name=info["host_cpu"],
            device_count=1,
            backend="gloo",
            cpu_capability=torch.backends.cpu.get_cpu_capability(),
        )
    return info


def _nccl_version(torch) -> str:
    try:
        v = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - a build without NCCL
        return "unavailable"
    return ".".join(map(str, v)) if isinstance(v, (tuple, list)) else str(v)


def _meminfo_bytes(key: str) -> float | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _llc_bytes() -> float | None:
    """Largest cache of cpu0 from sysfs (e.g. L3 8192K), or None where sysfs has none."""
    base = "/sys/devices/system/cpu/cpu0/cache"
    best = None
    try:
        for entry in os.listdir(base):
            path = os.path.join(base, entry, "size")
            if os.path.exists(path):
                text = open(path, encoding="ascii").read().strip()
                mult = {"K": 1024, "M": 1024**2, "G": 1024**3}.get(text[-1:], 1)
                size = float(text.rstrip("KMG")) * mult
                best = size if best is None else max(best, size)
    except (OSError, ValueError):
        return best
    return best


# ---------------------------------------------------------------------------------------------
# Running the workers
# ---------------------------------------------------------------------------------------------


def run_microbenchmarks(
    plan: Plan,
    world_sizes: list[int],
    *,
    timeout_s: float = 3600.0,
    launcher: str = "direct",
    log: Callable[[str], None] = print,
) -> pd.DataFrame:
    """Every measurement, one row each (the raw CSV a calibration writes)."""
    frames = []
    cores = cpu_cores()
    for ws in world_sizes:
        if plan.device == "cpu":
            threads = max(1, cores // ws)
            suites = ["process_memory", "launch", "gemm", "memory", "attention"] + (
                ["collectives"] if ws > 1 else []
            )
        else:
            threads = None
            suites = (
                ["process_memory", "launch", "gemm", "fp8_gemm", "memory", "attention"]
                if ws == 1
                else []
            ) + (["process_memory", "collectives"] if ws > 1 else [])
        log(
            f"calibrate: world size {ws}: {', '.join(suites)}"
            + (f" ({threads} thread(s) per process)" if threads else "")
        )
        load_average_1m, before = load_average(), cpu_time_sample()
        rows = _launch(
            plan.worker_plan(suites=suites, threads=threads), ws, threads, timeout_s, launcher
        )
        load = load_between(before, cpu_time_sample())
        frame = pd.DataFrame(rows)
        for key, value in load.items():
            frame[key] = value
        frame["load_average_1m"] = load_average_1m[0] if load_average_1m else None
        frames.append(frame)
        if load:
            log(
                f"calibrate: world size {ws}: other processes kept "
                f"{load['load_other_cores']:.2f} of {load['load_cores']:.0f} core(s) busy"
            )
    df = pd.concat(frames, ignore_index=True)
    df.insert(0, "device", plan.device)
    return df


def _launch(
    worker_plan: dict[str, Any],
    world: int,
    threads: int | None,
    timeout_s: float,
    launcher: str = "direct",
) -> list[dict]:
    """Run the worker on `world` ranks and return rank 0's rows.

    launcher "direct" starts the ranks itself with the environment torchrun gives its workers
    (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT): on a 2-core machine this saves the
    seconds torchrun spends importing torch in its own agent. "torchrun" goes through
    `python -m torch.distributed.run --standalone`. Either way, if one rank fails the others are
    stopped and the failing rank's stderr is in the error.
    """
    from autosearch.core.processes import ProcessGroup, clean_env, free_port

    # One owner for the workers and their temporary folder: both end with it (even if this
    # process is killed), and the workers get no RANK/WORLD_SIZE/MASTER_PORT of a job around it.
    with ProcessGroup(timeout_s=timeout_s, clean=False) as group:
        tmp = group.tmp
        plan_path, out_path = os.path.join(tmp, "plan.json"), os.path.join(tmp, "rows.json")
        with open(plan_path, "w", encoding="utf-8") as f:
            json.dump(worker_plan, f)
        module = ["-m", "autosearch.calibration._worker", plan_path, out_path]
        env = clean_env()
        env["PYTHONPATH"] = PACKAGE_ROOT + (
            os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""
        )
        if threads is not None:
            env["OMP_NUM_THREADS"] = str(threads)
        if world > 1 and launcher == "torchrun":
            cmds = [
                (
                    [
                        sys.executable,
                        "-m",
                        "torch.distributed.run",
                        "--standalone",
                        f"--nproc_per_node={world}",
                    ]
                    + module,
                    env,
                )
            ]
        elif world > 1:
            port = free_port()
            cmds = [
                (
                    [sys.executable] + module,
                    {
                        **env,
                        "RANK": str(r),
                        "LOCAL_RANK": str(r),
                        "WORLD_SIZE": str(world),
                        "LOCAL_WORLD_SIZE": str(world),
                        "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port),
                    },
                )
                for r in range(world)
            ]
        else:
            cmds = [([sys.executable] + module, env)]
        codes, errors = _run_all(group, cmds, tmp)
        if codes is None:
            raise RuntimeError(
                f"calibration worker (world size {world}) did not finish in {timeout_s:.0f} s"
            )
        if any(codes) or not os.path.exists(out_path):
            bad = next((i for i, c in enumerate(codes) if c), 0)
            raise RuntimeError(
                f"calibration worker (world size {world}, rank {bad}) failed with exit status "
                f"{codes[bad]}:\n{errors[bad][-3000:]}"
            )
        with open(out_path, encoding="utf-8") as f:
            return json.load(f)


def _run_all(
    group: Any, cmds: list[tuple[list[str], dict]], tmp: str
) -> tuple[list[int] | None, list[str]]:
    """Start every command in `group` (a ProcessGroup), wait for all; the group stops the rest
    as soon as one fails or time runs out. Returns the exit statuses (None on timeout) and each
    rank's log."""
    from autosearch.core.processes import ProcessTimeout

    logs = [os.path.join(tmp, f"rank{i}.log") for i in range(len(cmds))]
    group.start([cmd for cmd, _ in cmds], envs=[env for _, env in cmds], logs=logs)
    codes: list[int] | None
    try:
        codes = [-1 if e.returncode is None else e.returncode for e in group.wait()]
    except ProcessTimeout:
        codes = None
    texts = []
    for path in logs:
        with open(path, encoding="utf-8", errors="replace") as f:
            texts.append(f.read())
    return codes, texts
