"""`autosearch tune`: the fastest strategy that fits, by an Optuna study over the search space.

As thin as Optuna's CLI: the flags are derived from `TuneConfig`'s fields (their `Setting`s),
a ``--config`` file gives the same settings as keys (flags given override it), and `run` turns
them into one TuneConfig for `autosearch.tune`, which checks everything and writes every file;
this module only adds the presentation (--quiet, --dry-run) and prints the summary.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

from autosearch.commands._common import (
    check_text,
    fmt_s,
    load_cluster,
    load_model,
    quiet_interrupted_trials,
)
from autosearch.commands._schema import add_flags, add_presentation_flags, read_args
from autosearch.core.errors import SpecError
from autosearch.core.report import offload_summary
from autosearch.core.schema import flag_of, lora_of, required
from autosearch.tuning._config import TuneConfig, settings_of

EPILOG = """\
storage (--storage):
  default             OUT/study.journal: an Optuna journal file, ~2 ms per persisted trial,
                      safe for several processes on one machine (a lock file next to it)
  FILE.db             SQLite (sqlite:///FILE.db also works): ~25-30 ms per persisted trial
  postgresql+psycopg://user:password@host/db (pip install -e '.[postgres]')
                      many machines on one study: the same command on each (different --seed)
  /shared/nfs/x.journal
                      many machines without a database: a journal on a shared file system
  A killed run loses only the trial in flight; the same command resumes. n_trials counts the
  finished trials of the whole study (all workers), so a finished study does no new work.

config files (--config): a YAML mapping with the flags' names as keys (global_batch_size or
  global-batch-size; pin as a list of KEY=VALUE or a mapping; model and cluster may be mappings
  of their fields); flags on the command line override it. Every run records its settings in
  OUT/study.yaml (key `config`), so `autosearch tune --config OUT/study.yaml` runs it again.

examples:
  autosearch tune --model llama3-70b --cluster h100-sxm:32x8 --global-batch-size 512
  autosearch tune --model llama3-70b --cluster h100-sxm --nnodes 32 --gpus-per-node 8 \\
      --global-batch-size 512 --space megatron --pin tp=8
  autosearch tune ... --objective throughput-memory        # Pareto front with NSGA-II
  autosearch tune --config tune.yaml --seed 1 --dry-run     # what would run, and how long
