"""`autosearch tune`: the fastest strategy that fits, by an Optuna study over the search space."""

from __future__ import annotations

import argparse
import os
import re

from autosearch.commands._common import (
    add_model_cluster_args,
    batch_size_arg,
    check_output_folder,
    check_text,
    finite_float_arg,
    fmt_bytes,
    fmt_s,
    positive_int_arg,
    quiet_interrupted_trials,
)
from autosearch.commands.export import OUTPUT_FILES as EXPORT_FILES
from autosearch.core.errors import SpecError

# What `tune` writes into --out (checked before the search: none may be a folder).
OUTPUT_FILES = (
    "trials.csv",
    "top_k.csv",
    "pareto.csv",
    "best_strategy.yaml",
    "study.yaml",
    "report.md",
    "study.journal",
    ".lock",
    "time_breakdown.png",
    "throughput_memory.png",
    "importances.png",
) + EXPORT_FILES
STUDY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+=-]{0,199}")
# Database drivers by SQLAlchemy dialect: what to install when one is missing.
DRIVERS = {
    "postgresql": "pip install -e '.[postgres]' (psycopg 3), and write the URL as "
    "postgresql+psycopg://user:password@host/dbname",
    "mysql": "pip install pymysql, and write the URL as mysql+pymysql://user:password@host/dbname",
}

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

# Flags that must have a value, from the command line or from --config.
REQUIRED = ("model", "cluster", "global_batch_size")
# Flags not recorded in the config block of study.yaml (presentation only).
NOT_RECORDED = ("quiet", "dry_run", "config", "help")
DRY_RUN_TRIALS = 20  # trials run in memory by --dry-run to measure the time per trial
# tune's default budget when --n-trials is not given (tuning/_study.py): every layout when
# scoring them all takes under DEFAULT_BUDGET_S, else DEFAULT_N_TRIALS trials.
DEFAULT_BUDGET_S = 10.0
DEFAULT_N_TRIALS = 200


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "tune",
        help="search the fastest strategy that fits (Optuna + the cost model)",
        description="Search the fastest parallel strategy that fits in memory. The study is "
        "stored "
        "in --out (or --storage): running the same command again resumes it, and several "
        "processes running it share it.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_cluster_args(p, required=False)
    p.add_argument(
        "--global-batch-size",
        type=batch_size_arg,
        help="sequences per optimizer step (required, here or in --config)",
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
        choices=["throughput", "throughput-pessimistic", "throughput-memory", "throughput-cost"],
        help="what to maximise: tokens/s (default); tokens/s at the slow end of each "
        "prediction's error band (pessimistic); or a Pareto front of tokens/s against peak "
        "memory or against dollars per token",
    )
    p.add_argument(
        "--price-per-gpu-hour",
        type=finite_float_arg,
        help="dollars per device-hour: needed by throughput-cost; with any objective, adds "
        "dollars per million tokens to the summary, report.md and top_k.csv",
    )
    p.add_argument(
        "--space", help="search space YAML, or a shipped space name (default, megatron)"
    )
    p.add_argument(
        "--pin",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="pin or narrow a dimension, e.g. --pin tp=8 --pin recompute=selective,full "
        "(repeatable)",
    )
    p.add_argument(
        "--trial-unit",
        choices=["layout", "strategy"],
        help="layout (default for throughput): score every recompute/sp/zero/amp of a sampled "
        "layout; strategy: one strategy per trial",
    )
    p.add_argument(
        "--storage",
        help="Optuna storage: a .journal or .db file, or an RDB URL (default: OUT/study.journal)",
    )
    p.add_argument(
        "--study-name",
        help="default: <model>_<cluster>_gbs<batch>_<objective> (letters, digits and ._+=- only)",
    )
    p.add_argument("--seed", type=int, help="sampler seed (give parallel workers different seeds)")
    p.add_argument(
        "--top-k", type=positive_int_arg, default=5, help="distinct strategies to keep (default 5)"
    )
    p.add_argument("--out", help="output folder (default results/<study name>/)")
    p.add_argument(
        "--no-recipes", action="store_true", help="do not enqueue the usual recipes first"
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--config",
        metavar="FILE.yaml",
        help="read the flags from a YAML file (keys as the flags; flags given here override "
        "it); a study.yaml written by tune reproduces that run",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the space size, its layouts and the expected search time, then stop "
        "(runs a few trials in memory to time them; writes nothing)",
    )
    p.set_defaults(func=run, read_config=read_config)


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


