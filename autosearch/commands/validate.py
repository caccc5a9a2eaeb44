"""`autosearch validate`: run the top candidates of a study (or strategy files) for real."""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

from autosearch.commands._common import check_text, fmt_bytes, fmt_s, load_cluster, load_model
from autosearch.commands._schema import add_flags, read_args
from autosearch.validation._config import SLURM_FIELDS, ValidateConfig

EPILOG = """\
examples:
  autosearch tune --model tiny-gpt --cluster results/calibration/cpu-local.yaml:1x2 \
      --global-batch-size 16 --out results/tiny
  autosearch validate --study results/tiny --top-k 3 --steps 10
  autosearch validate --strategies a.yaml b.yaml --model tiny-gpt \
      --cluster results/calibration/cpu-local.yaml:1x2

Each candidate runs under torchrun with as many processes as its strategy needs, on this machine.
A run that runs out of memory, crashes (a signal such as SIGSEGV is named) or outlives
--timeout-s is recorded as failed with the reason; the others still run. validation.csv is
rewritten after every run. On CPU, candidates with more than 4 processes per core, or needing
more memory than the machine has (by the cost model's estimate), are refused unless --force.
Stopping validate (Ctrl-C, SIGTERM, even SIGKILL) stops torchrun and every worker it started.

Before the runs, validate reads this machine's load (the CPU time other processes take over one
second, and the load average). A loaded machine is warned about, not refused: on CPU each run
gets the threads per process that fit in the cores left free, and validation.csv records the load
before and during every run (other_busy_cores, under_load); the table marks the errors of runs
taken under load with *. --config FILE.yaml takes the flags' names as keys.

On a SLURM cluster (--launcher slurm), each candidate is a batch job at its real scale: as many
nodes as its dp*tp*pp fills at the cluster's GPUs per node, one torchrun per node through srun
(c10d rendezvous on the first node), a time limit of --timeout-s plus 2 minutes. The output
folder must be on a file system every node sees. A job still pending after
--slurm-pending-timeout-s is cancelled and recorded as "pending"; Ctrl-C cancels the job in
flight (squeue no longer lists it when validate exits):
  autosearch validate --study results/llama70b --launcher slurm --slurm-partition gpu \
      --slurm-account my-project --timeout-s 900
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "validate",
        help="run top candidates for a few real steps; measured vs predicted",
        description="Run candidate strategies with the Engine for a few steps and record measured "
        "step time and peak memory next to the cost model's predictions, with the load the "
        "machine was under.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    main = [f.name for f in dataclasses.fields(ValidateConfig) if f.name not in SLURM_FIELDS]
    add_flags(p, ValidateConfig, only=main)
    add_flags(p.add_argument_group("SLURM (--launcher slurm)"), ValidateConfig, only=SLURM_FIELDS)
    p.add_argument(
        "--config",
        metavar="FILE.yaml",
        help="read the settings from a YAML file (keys as the flags; flags given here override "
        "it)",
    )
    p.set_defaults(func=run)


def config_from(args: argparse.Namespace) -> ValidateConfig:
    """The ValidateConfig of a command line: the --config file's settings, overridden by the
    flags given."""
    from autosearch.core._io import read_yaml_mapping

    data = None
    if args.config is not None:
        data = read_yaml_mapping(check_text(args.config, "--config"), what="config")
    values, _ = read_args(args, [ValidateConfig], data=data, what=f"--config {args.config!r}")
    return ValidateConfig(**values)


def run(args: argparse.Namespace) -> int:
    from autosearch.core.errors import SpecError
    from autosearch.core.strategy import Strategy
    from autosearch.tuning import Candidate
    from autosearch.validation import validate

    config = config_from(args)
    cluster: Any = config.cluster
    if config.nnodes is not None or config.gpus_per_node is not None:
        cluster = load_cluster(cluster, nnodes=config.nnodes, gpus_per_node=config.gpus_per_node)
    study = None
    if config.study:
        from autosearch.tuning import load_study
        from autosearch.validation import candidates_from_study

        loaded = load_study(config.study, storage=config.storage)
        study, meta = loaded.study, loaded.meta

        candidates = candidates_from_study(study, top_k=config.top_k)
        if not candidates:
            raise SpecError(
                f"study {study.study_name!r} has no completed trial that fits in memory; "
                "nothing to validate"
            )
        model = _model(config.model) if config.model else meta.load_model()
        cluster = cluster or meta.load_cluster()
        runtime = config.runtime or meta.runtime
        out = config.out or (
            os.path.join(config.study, "validation")
            if os.path.isdir(config.study)
            else "results/validation"
        )
    else:
        model = _model(config.model)
        candidates = [Candidate(Strategy.from_yaml(path)) for path in config.strategies or ()]
        runtime = config.runtime
        out = config.out or "results/validation"
    slurm = None
    if config.launcher == "slurm":
        from autosearch.validation._slurm import SlurmOptions

        slurm = SlurmOptions(
            partition=config.slurm_partition,
            account=config.slurm_account,
            qos=config.slurm_qos,
            pending_timeout_s=config.slurm_pending_timeout_s,
            cpus_per_task=config.slurm_cpus_per_task,
            gpus=False if config.slurm_cpu else None,
            sbatch_args=tuple(config.sbatch_arg),
        )
    result = validate(
        model,
        candidates,
        cluster=cluster,
        steps=config.steps,
        warmup=config.warmup,
        timeout_s=config.timeout_s,
        out=out,
        memory_limit_bytes=config.memory_limit_bytes(),
        factory=config.factory,
        threads=config.threads,
        study=study,
        runtime=runtime,
        force=config.force,
        launcher=config.launcher,
        slurm=slurm,
    )
    print(summary(result, out))
    if result.best is not None:
        path = os.path.join(out, "best_measured_strategy.yaml")
        result.best.strategy.to_yaml(
            path, comment=f"fastest measured by `autosearch validate` ({model.name})"
        )
        print(f"wrote {path}")
    return 0 if result.best is not None else 1


def _model(value: Any):
    """The ModelSpec of --model (a ModelSpec from Python, a name, a file or a mapping)."""
    from autosearch.core.model_spec import ModelSpec

    return value if isinstance(value, ModelSpec) else load_model(value)


def summary(result, out: str) -> str:
    """The table of runs, measured next to predicted; a run taken under load is marked (its
    error is the load's as much as the model's) and its load shown."""
    lines = [
        f"{'strategy':<44} {'status':<8} {'measured':>10} {'predicted':>10} {'error':>7} "
        f"{'memory':>11} {'predicted':>11} {'load':>8}"
    ]
    loaded = 0
    for _, r in result.table.iterrows():
        if r.status == "ok":
            pred = r.get("predicted_step_time_s")
            err = r.get("step_time_error_pct")
            has_pred = pred is not None and pred == pred
            under = bool(r.get("under_load", False))
            loaded += under
            busy, cores = r.get("other_busy_cores"), r.get("cores")
            load = f"{busy:.1f}/{cores:.0f}" if busy == busy and busy is not None else "-"
            error = f"{err:+.0f}%{'*' if under else ''}" if has_pred else "-"
            lines.append(
                f"{r.strategy:<44} {r.status:<8} {fmt_s(r.measured_step_time_s):>10} "
                f"{fmt_s(pred) if has_pred else '-':>10} {error:>7} "
                f"{fmt_bytes(r.measured_peak_memory_bytes):>11} "
                f"{fmt_bytes(r.predicted_peak_memory_bytes) if has_pred else '-':>11} {load:>8}"
            )
        else:
            lines.append(f"{r.strategy:<44} {r.status:<8} {r.reason}")
    if loaded:
        lines.append(
            f"* {loaded} run(s) under load (load: cores other processes kept busy / cores, "
            "during the run): their measured time is the load's as much as the model's; "
            "validate again on a quiet machine to measure the model"
        )
    if result.best is not None:
        lines.append(
            f"best measured: {result.best.strategy.short()} "
            f"({result.best_row['measured_tokens_per_s']:,.0f} tokens/s)"
        )
    else:
        lines.append("no candidate ran successfully")
    lines.append(f"wrote {os.path.join(out, 'validation.csv')}")
    return "\n".join(lines)
