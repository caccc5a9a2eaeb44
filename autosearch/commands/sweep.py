"""`autosearch sweep`: what `tune` picks for every model x cluster x batch size, in one CSV.

The flags are derived from two schemas: `SweepConfig` (the combinations, prices, the token
target, processes, the CSV) and the `TuneConfig` settings every combination shares (the flags
of `autosearch tune` of the same names); a ``--config`` file gives the same keys. The sweep
itself (`autosearch.tuning._sweep`) runs each combination as `autosearch tune` runs it.
"""

from __future__ import annotations

import argparse
import sys

from autosearch.commands._common import (
    check_text,
    load_cluster,
    load_model,
    quiet_interrupted_trials,
)
from autosearch.commands._schema import add_flags, add_presentation_flags, read_args
from autosearch.core.errors import SpecError
from autosearch.core.schema import flag_of, required

PRESENTATION = {"quiet": "no progress lines on stderr"}


def register(sub: argparse._SubParsersAction) -> None:
    from autosearch.tuning._config import TuneConfig
    from autosearch.tuning._sweep import SHARED, SweepConfig

    p = sub.add_parser(
        "sweep",
        help="what tune picks for many models x clusters x batch sizes, in one CSV and a report",
        description="Run `autosearch tune`'s search for every combination of models, clusters "
        "and global batch sizes, in parallel processes, and write one CSV row per combination "
        "(its pick, figures and error band), the capacity answers (with --tokens, "
        "--deadline-days and prices) and a report with plots. The same command again continues "
        "an interrupted sweep.",
    )
    own = [n for n in SweepConfig.__dataclass_fields__ if n != "settings"]
    add_flags(p, SweepConfig, only=own)
    group = p.add_argument_group("the tune settings every combination shares")
    add_flags(group, TuneConfig, only=SHARED)  # type: ignore[arg-type]
    add_presentation_flags(p, PRESENTATION)
    p.add_argument(
        "--config",
        metavar="FILE.yaml",
        help="read the settings from a YAML file (keys as the flags; flags given override it)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from autosearch.core._io import read_yaml_mapping
    from autosearch.tuning._config import TuneConfig
    from autosearch.tuning._sweep import SweepConfig, plan_cases, sweep
    from autosearch.tuning._sweep_report import capacity_lines

    data = None
    if args.config is not None:
        data = read_yaml_mapping(check_text(args.config, "--config"), what="config")
    values, shown = read_args(
        args,
        [TuneConfig, SweepConfig],
        data=data,
        what=f"--config {args.config!r}",
        presentation=PRESENTATION,
    )
    sweep_fields = SweepConfig.__dataclass_fields__
    missing = [flag_of(f) for f in sweep_fields.values() if required(f) and f.name not in values]
    if missing:
        raise SpecError(
            f"sweep needs {', '.join(missing)}: give the flag(s), or the key(s) in a --config file"
        )
    settings = {k: v for k, v in values.items() if k not in sweep_fields}
    config = SweepConfig(
        **{k: v for k, v in values.items() if k in sweep_fields}, settings=settings
    )
    cases = plan_cases(
        config,
        load_model=lambda m, **kw: load_model(m, flag="--models", **kw),
        load_cluster=lambda c: load_cluster(c, flag="--clusters"),
    )
    quiet_interrupted_trials()
    log = None if shown["quiet"] else (lambda line: print(line, file=sys.stderr, flush=True))
    result = sweep(config, cases=cases, log=log)
    for line in capacity_lines(result.answers, config):
        print(line)
    print(
        f"wrote {result.out} ({len(result.rows)} rows, {result.computed} computed now in "
        f"{result.wall_s:.1f} s with {result.jobs} process(es))"
        + (f" and {result.report}" if result.report else "")
    )
    return 0
