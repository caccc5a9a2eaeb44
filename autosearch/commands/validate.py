"""`autosearch validate`: run the top candidates of a study (or strategy files) for real."""

from __future__ import annotations

import argparse
import os

from autosearch.commands._common import fmt_bytes, fmt_s, positive_int_arg

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
        "step time and peak memory next to the cost model's predictions.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--study",
        help="a tuner output folder (holding study.journal), or a study name with --storage",
    )
    src.add_argument("--strategies", nargs="+", metavar="FILE", help="strategy YAML files")
    p.add_argument("--storage", help="Optuna storage of --study when it is a study name")
    p.add_argument("--model", help="model (catalog name or YAML); default: the study's")
    p.add_argument("--cluster", help="cluster the predictions are for; default: the study's")
    p.add_argument(
        "--runtime",
        default=None,
        help="cost-model runtime for candidates scored here (default torch)",
    )
    p.add_argument("--top-k", type=positive_int_arg, default=3)
    p.add_argument(
        "--steps", type=positive_int_arg, default=10, help="measured steps (median taken)"
    )
    p.add_argument("--warmup", type=int, default=3, help="steps before measuring")
    p.add_argument(
        "--timeout-s", type=float, default=600.0, help="a run not done by then is killed (a hang)"
    )
    p.add_argument(
        "--memory-limit-gib", type=float, help="emulate a smaller device: per-process memory cap"
    )
    p.add_argument(
        "--factory",
        help='"module:function" or "file.py:function" building the model from its '
        "ModelSpec (default: the reference transformer). This runs your code: it is imported "
        "once here (and checked) before any run, then on every rank of every run; give only "
        "code you trust",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="on CPU, run candidates even with more than 4 processes per core or more memory "
        "than this machine has available (by the cost model's estimate)",
    )
    p.add_argument(
        "--out", help="output folder (default: <study folder>/validation or results/validation)"
    )
    g = p.add_argument_group("SLURM (--launcher slurm)")
    g.add_argument(
        "--launcher",
        choices=("local", "slurm"),
        default="local",
        help="local: torchrun on this machine (default); slurm: one sbatch job per candidate "
        "at the cluster's nodes x GPUs per node",
    )
    g.add_argument("--slurm-partition", help="sbatch --partition")
    g.add_argument("--slurm-account", help="sbatch --account")
    g.add_argument("--slurm-qos", help="sbatch --qos")
    g.add_argument(
        "--slurm-pending-timeout-s",
        type=float,
        default=1800.0,
        help="cancel a job still pending after this long and record it as pending (default 1800)",
    )
    g.add_argument(
        "--slurm-cpus-per-task", type=positive_int_arg, help="sbatch --cpus-per-task (per node)"
    )
    g.add_argument(
        "--slurm-cpu",
        action="store_true",
        help="run the jobs on CPU (gloo) without asking for GPUs, whatever the cluster's profile",
    )
    g.add_argument(
        "--sbatch-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more sbatch argument, e.g. --sbatch-arg=--constraint=h100 (repeatable)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from autosearch.core.errors import SpecError
    from autosearch.core.model_spec import ModelSpec
    from autosearch.core.strategy import Strategy
    from autosearch.tuning import Candidate
    from autosearch.validation import validate

    study = None
    if args.study:
        from autosearch.tuning import load_study
        from autosearch.validation import candidates_from_study

        loaded = load_study(args.study, storage=args.storage)
        study, meta = loaded.study, loaded.meta

        candidates = candidates_from_study(study, top_k=args.top_k)
        if not candidates:
            raise SpecError(
                f"study {study.study_name!r} has no completed trial that fits in memory; "
                "nothing to validate"
            )
        model = ModelSpec.load(args.model) if args.model else meta.load_model()
        cluster = args.cluster or meta.load_cluster()
        runtime = args.runtime or meta.runtime
        out = args.out or (
            os.path.join(args.study, "validation")
            if os.path.isdir(args.study)
            else "results/validation"
        )
    else:
        if not args.model:
            raise SpecError("--strategies needs --model (the model to train)")
        model = ModelSpec.load(args.model)
        candidates = [Candidate(Strategy.from_yaml(path)) for path in args.strategies]
        cluster, runtime = args.cluster, args.runtime
        out = args.out or "results/validation"
    limit = int(args.memory_limit_gib * 2**30) if args.memory_limit_gib else None
    slurm = None
    if args.launcher == "slurm":
        from autosearch.validation._slurm import SlurmOptions

        slurm = SlurmOptions(
            partition=args.slurm_partition,
            account=args.slurm_account,
            qos=args.slurm_qos,
            pending_timeout_s=args.slurm_pending_timeout_s,
            cpus_per_task=args.slurm_cpus_per_task,
            gpus=False if args.slurm_cpu else None,
            sbatch_args=tuple(args.sbatch_arg),
        )
    result = validate(
        model,
        candidates,
        cluster=cluster,
        steps=args.steps,
        warmup=args.warmup,
        timeout_s=args.timeout_s,
        out=out,
        memory_limit_bytes=limit,
        factory=args.factory,
        study=study,
        runtime=runtime,
        force=args.force,
        launcher=args.launcher,
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


def summary(result, out: str) -> str:
    lines = [
        f"{'strategy':<44} {'status':<8} {'measured':>10} {'predicted':>10} {'error':>7} "
        f"{'memory':>11} {'predicted':>11}"
    ]
    for _, r in result.table.iterrows():
        if r.status == "ok":
            pred = r.get("predicted_step_time_s")
            err = r.get("step_time_error_pct")
            has_pred = pred is not None and pred == pred
            lines.append(
                f"{r.strategy:<44} {r.status:<8} {fmt_s(r.measured_step_time_s):>10} "
                f"{fmt_s(pred) if has_pred else '-':>10} {f'{err:+.0f}%' if has_pred else '-':>7} "
                f"{fmt_bytes(r.measured_peak_memory_bytes):>11} "
                f"{fmt_bytes(r.predicted_peak_memory_bytes) if has_pred else '-':>11}"
            )
        else:
            lines.append(f"{r.strategy:<44} {r.status:<8} {r.reason}")
    if result.best is not None:
        lines.append(
            f"best measured: {result.best.strategy.short()} "
            f"({result.best_row['measured_tokens_per_s']:,.0f} tokens/s)"
        )
    else:
        lines.append("no candidate ran successfully")
    lines.append(f"wrote {os.path.join(out, 'validation.csv')}")
    return "\n".join(lines)