"""

# The flags that present a run rather than define it: not settings of the job (a --config file
# may still hold them), never recorded in study.yaml.
PRESENTATION = {
    "quiet": "no progress bar",
    "dry_run": "print the space size, its layouts and the expected search time, then stop "
    "(runs a few trials in memory to time them; writes nothing)",
    "plan_only": "print this runtime's plan alone: skip the searches that give each other "
    "framework's own pick for the case (Megatron-Core, torchtitan, DeepSpeed)",
}
DRY_RUN_TRIALS = 20  # trials run in memory by --dry-run to measure the time per trial
# tune's default number of sampled trials (tuning/_study.py), shown by --dry-run when a sampler
# is given without --n-trials.
DEFAULT_N_TRIALS = 200


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "tune",
        help="search the fastest strategy that fits (Optuna + the cost model)",
        description="Search the fastest parallel strategy that fits in memory. The study is "
        "stored in --out (or --storage): running the same command again resumes it, and several "
        "processes running it share it.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_flags(p, TuneConfig)
    add_presentation_flags(p, PRESENTATION)
    p.add_argument(
        "--config",
        metavar="FILE.yaml",
        help="read the settings from a YAML file (keys as the flags; flags given here override "
        "it); a study.yaml written by tune reproduces that run",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from autosearch.tuning import NoFeasibleStrategyError
    from autosearch.tuning._study import tune

    config, shown = config_from(args)
    if shown["dry_run"]:
        print(dry_run(config))
        return 0
    quiet_interrupted_trials()
    try:
        result = tune(config, progress=not shown["quiet"])
    except NoFeasibleStrategyError:
        print(f"trials and the report are in {config.out}/")
        raise
    print(summary(result))
    if not shown["plan_only"] and result.best_strategy is not None:
        print("\n".join(framework_lines(config, result)))
    return 0


def framework_lines(config: TuneConfig, result) -> list[str]:
    """Which runtime the plan is for, and each other framework's own pick for the case (what
    `autosearch tune --runtime R` picks there) next to what this plan does there; that pick
    replaces the plan in the framework's files beside best_strategy.yaml (megatron.sh ...),
    so nobody launches Megatron with a plan made for the Engine."""
    from autosearch.export import write_exports
    from autosearch.tuning._export_check import FRAMEWORK_RUNTIME, check_export, framework_picks

    runtime = config.runtime or "torch"
    lines = [
        f"runtime   this plan is for {runtime}"
        + (" (the Engine)" if runtime == "torch" else "")
        + "; each framework's own pick for this case (`autosearch tune --runtime R`), "
        "written to its files:"
    ]
    picks = framework_picks(config)
    model, cluster = result.space.model, result.space.cluster
    for name, rt in FRAMEWORK_RUNTIME.items():
        if rt == runtime:
            lines.append(f"  {name:<10} this plan ({rt})")
            continue
        pick = picks[name]
        here = check_export(result.best_strategy, target=name, model=model, cluster=cluster)
        there = (
            f"{here.report.tokens_per_s:,.0f} tokens/s"
            + ("" if here.report.fits else ", does not fit")
            if here.report is not None
            else "cannot run it"
        )
        lines.append(f"  {name:<10} {pick.line()} ({rt}; this plan there: {there})")
        if pick.strategy is not None and result.out_dir:
            header = [
                f"the {rt} pick for this case (autosearch tune --runtime {rt}): "
                f"{pick.line()}; best_strategy.yaml beside it is the {runtime} plan"
            ]
            write_exports(
                result.out_dir,
                pick.strategy,
                model=model,
                cluster=cluster,
                to=(name,),
                headers={name: header},
            )
    return lines


def config_from(args: argparse.Namespace) -> tuple[TuneConfig, dict[str, bool]]:
    """The TuneConfig of a command line (the --config file's settings, overridden by the flags
    given; pins merge, a flag's pin replacing the file's for the same dimension), with the
    model and cluster read as the CLI reads them (`Cluster.parse` strict, messages naming the
    flags) and the default --out, results/<study name>; and the presentation flags."""
    from autosearch.core._io import read_yaml_mapping
    from autosearch.tuning import default_study_name

    data = None
    if args.config is not None:
        path = check_text(args.config, "--config")
        data = settings_of(read_yaml_mapping(path, what="config"))
    values, shown = read_args(
        args, [TuneConfig], data=data, what=f"--config {args.config!r}", presentation=PRESENTATION
    )
    fields = dataclasses.fields(TuneConfig)
    missing = [flag_of(f) for f in fields if required(f) and f.name not in values]
    if missing:
        raise SpecError(
            f"tune needs {', '.join(missing)}: give the flag(s), or the key(s) in a --config file"
        )
    lora = lora_of(values.get("lora_rank"), values.get("lora_targets"))
    model = load_model(values["model"], seq_len=values.get("seq_len"), lora=lora)
    cluster = load_cluster(
        values["cluster"],
        nnodes=values.pop("nnodes", None),
        gpus_per_node=values.pop("gpus_per_node", None),
    )
    config = TuneConfig(**{**values, "model": model, "cluster": cluster})
    if config.out is None:
        name = config.study_name or default_study_name(
            model, cluster.name, config.global_batch_size, config.objective
        )
        config = config.replace(out=os.path.join("results", name))
    return config, shown


def dry_run(config: TuneConfig) -> str:
    """What `tune` would do: the space, its layouts, the sampler, and the time it would take,
    measured by running a few trials in memory (nothing is written)."""
    import time

    from autosearch.tuning import NoFeasibleStrategyError, default_study_name, make_objective
    from autosearch.tuning._margin import memory_margin
    from autosearch.tuning._study import _resolve_space, tune

    model, cluster, out = config.model, config.cluster, config.out
    assert not isinstance(model, (str, dict)) and not isinstance(cluster, (str, dict)) and out
    gbs = config.global_batch_size
    space, opened = _resolve_space(None, model, cluster, gbs, config, config.runtime)
    margin = memory_margin(config.runtime, cluster, override=config.memory_margin)
    objective = make_objective(
        config.objective, cluster=cluster, price_per_gpu_hour=config.price_per_gpu_hour
    )
    name = config.study_name or default_study_name(model, cluster.name, gbs, objective.name)
    multi = objective.is_multi
    unit = config.trial_unit or ("strategy" if multi else "layout")
    n_units = space.n_groups if unit == "layout" else space.size
    # Time a few trials in memory with the sampler the search would most likely use.
    probe_sampler = config.sampler or ("nsga2" if multi else "tpe")
    k = min(DRY_RUN_TRIALS, n_units)
    probe = config.replace(space=None, pin={}, n_trials=k, sampler=probe_sampler, trial_unit=unit)
    probe = probe.replace(use_recipes=False, top_k=1, out=None, storage=None, study_name=name)
    t0 = time.perf_counter()
    try:
        tune(probe, space=space)
    except NoFeasibleStrategyError:
        pass
    per_trial = (time.perf_counter() - t0) / k
    n_trials, plan = config.n_trials, None
    if config.sampler is None:  # tune's own plan: the budget rule, or the count of --n-trials
        from autosearch.tuning._study import plan_search

        plan = plan_search(
            space, unit=unit, multi=multi, budget_s=config.time_budget, n_trials=n_trials
        )
        n_trials = plan.n_trials
    elif n_trials is None:
        n_trials = DEFAULT_N_TRIALS
    if plan is not None and plan.exhaustive:
        sampler = "exhaustive"
    elif config.sampler is not None:
        sampler = config.sampler
    elif n_units <= n_trials and not multi:
        sampler = "exhaustive"
    else:
        sampler = "nsga2" if multi else "tpe"
    target = min(n_trials, n_units) if sampler == "exhaustive" else n_trials
    if plan is not None and plan.total:  # the climbs count towards --n-trials
        target = plan.total
    done = _finished_trials(out, name)
    todo = max(0, target - done)
    from search_spaces import LAYOUT_FIELDS

    layouts = list(space.layouts()) if hasattr(space, "layouts") else []
    units = "layouts" if unit == "layout" else "strategies"
    lines = [
        "dry run: nothing is searched or written",
        f"space      {space.describe() if hasattr(space, 'describe') else space.size}",
        f"runtime    {config.runtime or 'torch'}: its dimensions, open or not and why:",
        *(f"           {o.describe()}" for o in opened),
        f"memory     a strategy fits within the capacity less {margin.fraction:.1%} "
        f"({margin.why})",
        f"study      {name} in {out}/ ({done} finished trials there)",
        f"trials     {target} {units}"
        + (
            f": {plan.n_trials} with the {sampler} sampler, the rest a local search from the "
            "best layouts"
            if plan is not None and plan.total
            else f" with the {sampler} sampler"
        )
        + f" ({todo} to run; {n_units:,} {units} in the space)"
        + (
            " and a local search from the best layouts"
            + (
                f", stopped at the {plan.budget_s:g} s time budget if not done by then"
                if plan.budget_s
                else ""
            )
            if plan is not None and plan.local and not plan.total
            else ""
        ),
        *([f"plan       {plan.reason}"] if plan is not None else []),
        f"layouts    {len(layouts)} ({', '.join(LAYOUT_FIELDS)}):",
    ]
    shown = 12
    for layout in layouts[:shown]:
        lines.append(f"           {layout.label()}")
    if len(layouts) > shown:
        lines.append(f"           ... and {len(layouts) - shown} more")
    if not todo:
        lines.append(
            f"expected   no trial to run: the study in {out}/ already holds its {done:,} "
            "trials (the same command reports it again"
            + (", and goes on with its local search if that was stopped" if plan else "")
            + f"; --n-trials above {done:,} or another --out searches more)"
        )
        return "\n".join(lines)
    lines.append(
        f"expected   about {todo * per_trial:,.1f} s of search for {todo} trials"
        + (
            " (and the local search after them)"
            if plan is not None and plan.local and not plan.total
            else ""
        )
        + " "
        f"({per_trial * 1e3:.1f} ms per trial over {k} {probe_sampler} trials run in memory now; "
        "TPE slows as the study grows, and a persistent storage adds its write per trial)"
    )
    return "\n".join(lines)


def _finished_trials(out: str, name: str) -> int:
    """Finished trials of study `name` recorded in OUT/study.yaml (0 when there is none)."""
    from autosearch.core._io import read_yaml_mapping

    path = os.path.join(out, "study.yaml")
    if not os.path.isfile(path):
        return 0
    try:
        doc = read_yaml_mapping(path, what="study record")
    except SpecError:
        return 0
    n = doc.get("n_trials")
    return n if doc.get("study_name") == name and isinstance(n, int) else 0


def summary(result) -> str:
    lines = [f"case      {result.case()}"]
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
            f"          {r.tokens_per_s:,.0f} tokens/s, step {fmt_s(r.step_time_s)}, "
            f"MFU {r.mfu:.1%}",
            f"memory    {result.memory_line(r)}",
        ]
        offloaded = offload_summary(result.best_strategy, r)
        if offloaded:
            lines.append(f"offload   {offloaded}")
        usd = result.usd_per_million_tokens(r)
        if usd is not None:
            lines.append(
                f"cost      ${usd:,.3f} per million tokens at "
                f"${result.price_per_gpu_hour:g} per device-hour"
            )
        if r.band is not None:
            lines.append(f"how sure  {r.band.describe(r.step_time_s)}")
        for i, c in enumerate(result.top_k[1:], 2):
            c_usd = result.usd_per_million_tokens(c.report)
            lines.append(
                f"#{i:<8} {c.strategy.short()}  {c.report.tokens_per_s:,.0f} tokens/s "
                f"({c.report.tokens_per_s / r.tokens_per_s - 1:+.1%})"
                + (f", ${c_usd:,.3f}/M tokens" if c_usd is not None else "")
            )
    fp8 = next((o for o in result.opened if o.name == "fp8"), None)
    if fp8 is not None:
        lines.append(f"fp8       {fp8.why}")
    if result.pareto:
        n = len(result.pareto)
        lines.append(f"Pareto front: {n} strateg{'y' if n == 1 else 'ies'} (pareto.csv)")
    if result.out_dir:
        from autosearch.export import EXPORT_FILES

        exports = [f for f in EXPORT_FILES if os.path.exists(os.path.join(result.out_dir, f))]
        lines.append(
            f"wrote {result.out_dir}/: trials.csv top_k.csv best_strategy.yaml report.md, and "
            f"for other runtimes {' '.join(exports)}"
        )
    return "\n".join(lines)
