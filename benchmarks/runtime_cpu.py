"""Step time and peak memory of the Engine on this machine's CPUs, under many strategies.

    python benchmarks/runtime_cpu.py                       # every run below ->
    results/runtime_cpu.csv
    python benchmarks/runtime_cpu.py --only pp2            # rerun a subset (replaces those rows)

Each strategy runs as its own job (torchrun for several processes, a plain process for one)
through `autosearch.validation`'s launcher and worker, the same code that validates tuner
candidates, so these figures and the validation's are measured alike:

* step time: the median of `--steps` optimizer steps after `--warmup` steps, each step between
  barriers (every rank times the same step); the CSV keeps the slowest rank's median;
* peak memory per rank: the tensor peak of one steady-state step (live tensor storages counted
  by `autosearch.validation.memtrack`; the CPU has no allocator counter) and the process peak
  RSS (VmHWM, which includes ~220 MB of torch itself and what the allocator keeps).

Every row records what reproduces it: the strategy (all fields), the model (all fields), the
threads per process, the torch and Python versions and the CPU. Threads: one per process under
torchrun (processes x threads <= cores), two for a single process.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from autosearch.core.model_spec import ModelSpec  # noqa: E402
from autosearch.core.strategy import Strategy  # noqa: E402
from autosearch.engine.parallel_dims import ParallelDims  # noqa: E402  (torch-free)

GBS = "global_batch_size=8"
# name: strategy. tiny-gpt: 4 layers, hidden 256, 4 heads, seq 128, vocab 1000 (3.7 M parameters).
RUNS = {
    "w1-mb8": f"micro_batch_size=8,{GBS},amp=fp32",
    "w1-mb2-accum4": f"micro_batch_size=2,{GBS},amp=fp32",
    "w1-recompute-full": f"micro_batch_size=8,{GBS},recompute=full,amp=fp32",
    "w1-recompute-selective": f"micro_batch_size=8,{GBS},recompute=selective,amp=fp32",
    "w1-bf16": f"micro_batch_size=8,{GBS},amp=bf16",
    "w2-dp2-ddp": f"dp=2,micro_batch_size=4,{GBS},amp=fp32",
    "w2-dp2-zero1": f"dp=2,micro_batch_size=4,{GBS},zero_stage=1,amp=fp32",
    "w2-dp2-zero2": f"dp=2,micro_batch_size=4,{GBS},zero_stage=2,amp=fp32",
    "w2-dp2-zero3": f"dp=2,micro_batch_size=4,{GBS},zero_stage=3,amp=fp32",
    "w2-tp2": f"tp=2,micro_batch_size=8,{GBS},amp=fp32",
    "w2-tp2-sp": f"tp=2,sequence_parallel=true,micro_batch_size=8,{GBS},amp=fp32",
    "w2-pp2-gpipe": f"pp=2,pipeline_schedule=gpipe,micro_batch_size=2,{GBS},amp=fp32",
    "w2-pp2-1f1b": f"pp=2,pipeline_schedule=1f1b,micro_batch_size=2,{GBS},amp=fp32",
    "w2-pp2-interleaved": (
        f"pp=2,pipeline_schedule=interleaved_1f1b,virtual_stages=2,micro_batch_size=2,{GBS},amp=fp32"
    ),
    "w4-dp4": f"dp=4,micro_batch_size=2,{GBS},amp=fp32",
    "w4-dp4-zero3": f"dp=4,micro_batch_size=2,{GBS},zero_stage=3,amp=fp32",
    "w4-dp2-tp2": f"dp=2,tp=2,micro_batch_size=4,{GBS},amp=fp32",
    "w4-tp4": f"tp=4,micro_batch_size=8,{GBS},amp=fp32",
    "w4-pp2-dp2": f"pp=2,dp=2,micro_batch_size=2,{GBS},amp=fp32",
    "w4-pp4-1f1b": f"pp=4,micro_batch_size=2,{GBS},amp=fp32",
}
SLOW = {"w1-bf16": (1, 2)}  # (warmup, steps): bf16 GEMMs are emulated without AVX-512 BF16


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(line for line in f if line.startswith("flags")).split()
        return " ".join(
            sorted(f for f in set(flags) if f.startswith(("avx512", "amx")) or f == "avx2")
        )
    except (OSError, StopIteration):
        return ""


def run_one(
    name: str,
    strategy: Strategy,
    spec: ModelSpec,
    *,
    warmup: int,
    steps: int,
    timeout_s: float,
    torch_version: str,
) -> dict:
    from autosearch.validation._launch import launch

    world = strategy.world_size
    threads = 2 if world == 1 else 1
    config = {
        "strategy": strategy.to_dict(),
        "model": spec.to_dict(),
        "steps": steps,
        "warmup": warmup,
        "threads": threads,
        "seed": 0,
    }
    with tempfile.TemporaryDirectory(prefix=f"runtime_cpu-{name}-") as run_dir:
        outcome = launch(config, nproc=world, run_dir=Path(run_dir), timeout_s=timeout_s)
        log_tail = Path(outcome.log_path).read_text()[-400:] if outcome.status != "ok" else ""
    ranks = sorted(outcome.ranks, key=lambda r: r.get("rank", 0))
    ok = outcome.status == "ok"
    row = {
        "run": name,
        "status": outcome.status,
        "reason": outcome.reason or log_tail.replace("\n", " ")[-200:],
        "world_size": world,
        "strategy": strategy.short(),
        "dp_mode": ParallelDims.from_strategy(strategy, world).dp_mode,
        **{f"s_{k}": v for k, v in strategy.to_dict().items()},
        "model": spec.name,
        **{f"m_{k}": v for k, v in spec.to_dict().items() if k != "name"},
        "warmup_steps": warmup,
        "measured_steps": steps,
        "threads_per_process": threads,
    }
    if ok:
        medians = [r["step_time_s"] for r in ranks]
        step = max(medians)
        row.update(
            step_time_s=step,
            step_time_min_s=min(r["step_time_min_s"] for r in ranks),
            step_time_max_s=max(r["step_time_max_s"] for r in ranks),
            tokens_per_s=strategy.global_batch_size * spec.seq_len / step,
            peak_memory_bytes=max(r["peak_memory_bytes"] for r in ranks),
            peak_memory_bytes_per_rank=";".join(f"{r['peak_memory_bytes']:.0f}" for r in ranks),
            peak_rss_bytes=max(r["peak_rss_bytes"] for r in ranks),
            peak_rss_bytes_per_rank=";".join(str(r["peak_rss_bytes"]) for r in ranks),
            baseline_rss_bytes=max(r["baseline_rss_bytes"] for r in ranks),
            peak_memory_method=ranks[0]["peak_memory_method"],
            final_loss=ranks[0]["final_loss"],
        )
    row.update(
        torch_version=torch_version,
        python=platform.python_version(),
        cpu=cpu_model(),
        cpu_flags=cpu_flags(),
        n_cpus=os.cpu_count(),
        launcher_wall_s=round(outcome.wall_s, 1),
        reproduce=f"python benchmarks/runtime_cpu.py --only {name}",
        date=datetime.datetime.now().isoformat(timespec="seconds"),
    )
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-gpt")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--only", help="comma-separated texts: run the runs whose name contains one")
    p.add_argument("--timeout-s", type=float, default=300)
    p.add_argument("--out", default=str(ROOT / "results" / "runtime_cpu.csv"))
    args = p.parse_args()

    import importlib.metadata

    torch_version = importlib.metadata.version("torch")
    spec = ModelSpec.load(args.model)
    wanted = args.only.split(",") if args.only else []
    names = [n for n in RUNS if not wanted or any(w in n for w in wanted)]
    rows = []
    print(
        f"{spec.name}, torch {torch_version}, {os.cpu_count()} CPUs ({cpu_model()}; {cpu_flags()})"
    )
    print(
        f"{'run':24s} {'status':8s} {'step (s)':>9s} {'tokens/s':>9s} {'tensor peak MiB':>16s}"
        f" {'RSS peak MiB':>13s}"
    )
    for name in names:
        strategy = Strategy.parse(RUNS[name]).validate(spec)
        warmup, steps = SLOW.get(name, (args.warmup, args.steps))
        row = run_one(
            name,
            strategy,
            spec,
            warmup=warmup,
            steps=steps,
            timeout_s=args.timeout_s,
            torch_version=torch_version,
        )
        rows.append(row)
        if row["status"] == "ok":
            print(
                f"{name:24s} {'ok':8s} {row['step_time_s']:9.3f} {row['tokens_per_s']:9.0f} "
                f"{row['peak_memory_bytes'] / 2**20:16.1f} {row['peak_rss_bytes'] / 2**20:13.0f}",
                flush=True,
            )
        else:
            print(f"{name:24s} {row['status']:8s} {row['reason'][:80]}", flush=True)
    if (
        args.only and Path(args.out).exists()
    ):  # rerun a subset: replace those rows, keep the others
        with open(args.out, newline="") as f:
            kept = {r["run"]: r for r in csv.DictReader(f)}
        kept.update({r["run"]: r for r in rows})
        rows = [kept[n] for n in RUNS if n in kept]
    fields = list(dict.fromkeys(k for row in rows for k in row))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    ok = [r for r in rows if r["status"] == "ok"]
    if ok:
        median = statistics.median(float(r["step_time_s"]) for r in ok)
        print(f"{len(ok)}/{len(rows)} runs ok in {args.out}; median step {median:.3f} s")


if __name__ == "__main__":
    main()
