"""Microbenchmarks of one process (or one rank of a torchrun job), with torch.

Imported only by the calibration worker: `import cost_models` never imports torch.

Timing: CUDA events around each call on a GPU, `time.perf_counter` on CPU. Each point is the
median of several calls after a warm-up; the number of calls fits a time budget. Under
torch.distributed every rank measures the same points at the same time (compute benchmarks run
concurrently on all ranks, as they do in a data-parallel job), and every reported time is the
maximum over ranks (the slowest rank sets a step's pace). Because every rank then holds the same
numbers, every decision taken from them (how many calls, which shapes are too slow to measure)
is the same on all ranks, and the ranks stay in lock-step without further coordination.
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autosearch.core.hardware import ATTENTION_BACKWARD_OVER_FORWARD, GEMM_BACKWARD_OVER_FORWARD
from cost_models.analytic import CAUSAL_FRACTION

DTYPES = {
    "fp32": torch.float32,
    "tf32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


@dataclass
class Timer:
    """Times calls on one device and agrees on the results with the other ranks."""

    device: torch.device
    budget_s: float = 0.25  # target measuring time per point
    min_reps: int = 3
    max_reps: int = 50

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def agree_max(self, values: list[float]) -> list[float]:
        """Element-wise maximum over ranks (identity in a single process)."""
        if not self.distributed:
            return list(values)
        t = torch.tensor(
            values,
            dtype=torch.float64,
            device=self.device if dist.get_backend() == "nccl" else "cpu",
        )
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.cpu().tolist()

    def once(self, fn: Callable[[], Any]) -> float:
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def measure(
        self, fn: Callable[[], Any], *, barrier_each: bool = False, warmup: int = 1
    ) -> dict[str, float]:
        """Median, minimum, coefficient of variation (standard deviation / mean) and number of
        timed calls of `fn`, each the maximum over ranks."""
        self.barrier()
        warm = 0.0
        for _ in range(warmup):
            self.barrier() if barrier_each else None
            warm = self.once(fn)
        (warm,) = self.agree_max([warm])
        reps = int(min(self.max_reps, max(self.min_reps, self.budget_s / max(warm, 1e-9))))
        times = []
        self.barrier()
        for _ in range(reps):
            if barrier_each:
                self.barrier()
            times.append(self.once(fn))
        cv = statistics.pstdev(times) / statistics.fmean(times) if len(times) > 1 else 0.0
        med, best, cv = self.agree_max([statistics.median(times), min(times), cv])
        return {"time_s": med, "time_min_s": best, "time_cv": cv, "reps": reps}


# ---------------------------------------------------------------------------------------------
# Per-call overhead
# ---------------------------------------------------------------------------------------------


def launch_overhead(timer: Timer, *, calls: int = 200) -> list[dict[str, Any]]:
    """Time of one tiny elementwise op, back to back (Python dispatch + kernel launch)."""
    x = torch.zeros(1, device=timer.device)

    def burst():
        for _ in range(calls):
            x.add_(1.0)

    r = timer.measure(burst, warmup=2)
    return [
        {
            "kind": "launch",
            "op": "tiny_add",
            "time_s": r["time_s"] / calls,
            "time_min_s": r["time_min_s"] / calls,
            "time_cv": r["time_cv"],  # of the bursts
            "reps": r["reps"] * calls,
        }
    ]


# ---------------------------------------------------------------------------------------------
# GEMM: F.linear as nn.Linear runs it, forward and backward (dgrad + wgrad)
# ---------------------------------------------------------------------------------------------


def _precision_context(precision: str, device: torch.device):
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
        torch.backends.cudnn.allow_tf32 = precision == "tf32"


def gemm(
    timer: Timer,
    *,
    precisions: Iterable[str],
    shapes: Iterable[tuple[int, int, int]],
    max_call_s: float,
) -> list[dict[str, Any]]:
    """y[m, n] = x[m, k] @ W[n, k]^T forward, and its backward (grad of x and W) for each shape.

    Shapes whose expected call time (from the rate measured so far) exceeds `max_call_s` are
    skipped; they are recorded with `skipped` so the measurement file says what was not measured.
    """
    rows: list[dict[str, Any]] = []
    shapes = sorted(shapes, key=lambda s: s[0] * s[1] * s[2])
    dev = timer.device
    for precision in precisions:
        _precision_context(precision, dev)
        dtype = DTYPES[precision]
        rate = None
        for m, n, k in shapes:
            flops = 2.0 * m * n * k
            if rate is not None and 3 * flops / rate > max_call_s:
                rows.append(
                    {
                        "kind": "gemm",
                        "op": "linear_fwd",
                        "precision": precision,
                        "m": m,
                        "n": n,
                        "k": k,
                        "flops": flops,
                        "skipped": "slower than max_call_s",
                    }
                )
                continue
            x = torch.randn(m, k, device=dev, dtype=dtype, requires_grad=True)
            w = torch.randn(n, k, device=dev, dtype=dtype, requires_grad=True)
            with torch.no_grad():
                fwd = timer.measure(functools.partial(F.linear, x, w))
            y = F.linear(x, w)
            g = torch.randn_like(y)
            bwd = timer.measure(
                functools.partial(torch.autograd.grad, y, (x, w), g, retain_graph=True)
            )
            for op, r in (("linear_fwd", fwd), ("linear_bwd", bwd)):
                rows.append(
                    {
                        "kind": "gemm",
                        "op": op,
                        "precision": precision,
                        "m": m,
                        "n": n,
                        "k": k,
                        "flops": flops * (GEMM_BACKWARD_OVER_FORWARD if op == "linear_bwd" else 1),
                        **r,
                    }
                )
            rate = flops / fwd["time_s"]  # the next, larger shape runs at about this rate
            del x, w, y, g
    _precision_context("fp32", dev)
    return rows


def fp8_supported(device: torch.device) -> str | None:
    """Why float8 GEMMs cannot be measured here, or None: `torch._scaled_mm` needs a CUDA GPU of
    compute capability 8.9 or later (Ada, Hopper, Blackwell)."""
    if device.type != "cuda":
        return "float8 GEMMs need a CUDA GPU (torch._scaled_mm)"
    if torch.cuda.get_device_capability(device) < (8, 9):
        return "float8 GEMMs need compute capability >= 8.9 (Ada, Hopper, Blackwell)"
    return None


def fp8_gemm(
    timer: Timer, *, shapes: Iterable[tuple[int, int, int]], max_call_s: float
) -> list[dict[str, Any]]:
    """y[m, n] = a[m, k] @ b[k, n] in float8 e4m3 with bf16 output through `torch._scaled_mm`, as
    torchao's Float8Linear runs it: one scale per tensor (`fp8`) and one per row of a and column
    of b (`fp8_rowwise`). Forward only: dgrad and wgrad are GEMMs of the same kind and size."""
    dev = timer.device
    why = fp8_supported(dev)
    shapes = sorted(shapes, key=lambda s: s[0] * s[1] * s[2])
    rows: list[dict[str, Any]] = []
    for precision in ("fp8", "fp8_rowwise"):
        rate = None
        for m, n, k in shapes:
            flops = 2.0 * m * n * k
            base: dict[str, Any] = {"kind": "gemm_fp8", "op": "scaled_mm"}
            base.update(precision=precision, m=m, n=n, k=k, flops=flops)
            if why or (rate is not None and flops / rate > max_call_s):
                rows.append({**base, "skipped": why or "slower than max_call_s"})
                continue
            a = torch.randn(m, k, device=dev).to(torch.float8_e4m3fn)
            b = torch.randn(n, k, device=dev).to(torch.float8_e4m3fn).t()  # column-major
            if precision == "fp8":
                sa = sb = torch.ones((), device=dev)
            else:
                sa, sb = torch.ones(m, 1, device=dev), torch.ones(1, n, device=dev)
            fn = functools.partial(
                torch._scaled_mm, a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16
            )
            r = timer.measure(fn)
            rows.append({**base, **r})
            rate = flops / r["time_s"]
            del a, b
    return rows


# ---------------------------------------------------------------------------------------------
# Streaming memory bandwidth (STREAM's copy / add / triad; McCalpin 1995)
# ---------------------------------------------------------------------------------------------


def memory(timer: Timer, *, array_bytes: Iterable[int]) -> list[dict[str, Any]]:
    """Bytes counted as the cost model counts them: reads + writes (no write-allocate)."""
    rows = []
    for size in sorted(array_bytes):
        n = max(1, size // 4)
        a = torch.ones(n, device=timer.device)
        b = torch.ones(n, device=timer.device)
        c = torch.empty(n, device=timer.device)
        ops = {
            "copy": (functools.partial(c.copy_, a), 2),
            "add": (functools.partial(torch.add, a, b, out=c), 3),
            "triad": (functools.partial(torch.add, a, b, alpha=3.0, out=c), 3),
        }
        for op, (fn, arrays) in ops.items():
            r = timer.measure(fn, warmup=2)
            rows.append(
                {
                    "kind": "memory",
                    "op": op,
                    "precision": "fp32",
                    "array_bytes": n * 4,
                    "bytes": float(arrays * n * 4),
                    **r,
                }
            )
        del a, b, c
    return rows


# ---------------------------------------------------------------------------------------------
# Fused attention: scaled_dot_product_attention with a causal mask, forward and backward
# ---------------------------------------------------------------------------------------------


def attention(
    timer: Timer,
    *,
    precisions: Iterable[str],
    configs: Iterable[tuple[int, int, int, int]],
    max_call_s: float,
) -> list[dict[str, Any]]:
    """configs: (batch, heads, seq_len, head_dim)."""
    rows = []
    configs = sorted(configs, key=lambda c: c[0] * c[1] * c[2] * c[2] * c[3])
    dev = timer.device
    for precision in precisions:
        _precision_context(precision, dev)
        dtype = DTYPES[precision]
        rate = None
        for b, h, s, d in configs:
            flops = 4.0 * b * h * s * s * d * CAUSAL_FRACTION
            base = {
                "kind": "attention",
                "precision": precision,
                "batch": b,
                "heads": h,
                "seq_len": s,
                "head_dim": d,
            }
            if rate is not None and 3.5 * flops / rate > max_call_s:
                rows.append(
                    {**base, "op": "sdpa_fwd", "flops": flops, "skipped": "slower than max_call_s"}
                )
                continue
            q, k, v = (
                torch.randn(b, h, s, d, device=dev, dtype=dtype, requires_grad=True)
                for _ in range(3)
            )
            with torch.no_grad():
                fwd = timer.measure(
                    functools.partial(F.scaled_dot_product_attention, q, k, v, is_causal=True)
                )
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            g = torch.randn_like(o)
            bwd = timer.measure(
                functools.partial(torch.autograd.grad, o, (q, k, v), g, retain_graph=True)
            )
            rows.append({**base, "op": "sdpa_fwd", "flops": flops, **fwd})
            rows.append(
                {**base, "op": "sdpa_bwd", "flops": flops * ATTENTION_BACKWARD_OVER_FORWARD, **bwd}
            )
            rate = flops / fwd["time_s"]
            del q, k, v, o, g
    _precision_context("fp32", dev)
    return rows


# ---------------------------------------------------------------------------------------------
# Collectives over the whole world
# ---------------------------------------------------------------------------------------------


def collectives(
    timer: Timer, *, sizes_bytes: Iterable[int], ops: Iterable[str], max_call_s: float
) -> list[dict[str, Any]]:
    """all_reduce (S = the buffer), all_gather_into_tensor (S = the output), reduce_scatter_tensor
    (S = the input), and send/recv ping-pong between ranks 0 and 1 (half the round trip)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    dev = timer.device
    rows = []
    slow: set[str] = set()
    for size in sorted(sizes_bytes):
        elems = max(world, (size // 4) // world * world)
        nbytes = elems * 4
        for op in ops:
            base = {
                "kind": "collective",
                "op": op,
                "group_size": world if op != "send_recv" else 2,
                "bytes": float(nbytes),
                "precision": "fp32",
            }
            if op in slow:
                rows.append({**base, "skipped": "slower than max_call_s"})
                continue
            fn: Callable[[], Any]
            if op == "all_reduce":
                fn = functools.partial(dist.all_reduce, torch.ones(elems, device=dev))
            elif op == "all_gather":
                inp, out = torch.ones(elems // world, device=dev), torch.empty(elems, device=dev)
                fn = functools.partial(dist.all_gather_into_tensor, out, inp)
            elif op == "reduce_scatter":
                inp, out = torch.ones(elems, device=dev), torch.empty(elems // world, device=dev)
                fn = functools.partial(dist.reduce_scatter_tensor, out, inp)
            elif op == "send_recv":
                fn = functools.partial(_ping_pong, torch.ones(elems, device=dev), rank)
            else:
                raise ValueError(f"unknown collective {op!r}")
            r = timer.measure(functools.partial(_then_sync, fn, timer), barrier_each=True)
            if op == "send_recv":  # one way = half the round trip
                r = {**r, "time_s": r["time_s"] / 2, "time_min_s": r["time_min_s"] / 2}
            rows.append({**base, **r})
            if r["time_s"] * 4 > max_call_s:  # the next size (4x larger) would exceed the limit
                slow.add(op)
    return rows


def _ping_pong(buf: torch.Tensor, rank: int) -> None:
    """Rank 0 sends `buf` to rank 1 and receives it back; the other ranks wait at the barrier."""
    if rank == 0:
        dist.send(buf, 1)
        dist.recv(buf, 1)
    elif rank == 1:
        dist.recv(buf, 0)
        dist.send(buf, 0)


def _then_sync(fn: Callable[[], Any], timer: Timer) -> None:
    fn()
    timer.sync()


def process_memory_bytes(device: torch.device) -> float:
    """Memory a process holds before the model: resident set on CPU (torch and the process group,
    /proc/self/status VmRSS), the CUDA context (memory in use on the device with nothing
    allocated) on a GPU."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return float(total - free - torch.cuda.memory_allocated(device))
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float("nan")


def cpu_threads() -> int:
    return (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    )