def read_config(path: str, parser: argparse.ArgumentParser) -> dict:
    """Defaults from --config: a YAML of flags, or a study.yaml (its `config` block; a study.yaml
    written by the Python API has none, and is read from the fields it records)."""
    from autosearch.commands._common import config_defaults
    from autosearch.core._io import read_yaml_mapping

    what = f"--config {path!r}"
    data = read_yaml_mapping(check_text(path, "--config"), what="config")
    if isinstance(data.get("config"), dict):
        data = data["config"]
    elif "model_spec" in data and "signature" in data:
        data = {
            "model": data["model_spec"],
            "cluster": data.get("cluster_spec"),
            "global_batch_size": data.get("global_batch_size"),
            "objective": data.get("objective"),
            "runtime": data.get("runtime"),
            "trial_unit": data.get("trial_unit"),
            "sampler": data.get("sampler"),
            "seed": data.get("seed"),
            "n_trials": data.get("n_trials_target"),
            "study_name": data.get("study_name"),
            "price_per_gpu_hour": data.get("price_per_gpu_hour"),
        }
    return config_defaults(data, parser, what=what)


def run(args: argparse.Namespace) -> int:
    from autosearch.commands._common import load_model_cluster
    from autosearch.tuning import NoFeasibleStrategyError, default_study_name, tune
    from search_spaces import SearchSpace

    missing = [f"--{k.replace('_', '-')}" for k in REQUIRED if getattr(args, k) is None]
    if missing:
        raise SpecError(
            f"tune needs {', '.join(missing)}: give the flag(s), or the key(s) in a --config file"
        )
    model, cluster = load_model_cluster(args)
    if args.storage is not None:
        check_storage(args.storage)
    if args.study_name is not None and not STUDY_NAME.fullmatch(args.study_name):
        raise SpecError(
            f"--study-name {args.study_name!r} is not a plain name: use letters, digits and "
            "._+=- (no / or leading dot; at most 200 characters), since it names a folder"
        )
    space = SearchSpace(
        model,
        cluster,
        global_batch_size=args.global_batch_size,
        config=args.space,
        **parse_pins(args.pin),
    )
    objective = args.objective
    name = args.study_name or default_study_name(
        model.name, cluster.name, args.global_batch_size, objective
    )
    out = os.path.join("results", name) if args.out is None else args.out
    if args.dry_run:
        print(dry_run(args, model, cluster, space, objective, name, out))
        return 0
    check_output_folder(out, files=OUTPUT_FILES)
    check_other_study(out, name)
    if not args.quiet:
        print(f"searching {space.describe()}")
    quiet_interrupted_trials()
    kwargs = dict(
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
    try:
        result = tune(model, cluster, **kwargs)
    except NoFeasibleStrategyError:
        record_config(out, config_record(args, model, cluster, name, out))
        print(f"trials and the report are in {out}/")
        raise
    except Exception as exc:
        _raise_storage_error(exc, args.storage or os.path.join(out, "study.journal"))
        raise
    record_config(out, config_record(args, model, cluster, name, out))
    if result.best_strategy is not None:
        # What each runtime takes, next to best_strategy.yaml (autosearch.export.write_exports).
        from autosearch.export import write_exports

        write_exports(out, result.best_strategy, model=model, cluster=cluster)
    print(summary(result))
    return 0


def _raise_storage_error(exc: Exception, storage: str) -> None:
    """A database that cannot be reached or read is the user's to fix: one message, exit 2."""
    try:
        from sqlalchemy.exc import OperationalError
    except ImportError:  # pragma: no cover - sqlalchemy comes with optuna
        return
    if isinstance(exc, OperationalError):
        from sqlalchemy.engine import make_url

        shown = storage
        if "://" in storage:
            try:
                shown = make_url(storage).render_as_string(hide_password=True)
            except Exception:  # noqa: BLE001 - only for the message
                shown = storage.split("://", 1)[0] + "://..."
        first = str(exc.orig or exc).strip().splitlines()[0]
        raise SpecError(
            f"--storage {shown!r}: cannot connect to or read the database ({first}); "
            "check the URL, that the server runs, and the credentials"
        ) from None


def config_record(args: argparse.Namespace, model, cluster, name: str, out: str) -> dict:
    """The settings of this run as a --config mapping that does not depend on the current
    folder: models and clusters from files are written out, paths made absolute."""
    from autosearch.core.model_spec import model_catalog

    record: dict = {}
    for key, value in vars(args).items():
        if key in NOT_RECORDED or key.startswith("_") or callable(value) or value is None:
            continue
        if key in ("command", "nnodes", "gpus_per_node"):
            continue
        record[key] = value
    record["model"] = (
        model.name
        if model.name in model_catalog() and (model == model_catalog()[model.name])
        else model.to_dict()
    )
    gpu_is_file = os.path.exists(cluster.gpu) and not os.path.isdir(cluster.gpu)
    record["cluster"] = (
        {**cluster.to_dict(), "gpu": os.path.abspath(cluster.gpu)} if gpu_is_file else cluster.name
    )
    if isinstance(record.get("space"), str) and os.path.exists(record["space"]):
        record["space"] = os.path.abspath(record["space"])
    storage = record.get("storage")
    if isinstance(storage, str) and "://" not in storage:
        record["storage"] = os.path.abspath(storage)
    record["study_name"] = name
    record["out"] = os.path.abspath(out)
    if not record.get("pin"):
        record.pop("pin", None)
    return record


def record_config(out: str, record: dict) -> None:
    """Add the `config` block to OUT/study.yaml (under the outputs lock that tune's writers
    take), so that `autosearch tune --config OUT/study.yaml` runs this search again."""
    import yaml

    from autosearch.core._files import atomic_write
    from autosearch.core._io import read_yaml_mapping
    from autosearch.tuning._outputs import outputs_lock

    path = os.path.join(out, "study.yaml")
    with outputs_lock(out):
        if not os.path.isfile(path):
            return
        doc = read_yaml_mapping(path, what="study record")
        doc["config"] = record
        atomic_write(path, yaml.safe_dump(doc, sort_keys=False))


def dry_run(args, model, cluster, space, objective: str, name: str, out: str) -> str:
    """What `tune` would do: the space, its layouts, the sampler, and the time it would take,
    measured by running a few trials in memory (nothing is written)."""
    import time

    from autosearch.tuning import NoFeasibleStrategyError, tune
    from autosearch.tuning._objectives import make_objective

    multi = make_objective(
        objective, cluster=cluster, price_per_gpu_hour=args.price_per_gpu_hour
    ).is_multi
    unit = args.trial_unit or ("strategy" if multi else "layout")
    n_units = space.n_groups if unit == "layout" else space.size
    # Time a few trials in memory with the sampler the search would most likely use.
    probe_sampler = args.sampler or ("nsga2" if multi else "tpe")
    k = min(DRY_RUN_TRIALS, n_units)
    t0 = time.perf_counter()
    try:
        tune(
            model,
            cluster,
            global_batch_size=args.global_batch_size,
            space=space,
            objective=objective,
            n_trials=k,
            sampler=probe_sampler,
            seed=args.seed,
            runtime=args.runtime,
            price_per_gpu_hour=args.price_per_gpu_hour,
            trial_unit=unit,
            use_recipes=False,
            top_k=1,
        )
    except NoFeasibleStrategyError:
        pass
    per_trial = (time.perf_counter() - t0) / k
    n_trials = args.n_trials
    if n_trials is None:  # tune's default: every unit when that is quick, else 200
        n_trials = n_units if n_units * per_trial < DEFAULT_BUDGET_S else DEFAULT_N_TRIALS
    if args.sampler is not None:
        sampler = args.sampler
    elif n_units <= n_trials and not multi:
        sampler = "exhaustive"
    else:
        sampler = "nsga2" if multi else "tpe"
    target = min(n_trials, n_units) if sampler == "exhaustive" else n_trials
    done = _finished_trials(out, name)
    todo = max(0, target - done)
    from search_spaces import LAYOUT_FIELDS

    layouts = list(space.layouts()) if hasattr(space, "layouts") else []
    units = "layouts" if unit == "layout" else "strategies"
    lines = [
        "dry run: nothing is searched or written",
        f"space      {space.describe() if hasattr(space, 'describe') else space.size}",
        f"study      {name} in {out}/ ({done} finished trials there)",
        f"trials     {target} {units} with the {sampler} sampler ({todo} to run; "
        f"{n_units:,} {units} in the space)",
        f"layouts    {len(layouts)} ({', '.join(LAYOUT_FIELDS)}):",
    ]
    shown = 12
    for layout in layouts[:shown]:
        lines.append(f"           {layout.label()}")
    if len(layouts) > shown:
        lines.append(f"           ... and {len(layouts) - shown} more")
    lines.append(
        f"expected   about {todo * per_trial:,.1f} s of search for {todo} trials "
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
            f"          {r.tokens_per_s:,.0f} tokens/s, step {fmt_s(r.step_time_s)}, "
            f"MFU {r.mfu:.1%}, "
            f"memory {fmt_bytes(r.peak_memory_bytes)} of {fmt_bytes(r.memory_capacity_bytes)}",
        ]
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
    if result.pareto:
        n = len(result.pareto)
        lines.append(f"Pareto front: {n} strateg{'y' if n == 1 else 'ies'} (pareto.csv)")
    if result.out_dir:
        lines.append(
            f"wrote {result.out_dir}/: trials.csv top_k.csv best_strategy.yaml report.md, and "
            "for other runtimes megatron.sh ds_config.json deepspeed_launch.sh torchtitan.toml"
        )
    return "\n".join(lines)


def check_storage(text: str) -> None:
    """Refuse, before any work, a storage URL whose scheme or database driver is unknown."""
    text = check_text(text, "--storage")
    if "://" not in text:
        return
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    try:
        url = make_url(text)
    except ArgumentError:
        raise SpecError(
            f"--storage {text!r} is not a database URL (e.g. postgresql+psycopg://user:password"
            "@host/dbname or sqlite:///study.db)"
        ) from None
    try:
        dialect = url.get_dialect()
    except NoSuchModuleError:
        raise SpecError(
            f"--storage {text!r}: unknown storage scheme {url.drivername!r}; use a journal file "
            "(study.journal), SQLite (study.db or sqlite:///study.db) or a database URL such as "
            "postgresql+psycopg://user:password@host/dbname"
        ) from None
    try:
        dialect.import_dbapi()
    except ImportError as exc:
        backend = url.get_backend_name()
        fix = DRIVERS.get(backend, f"install the Python driver {exc.name or url.drivername!r}")
        raise SpecError(
            f"--storage {url.render_as_string(hide_password=True)!r}: the {backend} driver "
            f"{exc.name or url.drivername!r} is not installed; {fix}"
        ) from None


def check_other_study(out: str, study_name: str) -> None:
    """Refuse an --out folder that holds the outputs of another study (they would be replaced)."""
    from autosearch.core._io import read_yaml_mapping

    path = os.path.join(out, "study.yaml")
    if not os.path.isfile(path):
        return
    try:
        other = read_yaml_mapping(path, what="study record").get("study_name")
    except SpecError:
        other = None
    if other is None:
        raise SpecError(
            f"--out {out!r} holds a study.yaml that is not readable; give another --out "
            "(or remove the folder if its study is not needed)"
        )
    if other != study_name:
        raise SpecError(
            f"--out {out!r} holds the outputs of another study ({other!r}); this one is "
            f"{study_name!r}: give another --out (or leave it out: the default is "
            f"results/<study name>), or --study-name {other} to resume that study"
        )
