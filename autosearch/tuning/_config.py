"""`TuneConfig`: every setting of a tuning job, declared once (torchtitan's JobConfig shape).

Each field carries its metadata (`Setting`: the help text, the flag, how a value is read and
checked), from which the rest is derived: the flags of `autosearch tune`, the keys of its
``--config`` file, and the ``config`` block of ``study.yaml``, which is `TuneConfig.to_dict()`
and reads back with `TuneConfig.from_dict`. A value is checked where it enters (a flag, a file
key, a Python keyword), and a message names it in the words of that entry.

Example:
    >>> from autosearch import TuneConfig
    >>> config = TuneConfig(model="llama3-8b", cluster="h100-sxm:8x8", global_batch_size=512)
    >>> TuneConfig.from_dict(config.to_dict()) == config
    True
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from autosearch.core.errors import SpecError

if TYPE_CHECKING:  # pragma: no cover
    from autosearch.core.hardware import Cluster
    from autosearch.core.model_spec import ModelSpec

SAMPLERS = ("tpe", "nsga2", "random", "exhaustive")
TRIAL_UNITS = ("layout", "strategy")
OBJECTIVES = ("throughput", "throughput-pessimistic", "throughput-memory", "throughput-cost")
OBJECTIVE_ALIASES = {"memory": "throughput-memory", "cost": "throughput-cost"}
STUDY_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+=-]{0,199}")
MAX_SEED = 2**32 - 1  # numpy's RandomState, which Optuna's samplers seed, takes 0 .. 2**32 - 1


# ---- how one value is read and checked ----------------------------------------------------------
def _single(value: Any, where: str) -> Any:
    if isinstance(value, (dict, list, tuple, set)):
        raise SpecError(f"{where} must be a single value, got a {type(value).__name__}")
    return value


def _text(value: Any, where: str) -> str:
    value = _single(value, where)
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value.strip():
        raise SpecError(f"{where} must be a non-empty text, got {value!r}")
    return value.strip()


def _integer(value: Any, where: str, low: int, high: int) -> int:
    value = _single(value, where)
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise SpecError(f"{where}: {value!r} is not an integer") from None
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{where} must be an integer, got {value!r}")
    if value < low:
        kind = "a positive integer (>= 1)" if low == 1 else f"an integer >= {low}"
        raise SpecError(f"{where} must be {kind}, got {value}")
    if value > high:
        raise SpecError(f"{where} = {value:,} is above the limit of {high:,}; check the number")
    return value


def _count(value: Any, where: str) -> int:
    from autosearch.core._io import DEFAULT_INT_LIMIT

    return _integer(value, where, 1, DEFAULT_INT_LIMIT)


def _batch(value: Any, where: str) -> int:
    from autosearch.core._io import INT_LIMITS

    return _integer(value, where, 1, INT_LIMITS["global_batch_size"])


def _seed(value: Any, where: str) -> int:
    return _integer(value, where, 0, MAX_SEED)


def _price(value: Any, where: str) -> float:
    value = _single(value, where)
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise SpecError(f"{where}: {value!r} is not a number") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpecError(f"{where} must be a number, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise SpecError(
            f"{where} must be a finite number of dollars per device-hour > 0, got {value!r} "
            "(e.g. 2.5)"
        )
    return float(value)


def _seq_len(value: Any, where: str) -> int:
    from autosearch.core._io import INT_LIMITS

    return _integer(value, where, 1, INT_LIMITS["seq_len"])


def _seconds(value: Any, where: str) -> float:
    """A wall-clock budget in seconds (0: no limit)."""
    value = _single(value, where)
    if isinstance(value, str):
        try:
            value = float(value.strip().removesuffix("s"))
        except ValueError:
            raise SpecError(f"{where}: {value!r} is not a number of seconds (e.g. 10)") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpecError(f"{where} must be a number of seconds, got {value!r}")
    if not (math.isfinite(value) and value >= 0):
        raise SpecError(f"{where} must be a number of seconds >= 0 (0: no limit), got {value!r}")
    return float(value)


def _margin(value: Any, where: str) -> float:
    """A fraction of device memory held back: 0.1, or ``10%``."""
    value = _single(value, where)
    text = value.strip() if isinstance(value, str) else None
    if text is not None:
        try:
            value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
        except ValueError:
            raise SpecError(
                f"{where}: {text!r} is not a fraction of device memory; give e.g. 0.1 or 10%"
            ) from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpecError(f"{where} must be a fraction of device memory (e.g. 0.1), got {value!r}")
    if not (math.isfinite(value) and 0 <= value < 0.9):
        raise SpecError(
            f"{where} must be a fraction of device memory from 0 to 0.9 (0.1 holds back 10%; 0 "
            f"fits up to the capacity), got {value!r}"
        )
    return float(value)


def _lora_rank(value: Any, where: str) -> int:
    return _integer(value, where, 1, 1 << 20)


def _lora_targets(value: Any, where: str) -> str:
    """LoRA targets as one comma-separated text (``q,v`` or ``attention``), from a text or a
    list; each name is checked (`autosearch.core._lora.resolve_targets`)."""
    from autosearch.core._lora import resolve_targets

    if isinstance(value, (list, tuple)):
        value = ",".join(str(v) for v in value)
    text = _text(value, where)
    problems: list[str] = []
    resolve_targets(text, gated=True, problems=problems)
    if problems:
        raise SpecError(f"{where}: " + "; ".join(problems))
    return ",".join(t.strip() for t in text.split(",") if t.strip())


def lora_of(rank: int | None, targets: str | None, *, where: str = "--lora-targets"):
    """The `ModelSpec.load` ``lora`` argument of ``--lora-rank`` / ``--lora-targets``: None
    without a rank (targets alone are refused: they need a rank)."""
    if rank is None:
        if targets is not None:
            raise SpecError(f"{where} {targets!r} needs a rank: add --lora-rank (e.g. 16)")
        return None
    return {"rank": rank, **({"targets": targets} if targets is not None else {})}


def _switch(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise SpecError(f"{where} must be true or false, got {value!r}")
    return value


def _choice(noun: str, choices: tuple[str, ...], aliases: Mapping[str, str] | None = None):
    def read(value: Any, where: str) -> str:
        text = _text(value, where)
        text = (aliases or {}).get(text, text)
        if text not in choices:
            raise SpecError(
                f"{where}: unknown {noun} {value!r}; choose one of {', '.join(choices)}"
            )
        return text

    return read


def _model(value: Any, where: str) -> "ModelSpec | dict | str":
    from autosearch.core.model_spec import ModelSpec

    if isinstance(value, (ModelSpec, Mapping)):
        return value if isinstance(value, ModelSpec) else dict(value)
    return _text(value, where)


def _cluster(value: Any, where: str) -> "Cluster | dict | str":
    from autosearch.core.hardware import Cluster

    if isinstance(value, (Cluster, Mapping)):
        return value if isinstance(value, Cluster) else dict(value)
    return _text(value, where)


def _study_name(value: Any, where: str) -> str:
    if not isinstance(value, str) or not STUDY_NAME_RE.fullmatch(value):
        raise SpecError(
            f"{where}: study name {value!r} is not allowed: use 1-200 letters, digits and "
            ". _ + = -, starting with a letter or digit (it names the study in its storage and "
            "the default output folder, so it may not hold a path)"
        )
    return value


def _pins(value: Any, where: str) -> dict[str, Any]:
    """Pins as ``{dimension: value or [values]}``, from a mapping or from ``KEY=VALUE`` texts
    (``tp=8``, ``zero_stage=0,1``: the `--pin` form); a dimension pinned twice is refused."""
    from autosearch.core.strategy import _parse_scalar

    def values_of(text: str) -> Any:
        parts = [_parse_scalar(v.strip()) for v in text.split(",") if v.strip()]
        return parts[0] if len(parts) == 1 else parts

    if isinstance(value, Mapping):
        items = [(str(k), values_of(v) if isinstance(v, str) else v) for k, v in value.items()]
    else:
        texts = [value] if isinstance(value, str) else value
        if not isinstance(texts, (list, tuple)):
            raise SpecError(f"{where} must be KEY=VALUE texts or a mapping, got {value!r}")
        items = []
        for text in texts:
            if not isinstance(text, str) or "=" not in text:
                raise SpecError(
                    f"{where} {text!r} is not KEY=VALUE (example: --pin tp=8 or "
                    "--pin zero_stage=0,1)"
                )
            key, rest = (x.strip() for x in text.split("=", 1))
            items.append((key, values_of(rest)))
    pins: dict[str, Any] = {}
    for key, v in items:
        v = list(v) if isinstance(v, tuple) else v
        if key in pins:
            raise SpecError(
                f"{where}: {key} is pinned twice ({pins[key]!r} and {v!r}); pin it once, with "
                f"every value it may take (e.g. --pin {key}=1,2)"
            )
        pins[key] = v
    return pins


# ---- the schema ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Setting:
    """The metadata of one TuneConfig field: what the CLI and the config file derive from it.

    Attributes:
        help: the flag's help text.
        read: ``(value, where) -> value``: reads a flag's text, a file's value or a Python value,
            and raises SpecError naming `where` when it is wrong.
        flag: the flag (default ``--`` + the field name with dashes).
        choices: the values a flag may take (listed in ``--help``).
        metavar: the flag's placeholder in ``--help``.
        repeat: the flag may be given several times (its values form a list).
        negate: the flag sets the field to False (``--no-recipes``).
        switch: the flag sets the field to True (``--fp8``).
    """

    help: str
    read: Callable[[Any, str], Any]
    flag: str | None = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    repeat: bool = False
    negate: bool = False
    switch: bool = False


def setting(default: Any = dataclasses.MISSING, **meta: Any) -> Any:
    """A dataclass field whose metadata is a `Setting`."""
    if isinstance(default, dict):
        return field(default_factory=dict, metadata={"setting": Setting(**meta)})
    return field(default=default, metadata={"setting": Setting(**meta)})


@dataclass(frozen=True, kw_only=True)
class TuneConfig:
    """Every setting of one tuning job. A frozen record: change it with `replace`.

    Each field says in its `Setting` how the CLI spells it, its help text
    (``autosearch tune --help``) and how a value is read and checked; the constructor checks
    every value, so a TuneConfig that exists is valid as far as its fields go (the model,
    cluster, space and storage they name are read by `autosearch.tune`).
    """

    model: "ModelSpec | dict | str" = setting(
        read=_model,
        help="catalog name (see `autosearch models`), a model YAML file, or a Hugging Face "
        "config.json or the model's folder holding one (required, here or in the config file)",
    )
    cluster: "Cluster | dict | str" = setting(
        read=_cluster,
        help="GPU:NODESxGPUS (e.g. h100-sxm:32x8), a GPU with --nnodes and --gpus-per-node, a "
        "cluster YAML file (gpu, n_nodes, gpus_per_node), or a profile YAML path[:NODESxGPUS]",
    )
    seq_len: int | None = setting(
        None,
        read=_seq_len,
        help="training sequence length in tokens, replacing the model's (a Hugging Face "
        "config.json gives its maximum positions, often far longer than one trains)",
    )
    lora_rank: int | None = setting(
        None,
        read=_lora_rank,
        help="fine-tune with LoRA adapters of this rank on a frozen model (frozen weights keep "
        "no gradient or optimizer state); replaces the model's lora",
    )
    lora_targets: str | None = setting(
        None,
        read=_lora_targets,
        metavar="NAMES",
        help="the linear layers that get adapters, with --lora-rank: comma-separated q, k, v, "
        "o, gate, up, down, or attention, mlp, all (default: every linear layer of a block)",
    )
    nnodes: int | None = setting(
        None, read=_count, help="number of nodes, with --cluster GPU (instead of GPU:NODESxGPUS)"
    )
    gpus_per_node: int | None = setting(
        None, read=_count, help="devices per node, with --cluster GPU and --nnodes"
    )
    runtime: str | None = setting(
        None,
        read=_text,
        help="runtime the cost model assumes (cost_models/runtimes.yaml): torch (the Engine, "
        "default), torchtitan, megatron-core, composer-fsdp, deepspeed, or megatron-sc21 "
        "(Megatron-LM as in Narayanan et al. 2021)",
    )
    global_batch_size: int = setting(
        read=_batch, help="sequences per optimizer step (required, here or in --config)"
    )
    n_trials: int | None = setting(
        None,
        read=_count,
        help="finished trials the study should hold (a resumed study runs only the rest); "
        "default: see --time-budget",
    )
    time_budget: float = setting(
        10.0,
        read=_seconds,
        metavar="SECONDS",
        help="seconds the default search aims at (no --n-trials, no --sampler): every layout "
        "when scoring them all is estimated within them, else 100 sampled trials and a local "
        "search from the best layouts that stops when the budget is spent (the same command "
        "again goes on from there); 0: the local search runs to its end (default 10)",
    )
    sampler: str | None = setting(
        None,
        read=_choice("sampler", SAMPLERS),
        choices=SAMPLERS,
        help="default: exhaustive when --n-trials covers the whole space, else tpe for one "
        "objective and nsga2 for two",
    )
    objective: str = setting(
        "throughput",
        read=_choice("objective", OBJECTIVES, OBJECTIVE_ALIASES),
        choices=OBJECTIVES,
        help="what to maximise: tokens/s (default); tokens/s at the slow end of each "
        "prediction's error band (pessimistic); or a Pareto front of tokens/s against peak "
        "memory or against dollars per token",
    )
    price_per_gpu_hour: float | None = setting(
        None,
        read=_price,
        help="dollars per device-hour: needed by throughput-cost; with any objective, adds "
        "dollars per million tokens to the summary, report.md and top_k.csv",
    )
    memory_margin: float | None = setting(
        None,
        read=_margin,
        metavar="FRACTION",
        help="device memory held back: a strategy fits when its predicted peak is at most "
        "(1 - FRACTION) x capacity, e.g. 0.1 or 10%%; default: from the measured memory error "
        "of runs of this kind (cost_models/memory_bands.yaml)",
    )
    space: str | None = setting(
        None, read=_text, help="search space YAML, or a shipped space name (default, megatron)"
    )
    pin: dict[str, Any] = setting(
        {},
        read=_pins,
        repeat=True,
        metavar="KEY=VALUE",
        help="pin or narrow a dimension, e.g. --pin tp=8 --pin recompute=selective,full "
        "(repeatable)",
    )
    fp8: bool = setting(
        False,
        read=_switch,
        switch=True,
        help="search float8 matmuls too, where the runtime and GPU run them (off by default: "
        "they change the numerics of training, not only its speed)",
    )
    trial_unit: str | None = setting(
        None,
        read=_choice("trial unit", TRIAL_UNITS),
        choices=TRIAL_UNITS,
        help="layout (default for throughput): score every recompute/sp/zero/amp of a sampled "
        "layout; strategy: one strategy per trial",
    )
    storage: str | None = setting(
        None,
        read=_text,
        help="Optuna storage: a .journal or .db file, or an RDB URL (default: OUT/study.journal)",
    )
    storage_shared_ok: bool = setting(
        False,
        read=_switch,
        switch=True,
        help="let the study add Optuna's tables to a SQLite file or database that holds tables "
        "of its own (refused by default; once Optuna's tables are there it opens without this)",
    )
    study_name: str | None = setting(
        None,
        read=_study_name,
        help="default: <model>_<cluster>_gbs<batch>_<objective> (letters, digits and ._+=- only)",
    )
    seed: int | None = setting(
        None,
        read=_seed,
        help=f"sampler seed, 0 to {MAX_SEED:,} (give parallel workers different seeds)",
    )
    top_k: int = setting(5, read=_count, help="distinct strategies to keep (default 5)")
    out: str | None = setting(
        None,
        read=_text,
        help="output folder (the CLI's default: results/<study name>/; from Python, None "
        "writes nothing)",
    )
    use_recipes: bool = setting(
        True,
        read=_switch,
        flag="--no-recipes",
        negate=True,
        help="do not enqueue the usual recipes first",
    )

    def __post_init__(self) -> None:
        if self.pin is None:
            object.__setattr__(self, "pin", {})
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None and not (f.name == "pin" and not value):
                object.__setattr__(self, f.name, f.metadata["setting"].read(value, f.name))
        self.lora()  # targets without a rank are refused

    def lora(self) -> dict[str, Any] | None:
        """The ``lora`` of `ModelSpec.load` these settings give (None: the model's own)."""
        return lora_of(self.lora_rank, self.lora_targets, where="lora_targets")

    # ---- the dict form (study.yaml's `config` block) -------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The settings as plain YAML data (fields left at None are omitted): a ModelSpec is
        written as its catalog name, or whole when it is not the catalog's; a Cluster as its
        name, or whole when its profile is a file (its path made absolute)."""
        from autosearch.core.hardware import Cluster
        from autosearch.core.model_spec import ModelSpec, model_catalog

        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None or (f.name == "pin" and not value):
                continue
            if isinstance(value, ModelSpec):
                catalog = model_catalog()
                value = value.name if catalog.get(value.name) == value else value.to_dict()
            elif isinstance(value, Cluster):
                is_file = os.path.isfile(value.gpu)
                value = (
                    {**value.to_dict(), "gpu": os.path.abspath(value.gpu)}
                    if is_file
                    else (value.name)
                )
            elif isinstance(value, dict):
                value = dict(value)
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, what: str = "config") -> "TuneConfig":
        """A TuneConfig from its dict form, or from a whole study.yaml (its ``config`` block; a
        study.yaml written before there was one is read from the fields it records).

        Keys are the field names (``global_batch_size``; ``global-batch-size`` and the old
        ``no_recipes`` are read too). An unknown key, a wrong type or a value out of range is
        refused with one message naming the key and what it takes.
        """
        values = cls.read(settings_of(data), what=what)
        missing = [
            f.name for f in dataclasses.fields(cls) if _required(f) and f.name not in values
        ]
        if missing:
            raise SpecError(f"{what}: missing key(s) {', '.join(missing)}; add them")
        return cls(**values)

    @classmethod
    def read(
        cls, data: Mapping[str, Any], *, what: str = "config", flags: bool = False
    ) -> dict[str, Any]:
        """The fields that `data` gives, each read and checked: ``{field name: value}``.

        Messages name a value ``<what>: <key>``, or by its flag when `flags` (the command line).
        None values are left out (not given).
        """
        by_key = {f.name: f for f in dataclasses.fields(cls)}
        out: dict[str, Any] = {}
        for key, value in data.items():
            name = str(key).replace("-", "_")
            if name == "no_recipes":  # the flag's name, as config files wrote it before
                name, value = "use_recipes", (not value) if isinstance(value, bool) else value
            f = by_key.get(name)
            if f is None:
                raise SpecError(
                    f"{what}: unknown key {key!r}; valid keys are the settings of a tuning "
                    f"job: {', '.join(sorted(by_key))}"
                )
            if value is None:
                continue
            where = flag_of(f) if flags else f"{what}: {key}"
            out[name] = f.metadata["setting"].read(value, where)
        return out

    def replace(self, **changes: Any) -> "TuneConfig":
        """A copy with `changes` (checked as the constructor checks)."""
        return dataclasses.replace(self, **changes)


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def required_fields() -> tuple[str, ...]:
    """The settings without a default (model, cluster, global_batch_size)."""
    return tuple(f.name for f in dataclasses.fields(TuneConfig) if _required(f))


def flag_of(f: dataclasses.Field) -> str:
    """The command-line flag of a TuneConfig field."""
    return f.metadata["setting"].flag or "--" + f.name.replace("_", "-")


def settings_of(data: Mapping[str, Any]) -> dict[str, Any]:
    """The settings a mapping holds: itself, the ``config`` block of a study.yaml, or for a
    study.yaml without one (written before it existed), the fields that study.yaml records."""
    if isinstance(data.get("config"), Mapping):
        return dict(data["config"])
    if "model_spec" in data and "signature" in data:
        recorded = {
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
        return {k: v for k, v in recorded.items() if v is not None}
    return dict(data)
