"""How good and how fast is the search? Prints and writes results/search_quality.csv.

Part 1, regret: for six real cases (model, cluster, realistic global batch), the size of the space,
its exhaustive optimum (every strategy scored), and what `tune` finds after 50, 100 and 200 trials
(regret = 1 - found / optimum throughput, among strategies that fit), for three seeds, with the
wall time of each 200-trial search. Three searches are measured: `tune --n-trials N` as a user
runs it (no sampler: a quarter of N sampled by TPE and the local search's climbs until the study
holds N, one run per N), TPE on layouts (`--sampler tpe`: each trial scores every recompute x
sequence-parallel x ZeRO x amp combination of the sampled layout; the regret after its first 50,
100 and 200 trials), and plain TPE with one strategy per trial, for comparison.
Targets: zero regret at 200 trials in >= 5 of 6 cases and <= 1 % in all; < 10 s per 200-trial
search;
exhaustive enumeration (and scoring) of 100,000 strategies < 10 s.

Part 2, the experts: for every row of benchmarks/reference/sc21_table1.csv (Narayanan et al. 2021,
Table 1), the best strategy found for that model, cluster and batch against the published
configuration, both scored by the cost model with runtime megatron-sc21 and amp fp16
(ratio = found / published throughput; it should never be below 1). Also with the tools of 2021
only (no sequence parallel, no ZeRO, recompute none or full).

Part 3, overhead: the cost of one Optuna trial and of persisting it (in memory, journal file,
SQLite).

Usage: python benchmarks/search_quality.py [--quick] [--out results/search_quality.csv]
Timings depend on the machine and on what else runs on it; the figures are printed, not asserted.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from autosearch import Cluster, tune  # noqa: E402
from autosearch.core.model_spec import ModelSpec, model_catalog  # noqa: E402
from autosearch.core.strategy import Strategy  # noqa: E402
from cost_models import AnalyticCostModel  # noqa: E402
from search_spaces import SearchSpace  # noqa: E402

CASES = [  # (model, cluster, global batch, why this batch)
    (
        "gpt3-175b",
        "a100-sxm4-80gb:128x8",
        1536,
        "GPT-3: 3.2M tokens per batch (Brown et al. 2020, Table 2.1)",
    ),
    ("llama3-70b", "h100-sxm:32x8", 512, "4M tokens per batch at 8K sequence"),
    ("llama3-8b", "h100-sxm:8x8", 512, "4M tokens per batch at 8K sequence"),
    ("llama2-13b", "a100-sxm4-80gb:16x8", 1024, "4M tokens per batch (Touvron et al. 2023)"),
    ("gpt3-13b", "a100-sxm4-40gb:32x8", 1024, "2M tokens per batch (Brown et al. 2020)"),
    ("llama3.1-405b", "h100-sxm:128x8", 2048, "16M tokens per batch (Llama 3 herd, sec. 3.4)"),
]
CHECKPOINTS = (50, 100, 200)
SEEDS = (0, 1, 2)
REFERENCE = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "reference", "sc21_table1.csv"
)


def exhaustive(space, cm):
    """Score every strategy; return (best feasible throughput, its strategy, count, seconds)."""
    t0 = time.perf_counter()
    best, best_s, n = 0.0, None, 0
    for s in space.enumerate():
        r = cm.estimate(s, validate=False)
        n += 1
        if r.fits and r.tokens_per_s > best:
            best, best_s = r.tokens_per_s, s
    return best, best_s, n, time.perf_counter() - t0


def regrets(result, optimum: float) -> dict[int, float]:
    """Regret after the first n trials of a finished in-memory study."""
    best_by_n, best = {}, 0.0
    trials = sorted(result.study.get_trials(deepcopy=False), key=lambda t: t.number)
    marks = iter(sorted(CHECKPOINTS))
    mark = next(marks)
    for i, t in enumerate(trials, 1):
        rep = t.user_attrs.get("report")
        if rep and rep["fits"]:
            best = max(best, rep["tokens_per_s"])
        while mark is not None and i == mark:
            best_by_n[mark] = 1.0 - best / optimum
            mark = next(marks, None)
    for m in CHECKPOINTS:
        best_by_n.setdefault(m, 1.0 - best / optimum)
    return best_by_n


def part_regret(rows: list[dict], quick: bool) -> None:
    print("== Part 1: regret of the search against the exhaustive optimum")
    print(
        f"{'case':<44} {'space':>7} {'layouts':>7} {'exh. s':>6} "
        f" {'--n-trials 50/100/200':<27} {'--sampler tpe @50/100/200':<27} {'s/200':>6}"
        f"  {'plain TPE @200':>14}"
    )
    print(f"{'':<67}(worst regret of the seeds)")
    seeds = SEEDS[:1] if quick else SEEDS
    for model, cluster, gbs, why in CASES:
        space = SearchSpace(model, cluster, global_batch_size=gbs)
        cm = AnalyticCostModel(space.model, space.cluster)
        optimum, opt_s, n, exh_s = exhaustive(space, cm)
        per_seed, walls, plain, counted = [], [], [], []
        for seed in seeds:
            counted.append(
                {
                    m: regrets(
                        tune(
                            space.model,
                            space.cluster,
                            global_batch_size=gbs,
                            space=space,
                            n_trials=m,
                            seed=seed,
                        ),
                        optimum,
                    )[m]
                    for m in CHECKPOINTS
                }
            )
            t0 = time.perf_counter()
            res = tune(
                space.model,
                space.cluster,
                global_batch_size=gbs,
                space=space,
                n_trials=200,
                seed=seed,
                sampler="tpe",
            )
            walls.append(time.perf_counter() - t0)
            per_seed.append(regrets(res, optimum))
            res2 = tune(
                space.model,
                space.cluster,
                global_batch_size=gbs,
                space=space,
                n_trials=200,
                seed=seed,
                sampler="tpe",
                trial_unit="strategy",
            )
            plain.append(regrets(res2, optimum)[200])
        worst = {m: max(r[m] for r in per_seed) for m in CHECKPOINTS}
        worst_counted = {m: max(r[m] for r in counted) for m in CHECKPOINTS}
        label = f"{model} on {cluster} gbs {gbs}"
        print(
            f"{label:<44} {space.size:>7} {space.n_groups:>7} {exh_s:>6.2f} "
            f" {' / '.join(f'{worst_counted[m]:6.2%}' for m in CHECKPOINTS):<27}"
            f" {' / '.join(f'{worst[m]:6.2%}' for m in CHECKPOINTS):<27} {max(walls):>6.2f} "
            f" {max(plain):>13.2%}"
        )
        rows.append(
            {
                "kind": "regret",
                "case": label,
                "model": model,
                "cluster": cluster,
                "n_gpus": space.cluster.world_size,
                "global_batch_size": gbs,
                "batch_note": why,
                "space_size": space.size,
                "layouts": space.n_groups,
                "exhaustive_s": round(exh_s, 3),
                "exhaustive_strategies_per_s": round(n / exh_s),
                "optimum_tokens_per_s": optimum,
                "optimum_strategy": opt_s.short() if opt_s else "",
                **{f"n_trials_{m}_regret_worst": worst_counted[m] for m in CHECKPOINTS},
                **{
                    f"n_trials_{m}_regret_mean": statistics.mean(r[m] for r in counted)
                    for m in CHECKPOINTS
                },
                **{f"regret_{m}_worst": worst[m] for m in CHECKPOINTS},
                **{
                    f"regret_{m}_mean": statistics.mean(r[m] for r in per_seed)
                    for m in CHECKPOINTS
                },
                "seeds": len(seeds),
                "wall_s_200_max": round(max(walls), 3),
                "wall_s_200_mean": round(statistics.mean(walls), 3),
                "plain_tpe_regret_200_worst": max(plain),
                "plain_tpe_regret_200_mean": statistics.mean(plain),
            }
        )
    regret_rows = [r for r in rows if r["kind"] == "regret"]
    slowest = max(r["wall_s_200_max"] for r in regret_rows)
    for what, column in (
        ("--n-trials 200", "n_trials_200_regret_worst"),
        ("--sampler tpe", "regret_200_worst"),
    ):
        zero = sum(r[column] <= 1e-12 for r in regret_rows)
        worst_all = max(r[column] for r in regret_rows)
        print(
            f"{what}: zero regret at 200 trials (every seed) in {zero} of {len(CASES)} cases "
            f"(target >= 5); worst regret {worst_all:.2%} (target <= 1%)"
        )
    print(f"slowest 200-trial TPE search {slowest:.2f} s (target < 10 s)")


def part_enumeration(rows: list[dict]) -> None:
    print("\n== Exhaustive enumeration speed")
    target = 100_000
    spaces = [SearchSpace(m, c, global_batch_size=g) for m, c, g, _ in CASES]
    models = {id(s): AnalyticCostModel(s.model, s.cluster) for s in spaces}
    t0 = time.perf_counter()
    n = 0
    for space in itertools.cycle(spaces):
        cm = models[id(space)]
        for s in space.enumerate():
            cm.estimate(s, validate=False)
            n += 1
            if n >= target:
                break
        if n >= target:
            break
    dt = time.perf_counter() - t0
    print(
        f"{n:,} strategies enumerated and scored in {dt:.2f} s ({n / dt:,.0f} per s; target <"
        " 10 s)"
    )
    rows.append(
        {
            "kind": "enumeration",
            "case": f"{n} strategies from the six spaces",
            "space_size": n,
            "exhaustive_s": round(dt, 3),
            "exhaustive_strategies_per_s": round(n / dt),
        }
    )


def published_strategy(row: dict) -> Strategy:
    v = int(row["virtual_stages"])
    return Strategy(
        dp=int(row["dp"]),
        tp=int(row["tp"]),
        pp=int(row["pp"]),
        micro_batch_size=int(row["micro_batch_size"]),
        global_batch_size=int(row["global_batch_size"]),
        pipeline_schedule="interleaved_1f1b" if v > 1 else "1f1b",
        virtual_stages=v,
        recompute=row["recompute"],
        sequence_parallel=row["sequence_parallel"] == "true",
        zero_stage=int(row["zero_stage"]),
        amp=row["precision"],
    )


def sc21_model(row: dict) -> ModelSpec:
    """The catalog model of a Table 1 row, matched by shape (1008.0B vs sc21-gpt-1008b)."""
    shape = (int(row["n_layers"]), int(row["hidden_size"]), int(row["n_heads"]))
    for name, m in model_catalog().items():
        if name.startswith("sc21-") and (m.n_layers, m.hidden_size, m.n_heads) == shape:
            return m
    raise SystemExit(f"no sc21-* catalog model with (layers, hidden, heads) = {shape}")


def part_sc21(rows: list[dict]) -> None:
    print(
        "\n== Part 2: the search against the published configurations of SC'21 Table 1 "
        "(cost model runtime megatron-sc21, amp fp16)"
    )
    print(
        f"{'model':<16} {'gpus':>5} {'gbs':>5}  {'published':<44} {'found (TPE, 200 trials)':<52}"
        f" {'ratio':>6} {'exh.':>6} {'2021 tools':>10}"
    )
    with open(REFERENCE, newline="") as f:
        table = list(csv.DictReader(f))
    for row in table:
        model = sc21_model(row)
        n = int(row["n_gpus"])
        cluster = Cluster(
            gpu=row["gpu"],
            n_nodes=n // int(row["gpus_per_node"]),
            gpus_per_node=int(row["gpus_per_node"]),
        )
        gbs = int(row["global_batch_size"])
        cm = AnalyticCostModel(model, cluster, runtime="megatron-sc21")
        pub = published_strategy(row)
        pub_r = cm.estimate(pub)
        space = SearchSpace(model, cluster, global_batch_size=gbs, amp="fp16")
        in_space = pub in space
        res = tune(
            model,
            cluster,
            global_batch_size=gbs,
            space=space,
            n_trials=200,
            seed=0,
            runtime="megatron-sc21",
            sampler="tpe",
        )
        found_r = res.best_report
        opt, opt_s, _, _ = exhaustive(space, cm)
        old = SearchSpace(
            model,
            cluster,
            global_batch_size=gbs,
            amp="fp16",
            sequence_parallel=False,
            zero_stage=0,
            recompute=["none", "full"],
        )
        res_old = tune(
            model,
            cluster,
            global_batch_size=gbs,
            space=old,
            n_trials=200,
            seed=0,
            runtime="megatron-sc21",
            sampler="tpe",
        )
        base = pub_r.tokens_per_s if pub_r.fits else float("nan")
        ratio = found_r.tokens_per_s / base
        print(
            f"{model.name:<16} {n:>5} {gbs:>5}  {pub.short():<44} {res.best_strategy.short():<52}"
            f" {ratio:>6.3f} {opt / base:>6.3f} {res_old.best_report.tokens_per_s / base:>10.3f}"
            + ("" if pub_r.fits else "  (published config does not fit in the cost model!)")
            + ("" if in_space else "  (published config not in the space!)")
        )
        rows.append(
            {
                "kind": "sc21",
                "case": row["id"],
                "model": model.name,
                "cluster": cluster.name,
                "n_gpus": n,
                "global_batch_size": gbs,
                "space_size": space.size,
                "layouts": space.n_groups,
                "published_strategy": pub.short(),
                "published_fits": pub_r.fits,
                "published_in_space": in_space,
                "published_tokens_per_s": pub_r.tokens_per_s,
                "published_tflops_per_gpu_model": pub_r.tflops_per_gpu,
                "published_tflops_per_gpu_paper": float(row["published_tflops_per_gpu"]),
                "found_strategy": res.best_strategy.short(),
                "found_tokens_per_s": found_r.tokens_per_s,
                "ratio_found_over_published": ratio,
                "ratio_exhaustive_over_published": opt / base,
                "exhaustive_strategy": opt_s.short() if opt_s else "",
                "found_strategy_2021_tools": res_old.best_strategy.short(),
                "ratio_2021_tools_over_published": res_old.best_report.tokens_per_s / base,
                "wall_s_200_max": round(res.timings.get("search_s", 0.0), 3),
            }
        )
    ratios = [r["ratio_found_over_published"] for r in rows if r["kind"] == "sc21"]
    print(
        f"found/published: min {min(ratios):.3f}, median {statistics.median(ratios):.3f} (should"
        " never be below 1)"
    )


def part_overhead(rows: list[dict]) -> None:
    print(
        "\n== Part 3: per-trial overhead of Optuna and of persistence (llama3-70b on 256 h100-sxm,"
        " 200 trials)"
    )
    model, cluster, gbs, _ = CASES[1]
    space = SearchSpace(model, cluster, global_batch_size=gbs)
    with tempfile.TemporaryDirectory() as tmp:
        for label, storage in (
            ("in memory", None),
            ("journal file", os.path.join(tmp, "s.journal")),
            ("SQLite", os.path.join(tmp, "s.db")),
        ):
            t0 = time.perf_counter()
            res = tune(
                model,
                cluster,
                global_batch_size=gbs,
                space=space,
                n_trials=200,
                seed=0,
                storage=storage,
                sampler="tpe",
            )
            dt = time.perf_counter() - t0
            print(
                f"{label:<14} {dt:6.2f} s for 200 trials ({dt / 200 * 1e3:5.1f} ms per trial), "
                f"best {res.best_report.tokens_per_s:,.0f} tokens/s"
            )
            rows.append(
                {
                    "kind": "overhead",
                    "case": f"storage {label}",
                    "model": model,
                    "cluster": cluster,
                    "global_batch_size": gbs,
                    "wall_s_200_max": round(dt, 3),
                    "ms_per_trial": round(dt / 200 * 1e3, 2),
                }
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one seed instead of three")
    parser.add_argument("--out", default=os.path.join("results", "search_quality.csv"))
    parser.add_argument(
        "--skip",
        default="",
        help="comma-separated parts to skip: regret,enumeration,sc21,overhead",
    )
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    rows: list[dict] = []
    t0 = time.perf_counter()
    if "regret" not in skip:
        part_regret(rows, args.quick)
    if "enumeration" not in skip:
        part_enumeration(rows)
    if "sc21" not in skip:
        part_sc21(rows)
    if "overhead" not in skip:
        part_overhead(rows)
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
    print(
        f"\nwrote {args.out} ({len(rows)} rows) in {time.perf_counter() - t0:.0f} s; python"
        f" {sys.version.split()[0]}, {os.cpu_count()} CPUs (shared with other work: timings are"
        " indicative)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
