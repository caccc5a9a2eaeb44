"""Step time of the Engine with per-block ``torch.compile`` (Inductor) against eager, on this
machine's CPU.

    python benchmarks/engine_compile.py [--steps 20] [--threads 2]  # -> results/engine_compile.csv

One process, the catalog's tiny models as they are (tiny-gpt: GELU, LayerNorm, learned
positions; tiny-llama: SwiGLU, RMSNorm, rotary, GQA), micro-batch 8 x 128 tokens, fp32 and bf16
autocast. The eager and the compiled engine are built side by side, warmed up (the compiled
one's first steps include compiling: reported as ``compile_s``), then run step for step in
alternation, so a load change on a shared machine hits both alike; the figure is the ratio of
their median step times. Every row records the CPU, threads, torch version and date.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

FIELDS = (
    "model",
    "amp",
    "eager_step_s",
    "compiled_step_s",
    "speedup",
    "compile_s",
    "eager_tokens_per_s",
    "compiled_tokens_per_s",
    "steps",
    "threads",
    "cpu",
    "torch",
    "date",
)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def measure(model_name: str, amp: str, steps: int, warmup: int) -> dict:
    import torch

    from autosearch import Engine, ModelSpec
    from autosearch.engine import SyntheticTokens
    from autosearch.models.transformer import Transformer

    spec = ModelSpec.load(model_name)
    strategy = f"micro_batch_size=8,global_batch_size=8,amp={amp}"
    data = SyntheticTokens.for_model(spec, 8 * (warmup + steps))
    engines, loaders, times = {}, {}, {"eager": [], "compiled": []}
    compile_s = 0.0
    for mode in ("eager", "compiled"):
        engine = Engine(
            lambda: Transformer(spec),
            optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
            strategy=strategy + (",compile=true" if mode == "compiled" else ""),
            seed=0,
        )
        loaders[mode] = iter(engine.dataloader(data, mode="train"))
        start = time.perf_counter()
        for _ in range(warmup):
            engine.run(next(loaders[mode]))
        if mode == "compiled":
            compile_s = time.perf_counter() - start
        engines[mode] = engine
    for _ in range(steps):
        for mode in ("eager", "compiled"):
            start = time.perf_counter()
            engines[mode].run(next(loaders[mode]))
            times[mode].append(time.perf_counter() - start)
    eager, compiled = statistics.median(times["eager"]), statistics.median(times["compiled"])
    tokens = 8 * spec.seq_len
    return {
        "model": model_name,
        "amp": amp,
        "eager_step_s": round(eager, 5),
        "compiled_step_s": round(compiled, 5),
        "speedup": round(eager / compiled, 3),
        "compile_s": round(compile_s, 1),
        "eager_tokens_per_s": round(tokens / eager),
        "compiled_tokens_per_s": round(tokens / compiled),
        "steps": steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per engine")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps (compiling)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--out", default=str(ROOT / "results" / "engine_compile.csv"))
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    extra = {
        "threads": args.threads,
        "cpu": cpu_name(),
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
    }
    rows = []
    for model in ("tiny-gpt", "tiny-llama"):
        for amp in ("fp32", "bf16"):
            row = {**measure(model, amp, args.steps, args.warmup), **extra}
            rows.append(row)
            print(
                f"{model:10s} {amp}: eager {row['eager_step_s'] * 1e3:7.1f} ms, compiled "
                f"{row['compiled_step_s'] * 1e3:7.1f} ms per step: x{row['speedup']:.2f} "
                f"(compiling {row['compile_s']:.0f} s)",
                flush=True,
            )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {args.out} ({extra['cpu']}, {args.threads} threads)")


if __name__ == "__main__":
    main()
