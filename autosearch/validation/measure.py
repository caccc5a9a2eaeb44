"""Measure a training run as it happens: step times and peak memory per rank.

On CUDA the peak is `torch.cuda.max_memory_allocated` (what the cost model predicts: tensors, not
the caching allocator's reserve). On CPU, where there is no allocator counter, the tensor peak of
one steady-state step comes from `memtrack.TensorMemoryTracker` (a dispatch-mode count of live
storages), and the process peak RSS (VmHWM) is recorded beside it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def read_status_bytes(field: str) -> int:
    """A memory field of /proc/self/status (VmRSS, VmHWM) in bytes; 0 where /proc is absent."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def reset_peak_rss() -> None:
    """Reset VmHWM to the current RSS (Linux: write 5 to /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def time_steps(step: Callable[[], Any], n: int, device: torch.device) -> list[float]:
    """Wall time of `n` calls, each between barriers so that every rank times the same step."""
    times = []
    for _ in range(n):
        synchronize(device)
        start = time.perf_counter()
        step()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def tensor_peak_bytes(
    step: Callable[[], Any], device: torch.device, modules: list, optimizers: list
) -> tuple[float, str]:
    """Peak bytes of live tensors during one call of `step`, and how it was measured."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return float(torch.cuda.max_memory_allocated(device)), "cuda.max_memory_allocated"
    from autosearch.validation.memtrack import TensorMemoryTracker

    try:
        with TensorMemoryTracker(modules, optimizers) as tracker:
            step()
        return float(tracker.peak_bytes), "TensorMemoryTracker"
    except Exception as exc:  # noqa: BLE001 - a wrapper the tracker does not understand; say so
        return float("nan"), f"unavailable ({type(exc).__name__}: {exc})"


def summarize(times: list[float], warmup: int) -> dict[str, float]:
    steady = times[warmup:] or times
    return {
        "step_time_s": statistics.median(steady),
        "step_time_min_s": min(steady),
        "step_time_max_s": max(steady),
        "steps_measured": len(steady),
    }
