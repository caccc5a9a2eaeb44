"""One search behind every door: what `tune` picks against what a sweep picks, case by case.

Twelve cases (four models, three clusters of two GPU types): each is searched once by
`autosearch.tune` alone (as ``autosearch tune`` runs it) and once as a row of one sweep that runs
the combinations in parallel processes (``--jobs``). The two picks must be the same strategy at
the same predicted tokens/s. Prints the table and the sweep's wall time; writes
results/doors.csv and results/doors_sweep.csv (with its report beside it).

    python benchmarks/doors.py [--jobs 2]
"""

from __future__ import annotations

import argparse
import csv
import os
import time

from autosearch import TuneConfig, tune
from autosearch.tuning._sweep import SweepConfig, sweep
from cost_models.calibration.machine import this_cpu

MODELS = ("llama3-8b", "llama3-70b", "qwen3-30b-a3b", "gemma3-27b")
CLUSTERS = ("h100-sxm:4x8", "h100-sxm:16x8", "b200-sxm:8x8")
BATCH = 512
SEQ_LEN = 8192
RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    os.makedirs(RESULTS, exist_ok=True)
    cpu = this_cpu()
    isa = ", ".join(cpu.isa or ())
    print(f"CPU: {cpu.name} ({isa}), {cpu.count} cores, load {os.getloadavg()[0]:.1f}")

    alone = {}
    t0 = time.perf_counter()
    for model in MODELS:
        for cluster in CLUSTERS:
            t = time.perf_counter()
            r = tune(
                TuneConfig(model=model, cluster=cluster, global_batch_size=BATCH, seq_len=SEQ_LEN)
            )
            assert r.best_strategy is not None and r.best_report is not None
            alone[(model, cluster)] = (
                r.best_strategy.short(),
                round(r.best_report.tokens_per_s),
                r.search,
                time.perf_counter() - t,
            )
    tune_s = time.perf_counter() - t0

    out = os.path.join(RESULTS, "doors_sweep.csv")
    if os.path.exists(out):
        os.remove(out)
    config = SweepConfig(
        models=MODELS,
        clusters=CLUSTERS,
        global_batch_sizes=[BATCH],
        settings={"seq_len": SEQ_LEN},
        jobs=args.jobs,
        out=out,
    )
    swept = sweep(config)
    rows = []
    same = 0
    for row in swept.rows:
        key = (row["model"].split("-lora")[0], row["cluster"])
        strategy, tps, search, seconds = alone[key]
        match = (row["strategy"], int(row["tokens_per_s"])) == (strategy, tps)
        same += match
        rows.append(
            {
                "model": key[0],
                "cluster": key[1],
                "tune_strategy": strategy,
                "tune_tokens_per_s": tps,
                "tune_search": search,
                "tune_s": round(seconds, 2),
                "sweep_strategy": row["strategy"],
                "sweep_tokens_per_s": row["tokens_per_s"],
                "sweep_search": row["search"],
                "sweep_row_s": row["search_s"],
                "identical": "yes" if match else "no",
            }
        )
    width = max(len(r["tune_strategy"]) for r in rows)
    print(f"{'model':<14} {'cluster':<14} {'tune pick':<{width}} {'tok/s':>9}  sweep")
    for r in rows:
        verdict = (
            "same"
            if r["identical"] == "yes"
            else f"{r['sweep_strategy']} {r['sweep_tokens_per_s']}"
        )
        print(
            f"{r['model']:<14} {r['cluster']:<14} {r['tune_strategy']:<{width}} "
            f"{r['tune_tokens_per_s']:>9,}  {verdict}"
        )
    print(
        f"identical: {same} of {len(rows)}; tune one by one {tune_s:.1f} s; the sweep "
        f"{swept.wall_s:.1f} s with {swept.jobs} processes (the default 10 s budget of priced "
        "work per case); "
        f"load {os.getloadavg()[0]:.1f}"
    )
    path = os.path.join(RESULTS, "doors.csv")
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}, {out} and {swept.report}")


if __name__ == "__main__":
    main()
