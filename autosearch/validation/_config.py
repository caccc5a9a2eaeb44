"""`ValidateConfig`: every setting of ``autosearch validate``, declared once.

As `TuneConfig` does for ``autosearch tune``, each field carries its `Setting` (help text, flag,
reader), from which the command's flags and its ``--config`` file keys are derived
(`autosearch.commands._schema`). The model, the cluster and the runtime are TuneConfig's own
fields (`shared_setting`): one reader and one help text for both commands. Torch-free.

Example:
    >>> from autosearch.validation._config import ValidateConfig
    >>> ValidateConfig(study="results/tiny", top_k=2).steps
    10
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autosearch.core.errors import SpecError
from autosearch.core.schema import (
    Schema,
    read_choice,
    read_count,
    read_integer,
    read_positive,
    read_switch,
    read_text,
    setting,
    shared_setting,
)
from autosearch.tuning._config import TuneConfig

if TYPE_CHECKING:  # pragma: no cover
    from autosearch.core.hardware import Cluster
    from autosearch.core.model_spec import ModelSpec

LAUNCHERS = ("local", "slurm")
# The SLURM fields, shown under their own heading in ``--help``.
SLURM_FIELDS = (
    "launcher",
    "slurm_partition",
    "slurm_account",
    "slurm_qos",
    "slurm_pending_timeout_s",
    "slurm_cpus_per_task",
    "slurm_cpu",
    "sbatch_arg",
)


def read_texts(value: Any, where: str) -> tuple[str, ...]:
    """Texts (file names, arguments): a list, or one text."""
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, (list, tuple)):
        raise SpecError(f"{where} must be a list of texts, got {value!r}")
    return tuple(read_text(v, where) for v in values)


def read_steps_before(value: Any, where: str) -> int:
    return read_integer(value, where, 0, 1_000_000)


@dataclass(frozen=True, kw_only=True)
class ValidateConfig(Schema):
    """Every setting of ``autosearch validate``: which candidates (a study's best, or strategy
    files), how each runs (steps, timeout, threads, a smaller device), where (this machine, or
    SLURM) and where the results go. A frozen record; `validate` is called from it."""

    study: str | None = setting(
        None,
        read=read_text,
        help="a tuner output folder (holding study.journal), or a study name with --storage",
    )
    strategies: tuple[str, ...] | None = setting(
        None, read=read_texts, nargs="+", metavar="FILE", help="strategy YAML files"
    )
    storage: str | None = setting(
        None, read=read_text, help="Optuna storage of --study when it is a study name"
    )
    model: "ModelSpec | dict | str | None" = shared_setting(
        TuneConfig, "model", note="default: the study's (needed with --strategies)"
    )
    cluster: "Cluster | dict | str | None" = shared_setting(
        TuneConfig,
        "cluster",
        note="the cluster the predictions are for (default: the study's; with --strategies, "
        "none: no prediction)",
    )
    nnodes: int | None = shared_setting(TuneConfig, "nnodes")
    gpus_per_node: int | None = shared_setting(TuneConfig, "gpus_per_node")
    runtime: str | None = shared_setting(
        TuneConfig, "runtime", note="for candidates scored here (default: the study's)"
    )
    top_k: int = setting(
        3,
        read=read_count,
        help="candidates of the study to run, one per kind of strategy first (default 3)",
    )
    steps: int = setting(10, read=read_count, help="measured steps (median taken; default 10)")
    warmup: int = setting(3, read=read_steps_before, help="steps before measuring (default 3)")
    timeout_s: float = setting(
        600.0,
        read=read_positive("seconds", "600"),
        metavar="SECONDS",
        help="a run not done by then is killed (a hang; default 600)",
    )
    memory_limit_gib: float | None = setting(
        None,
        read=read_positive("GiB", "8"),
        help="emulate a smaller device: per-process memory cap",
    )
    threads: int | None = setting(
        None,
        read=read_count,
        help="intra-op threads per process on CPU (default: the cores other processes leave "
        "free, divided by the processes; validate reads the load first and records it)",
    )
    factory: str | None = setting(
        None,
        read=read_text,
        help='"module:function" or "file.py:function" building the model from its '
        "ModelSpec (default: the reference transformer). This runs your code: it is imported "
        "once here (and checked) before any run, then on every rank of every run; give only "
        "code you trust",
    )
    force: bool = setting(
        False,
        read=read_switch,
        switch=True,
        help="on CPU, run candidates even with more than 4 processes per core or more memory "
        "than this machine has available (by the cost model's estimate)",
    )
    out: str | None = setting(
        None,
        read=read_text,
        help="output folder (default: <study folder>/validation or results/validation)",
    )
    launcher: str = setting(
        "local",
        read=read_choice("launcher", LAUNCHERS),
        choices=LAUNCHERS,
        help="local: torchrun on this machine (default); slurm: one sbatch job per candidate "
        "at the cluster's nodes x GPUs per node",
    )
    slurm_partition: str | None = setting(None, read=read_text, help="sbatch --partition")
    slurm_account: str | None = setting(None, read=read_text, help="sbatch --account")
    slurm_qos: str | None = setting(None, read=read_text, help="sbatch --qos")
    slurm_pending_timeout_s: float = setting(
        1800.0,
        read=read_positive("seconds", "1800"),
        metavar="SECONDS",
        help="cancel a job still pending after this long and record it as pending (default 1800)",
    )
    slurm_cpus_per_task: int | None = setting(
        None, read=read_count, help="sbatch --cpus-per-task (per node)"
    )
    slurm_cpu: bool = setting(
        False,
        read=read_switch,
        switch=True,
        help="run the jobs on CPU (gloo) without asking for GPUs, whatever the cluster's profile",
    )
    sbatch_arg: tuple[str, ...] = setting(
        (),
        read=read_texts,
        repeat=True,
        metavar="ARG",
        help="one more sbatch argument, e.g. --sbatch-arg=--constraint=h100 (repeatable)",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if (self.study is None) == (self.strategies is None):
            raise SpecError(
                "validate needs --study or --strategies (one of them): the candidates are a "
                "study's best, or strategy files"
                if self.study is None
                else "give --study or --strategies, not both"
            )
        if self.strategies is not None and self.model is None:
            raise SpecError("--strategies needs --model (the model to train)")

    def memory_limit_bytes(self) -> int | None:
        """`memory_limit_gib` in bytes (what `validate` takes)."""
        return int(self.memory_limit_gib * 2**30) if self.memory_limit_gib else None
