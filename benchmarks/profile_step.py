"""Where one training step of the Engine spends its time: torch.profiler over one step.

Builds the Engine for a model of benchmarks/gpu_check.py (``--model moe``: Qwen3-30B-A3B's MoE
layers at 4 layers; ``small``: the 0.49 B dense model) under one strategy on one device, runs
warm-up steps, profiles one step and prints the operators by device time (self time), the
share of the step each takes, and the step's device-busy time against its wall time. It is how
a gap between a measured step and the cost model's prediction is traced to operators.

Run: python benchmarks/profile_step.py [--model moe] [--strategy mb2] [--dry-run] [--out DIR]
Writes OUT/profile_<model>_<strategy>.csv (operator, calls, self device ms, share) and .txt.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("moe", "small"), default="moe")
    p.add_argument("--strategy", default="micro_batch_size=2,global_batch_size=8,amp=bf16")
    p.add_argument("--dry-run", action="store_true", help="a tiny MoE model on CPU")
    p.add_argument("--out", default="results/gpu/profile")
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args(argv)

    import pandas as pd
    import torch
    from gpu_check import gpu_model, moe_model
    from torch.profiler import ProfilerActivity, profile

    from autosearch import ModelSpec, Strategy
    from autosearch.core.model_spec import MoESpec
    from autosearch.engine import Engine
    from autosearch.engine.data import SyntheticTokens
    from autosearch.models.transformer import build
    from autosearch.validation.worker import adamw

    if args.dry_run:
        spec = ModelSpec.load("tiny-llama").scaled(
            name="tiny-moe", n_layers=2, seq_len=64, moe=MoESpec(n_experts=4, top_k=2)
        )
    else:
        spec = moe_model() if args.model == "moe" else gpu_model()
    strategy = Strategy.parse(args.strategy)
    engine = Engine(
        lambda: build(spec),
        optimizer=adamw,
        strategy=strategy,
        meta_init=True,
    )
    engine.prepare(mode="train")
    gbs = strategy.global_batch_size
    data = SyntheticTokens.for_model(spec, n_samples=gbs * (args.warmup + 2), seed=0)
    batches = iter(list(engine.dataloader(data, batch_size=gbs, mode="train")))
    cuda = engine.device_.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(args.warmup):
        engine.run(next(batches), mode="train")
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        engine.run(next(batches), mode="train")
        sync()
        wall = time.perf_counter() - start
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    rows = [
        {"operator": e.key, "calls": e.count, "self_ms": getattr(e, attr) / 1e3}
        for e in prof.key_averages()
        if getattr(e, attr) > 0
    ]
    table = pd.DataFrame(rows).sort_values("self_ms", ascending=False)
    busy = table.self_ms.sum()
    table["share_of_busy"] = table.self_ms / busy
    name = f"profile_{spec.name}_{strategy.short()}"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / f"{name}.csv", index=False)
    head = (
        f"{spec.name}, {args.strategy}: step wall {wall * 1e3:.1f} ms, "
        f"{'device' if cuda else 'CPU'} self time {busy:.1f} ms"
    )
    text = head + "\n" + table.head(40).to_string(index=False, float_format="%.3f")
    (out / f"{name}.txt").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
