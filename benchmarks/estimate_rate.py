"""How fast the cost model scores a layout's strategies: the price of the search's time budget.

`tune`'s budget (`--time-budget`, 10 s) is counted in work, not read off a clock: each layout
scored costs its strategies times the cost model's time per estimate (`ESTIMATE_S` in
autosearch/tuning/_study.py, dense and mixture-of-experts models), plus what the storage adds per
trial. So the plan (exhaustive or sampled) and where the local search stops are the same on every
machine, busy or quiet, and every door picks the same strategy. This benchmark measures the time
per estimate as the search spends it (every strategy of a layout in a row, as a trial scores
them, in this process's CPU seconds) on a spread of layouts of dense and MoE cases, and prints it
next to the shipped constants: they should agree within the spread of the cases.

    python benchmarks/estimate_rate.py        # writes results/estimate_rate.csv
"""

from __future__ import annotations

import csv
import itertools
import os
import time

from autosearch import TuneConfig
from autosearch.tuning._study import ESTIMATE_S, prepare
from cost_models.calibration.machine import this_cpu

CASES = [  # (model, cluster, global batch, runtime)
    ("llama3-8b", "h100-sxm:4x8", 512, None),
    ("llama3-70b", "h100-sxm:16x8", 512, None),
    ("llama3.1-405b", "h100-sxm:128x8", 2048, "megatron-core"),
    ("gpt3-175b", "a100-sxm4-80gb:48x8", 1536, "megatron-sc21"),
    ("qwen3-30b-a3b", "h100-sxm:8x8", 512, None),
    ("qwen3-30b-a3b", "h100-sxm:8x8", 512, "torchtitan"),
    ("mixtral-8x7b", "h100-sxm:8x8", 512, None),
    ("deepseek-v3", "h100-sxm:32x8", 1024, "megatron-core"),
]
LAYOUTS = 24  # spread evenly over each space's layouts
RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")


def main() -> None:
    cpu = this_cpu()
    print(f"CPU: {cpu.name} ({', '.join(cpu.isa or ())}), load {os.getloadavg()[0]:.1f}")
    rows = []
    for model, cluster, gbs, runtime in CASES:
        config = TuneConfig(
            model=model, cluster=cluster, global_batch_size=gbs, runtime=runtime, n_trials=1
        )
        job = prepare(config.replace(sampler="random"))
        space, cm = job.space, job.cost_model
        every = max(1, space.n_groups // LAYOUTS)
        layouts = list(itertools.islice(space.group_params(every=every), LAYOUTS + 1))
        import optuna

        groups = [space.suggest_group(optuna.trial.FixedTrial(p)) for p in layouts]
        for s in groups[0]:  # imports and cold caches, once
            try:
                cm.estimate(s, validate=False)
            except ValueError:
                pass
        n, t0 = 0, time.process_time()
        for group in groups[1:]:
            for s in group:
                try:
                    cm.estimate(s, validate=False)
                except ValueError:
                    pass
                n += 1
        per = (time.process_time() - t0) / n
        kind = "moe" if job.model.moe is not None else "dense"
        rows.append(
            {
                "model": model,
                "cluster": cluster,
                "runtime": runtime or "torch",
                "kind": kind,
                "strategies_per_layout": round(space.size / space.n_groups, 1),
                "us_per_estimate": round(per * 1e6, 1),
                "shipped_us": round(ESTIMATE_S[kind] * 1e6, 1),
            }
        )
        print(
            f"{model:15s} {runtime or 'torch':14s} {kind:5s} "
            f"{space.size / space.n_groups:6.0f} strategies/layout  {per * 1e6:6.1f} us per "
            f"estimate (shipped {ESTIMATE_S[kind] * 1e6:.0f})"
        )
    for kind in ("dense", "moe"):
        values = sorted(r["us_per_estimate"] for r in rows if r["kind"] == kind)
        print(f"{kind}: median {values[len(values) // 2]:.1f} us over {len(values)} cases")
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, "estimate_rate.csv")
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
