"""`autosearch tune`: the fastest strategy that fits, by an Optuna study over the search space."""

from __future__ import annotations

import argparse
import os

from autosearch.commands._common import add_model_cluster_args, fmt_bytes, fmt_s, positive_int_arg

EPILOG = """\
storage (--storage):
  default             OUT/study.journal: an Optuna journal file, ~2 ms per persisted trial, safe for
                      several processes on one machine (a lock file next to it)
  FILE.db             SQLite (sqlite:///FILE.db also works): ~25-30 ms per persisted trial
  postgresql://user:password@host/db, mysql+pymysql://...
                      many machines on one study: run the same command on each (different --seed)
  /shared/nfs/x.journal
                      many machines without a database: a journal file on a shared file system
  A killed run loses only the trial in flight; the same command resumes. n_trials counts the
  finished trials of the whole study (all workers), so a finished study does no new work.

examples:
  autosearch tune --model llama3-70b --cluster h100-sxm:32x8 --global-batch-size 512
  autosearch tune --model llama3-70b --cluster h100-sxm:32x8 --global-batch-size 512 --space megatron --pin tp=8
  autosearch tune ... --objective throughput-memory        # Pareto front with NSGA-II
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "tune",
        help="search the fastest strategy that fits (Optuna + the cost model)",
        description="Search the fastest parallel strategy that fits in memory. The study is stored "
        "in --out (or --storage): running the same command again resumes it, and several "
        "processes running it share it.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_cluster_args(p)
    p.add_argument(
        "--global-batch-size",
        required=True,
        type=positive_int_arg,
        help="sequences per optimizer step",
    )
    p.add_argument(
        "--n-trials",
        type=positive_int_arg,
        default=None,
        help="finished trials the study should hold (a resumed study runs only the rest); "
        "default: every layout when scoring them all is estimated under 10 s, else 200",
    )
    p.add_argument(
        "--sampler",
        choices=["tpe", "nsga2", "random", "exhaustive"],
        help="default: exhaustive when --n-trials covers the whole space, else tpe for one "
        "objective and nsga2 for two",
    )
    p.add_argument(
        "--objective",
        default="throughput",
        choices=["throughput", "throughput-memory", "throughput-cost"],
    )
    p.add_argument(
        "--price-per-gpu-hour", type=float, help="dollars per device-hour (for throughput-cost)"
    )
    p.add_argument(
        "--space", help="search space YAML, or a shipped space name (default, megatron)"
    )
    p.add_argument(
        "--pin",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="pin or narrow a dimension, e.g. --pin tp=8 --pin recompute=selective,full (repeatable)",
    )
    p.add_argument(
        "--trial-unit",
        choices=["layout", "strategy"],
        help="layout (default for throughput): score every recompute/sp/zero/amp of a sampled layout",
    )
    p.add_argument(
        "--storage",
        help="Optuna storage: a .journal or .db file, or an RDB URL (default: OUT/study.journal)",
    )
    p.add_argument("--study-name", help="default: <model>_<cluster>_gbs<batch>_<objective>")
    p.add_argument("--seed", type=int, help="sampler seed (give parallel workers different seeds)")
    p.add_argument("--top-k", type=positive_int_arg, default=5)
    p.add_argument("--out", help="output folder (default results/<study name>/)")
    p.add_argument(
        "--no-recipes", action="store_true", help="do not enqueue the usual recipes first"
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def parse_pins(items: list[str]) -> dict:
    from autosearch.core.errors import SpecError
    from autosearch.core.strategy import _parse_scalar

    pins = {}
    for item in items:
        if "=" not in item:
            raise SpecError(
                f"--pin {item!r} is not KEY=VALUE (example: --pin tp=8 or --pin zero_stage=0,1)"
            )
        key, value = (x.strip() for x in item.split("=", 1))
        parts = [_parse_scalar(v.strip()) for v in value.split(",") if v.strip()]
        pins[key] = parts[0] if len(parts) == 1 else parts
    return pins


def run(args: argparse.Namespace) -> int:
    from autosearch.commands._common import load_model_cluster
    from autosearch.tuning import NoFeasibleStrategyError, default_study_name, tune
    from search_spaces import SearchSpace

    model, cluster = load_model_cluster(args)
    space = SearchSpace(
        model,
        cluster,
        global_batch_size=args.global_batch_size,
        config=args.space,
        **parse_pins(args.pin),
    )
    objective = {"memory": "throughput-memory", "cost": "throughput-cost"}.get(
        args.objective, args.objective
    )
    name = args.study_name or default_study_name(
        model.name, cluster.name, args.global_batch_size, objective
    )
    out = args.out or os.path.join("results", name)
    if not args.quiet:
        print(f"searching {space.describe()}")
    try:
        result = tune(
            model,
            cluster,
            global_batch_size=args.global_batch_size,
            space=space,
            objective=objective,
            n_trials=args.n_trials,
            sampler=args.sampler,
            storage=args.storage,
            study_name=name,
            seed=args.seed,
            top_k=args.top_k,
            runtime=args.runtime,
            price_per_gpu_hour=args.price_per_gpu_hour,
            trial_unit=args.trial_unit,
            use_recipes=not args.no_recipes,
            out=out,
            progress=not args.quiet,
        )
    except NoFeasibleStrategyError:
        print(f"trials and the report are in {out}/")
        raise
    print(summary(result))
    return 0


def summary(result) -> str:
    lines = []
    ran = (
        f"{result.n_new_trials} new"
        if result.n_new_trials
        else "nothing new to run: the study was finished"
    )
    lines.append(f"{result.n_trials} trials ({ran}) in {result.timings.get('search_s', 0):.1f} s")
    if result.plan:
        lines.append(f"search    {result.plan}")
    if result.best_strategy is not None:
        r = result.best_report
        lines += [
            f"best      {result.best_strategy.short()}",
            f"          {r.tokens_per_s:,.0f} tokens/s, step {fmt_s(r.step_time_s)}, MFU {r.mfu:.1%}, "
            f"memory {fmt_bytes(r.peak_memory_bytes)} of {fmt_bytes(r.memory_capacity_bytes)}",
        ]
        for i, c in enumerate(result.top_k[1:], 2):
            lines.append(
                f"#{i:<8} {c.strategy.short()}  {c.report.tokens_per_s:,.0f} tokens/s "
                f"({c.report.tokens_per_s / r.tokens_per_s - 1:+.1%})"
            )
    if result.pareto:
        lines.append(f"Pareto front: {len(result.pareto)} strategies (pareto.csv)")
    if result.out_dir:
        lines.append(f"wrote {result.out_dir}/: trials.csv top_k.csv best_strategy.yaml report.md")
    return "\n".join(lines)
