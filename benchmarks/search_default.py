"""Does the default search find the cost model's own optimum? 24 cases x 5 seeds, no luck allowed.

Every case is a (model, cluster, global batch) from 1.3B to 405B parameters, 8 to 16,384 GPUs,
four GPU types and small to large batches. For each, the exhaustive optimum (every strategy of the
default space scored) is the reference; `tune` runs with its default settings (no n_trials, no
sampler) for five seeds, and regret = 1 - found / optimum throughput. Targets (issue 10): zero
regret in every case and seed; at most 10 s per search on one core (the slowest is reported).

With --extended, the space of today's stacks instead (issue 10 item 1: does the rule stay exact
and fast when the space grows?): context parallel, fp8 (where the GPU has it), torch.compile,
async TP and uneven pipeline splits, scored under the torchtitan runtime (which runs them all),
on `EXTENDED_CASES`; written to results/search_extended.csv with the plan tune chose.

Run: python benchmarks/search_default.py [--seeds 5] [--out results/search_default.csv]
     python benchmarks/search_default.py --extended [--seeds 3]
(the CSV gets one row per case and seed; timings depend on what else runs on the machine)
"""

from __future__ import annotations

import argparse
import csv
import os
import time
from pathlib import Path

from autosearch import tune
from cost_models import AnalyticCostModel
from search_spaces import SearchSpace, SpaceConfig

CASES = [  # (model, cluster, global batch)
    ("gpt3-1.3b", "a100-sxm4-40gb:1x8", 256),
    ("gpt3-1.3b", "h100-sxm:4x8", 512),
    ("gpt3-2.7b", "a100-sxm4-80gb:2x8", 512),
    ("gpt3-6.7b", "a100-sxm4-40gb:8x8", 1024),
    ("llama2-7b", "a100-sxm4-80gb:4x8", 256),
    ("llama3-8b", "h100-sxm:1x8", 64),
    ("llama3-8b", "h100-sxm:8x8", 512),
    ("llama3-8b", "h200-sxm:16x8", 1024),
    ("llama3.1-8b", "h100-sxm:128x8", 2048),
    ("gpt3-13b", "a100-sxm4-40gb:32x8", 1024),
    ("llama2-13b", "a100-sxm4-80gb:16x8", 1024),
    ("sc21-gpt-18.4b", "a100-sxm4-80gb:32x8", 1024),
    ("sc21-gpt-39.1b", "a100-sxm4-80gb:64x8", 1536),
    ("llama2-70b", "a100-sxm4-80gb:64x8", 1024),
    ("llama3-70b", "h100-sxm:8x8", 128),
    ("llama3-70b", "h100-sxm:32x8", 512),
    ("llama3.1-70b", "h200-sxm:64x8", 1024),
    ("llama3-70b", "h100-sxm:256x8", 4096),
    ("sc21-gpt-145.6b", "a100-sxm4-80gb:192x8", 1536),
    ("gpt3-175b", "a100-sxm4-80gb:48x8", 1536),
    ("gpt3-175b", "a100-sxm4-80gb:192x8", 1536),
    ("gpt3-175b", "h100-sxm:128x8", 2048),
    ("llama3.1-405b", "h100-sxm:128x8", 2048),
    ("llama3.1-405b", "h100-sxm:2048x8", 16384),
]


EXTENDED_CASES = [
    ("llama3-8b", "h100-sxm:1x8", 64),
    ("llama3-8b", "h100-sxm:8x8", 512),
    ("llama3.1-8b", "h200-sxm:16x8", 1024),
    ("gpt3-13b", "a100-sxm4-80gb:16x8", 1024),
    ("llama3-70b", "h100-sxm:32x8", 512),
    ("llama3.1-70b", "h200-sxm:64x8", 1024),
    ("gpt3-175b", "a100-sxm4-80gb:48x8", 1536),
    ("llama3.1-405b", "h100-sxm:128x8", 2048),
]
# Every dimension of today's stacks: cp over every degree that fits, fp8 where the GPU has it
# (the space drops it elsewhere), compile, async TP (with tp > 1), uneven pipeline splits.
EXTENDED = SpaceConfig(
    cp=None,
    fp8=("none", "tensorwise", "rowwise"),
    compile=(False, True),
    async_tp=(False, True),
    uneven_pipeline=True,
)
EXTENDED_RUNTIME = "torchtitan"


def optimum(
    model: str, cluster: str, gbs: int, *, config=None, runtime=None
) -> tuple[float, str, int, float]:
    space = SearchSpace(model, cluster, global_batch_size=gbs, config=config)
    cm = AnalyticCostModel(space.model, space.cluster, runtime=runtime)
    t0 = time.perf_counter()
    best, best_s = 0.0, ""
    for s in space.enumerate():
        r = cm.estimate(s, validate=False)
        if r.fits and r.tokens_per_s > best:
            best, best_s = r.tokens_per_s, s.short()
    return best, best_s, space.size, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--out", default=None)
    parser.add_argument("--extended", action="store_true", help="the space of today's stacks")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ext = args.extended
    cases = EXTENDED_CASES if ext else CASES
    config, runtime = (EXTENDED, EXTENDED_RUNTIME) if ext else (None, None)
    out = args.out or f"results/search_{'extended' if ext else 'default'}.csv"
    rows = []
    for model, cluster, gbs in cases:
        best, best_s, size, exh_s = optimum(model, cluster, gbs, config=config, runtime=runtime)
        for seed in range(args.seeds):
            t0 = time.perf_counter()
            space = SearchSpace(model, cluster, global_batch_size=gbs, config=config)
            result = tune(
                space.model,
                space.cluster,
                global_batch_size=gbs,
                space=space,
                runtime=runtime,
                seed=seed,
            )
            wall = time.perf_counter() - t0
            found = result.best_report.tokens_per_s if result.best_report else 0.0
            regret = 1 - found / best if best else 0.0
            rows.append(
                {
                    "model": model,
                    "cluster": cluster,
                    "global_batch_size": gbs,
                    "seed": seed,
                    "space_size": size,
                    "optimum_tokens_per_s": best,
                    "optimum": best_s,
                    "found_tokens_per_s": found,
                    "found": result.best_strategy.short() if result.best_strategy else "",
                    "regret": regret,
                    "trials": result.n_trials,
                    "layouts": result.n_units,
                    "plan": result.plan.split(":")[0],
                    "search_s": wall,
                    "exhaustive_scoring_s": exh_s,
                }
            )
            print(
                f"{model:16s} {cluster:22s} gbs {gbs:6d} seed {seed}  size {size:7d}  "
                f"regret {regret:6.2%}  {wall:5.2f} s  {result.plan.split(':')[0]}",
                flush=True,
            )
    worst = max(r["regret"] for r in rows)
    zero = sum(r["regret"] <= 1e-12 for r in rows)
    slowest = max(r["search_s"] for r in rows)
    print(
        f"\n{len(cases)} cases x {args.seeds} seeds: zero regret in {zero} of {len(rows)} "
        f"searches (target: all), worst regret {worst:.2%}; slowest search {slowest:.2f} s "
        "(target <= 10 s)"
    )
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
