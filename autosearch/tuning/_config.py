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
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autosearch.core.errors import SpecError
from autosearch.core.schema import (
    MAX_SEED,
    Schema,
    lora_of,
    read_batch,
    read_choice,
    read_cluster,
    read_count,
    read_lora_rank,
    read_lora_targets,
    read_margin,
    read_model,
    read_pins,
    read_price,
    read_seconds,
    read_seed,
    read_seq_len,
    read_switch,
    read_text,
    required,
    setting,
)

if TYPE_CHECKING:  # pragma: no cover
    from autosearch.core.hardware import Cluster
    from autosearch.core.model_spec import ModelSpec

SAMPLERS = ("tpe", "nsga2", "random", "exhaustive")
TRIAL_UNITS = ("layout", "strategy")
OBJECTIVES = ("throughput", "throughput-pessimistic", "throughput-memory", "throughput-cost")
OBJECTIVE_ALIASES = {"memory": "throughput-memory", "cost": "throughput-cost"}
STUDY_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+=-]{0,199}")


def _study_name(value: Any, where: str) -> str:
    if not isinstance(value, str) or not STUDY_NAME_RE.fullmatch(value):
        raise SpecError(
            f"{where}: study name {value!r} is not allowed: use 1-200 letters, digits and "
            ". _ + = -, starting with a letter or digit (it names the study in its storage and "
            "the default output folder, so it may not hold a path)"
        )
    return value


# ---- the schema ---------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class TuneConfig(Schema):
    """Every setting of one tuning job. A frozen record: change it with `replace`.

    Each field says in its `Setting` how the CLI spells it, its help text
    (``autosearch tune --help``) and how a value is read and checked; the constructor checks
    every value, so a TuneConfig that exists is valid as far as its fields go (the model,
    cluster, space and storage they name are read by `autosearch.tune`).
    """

    model: "ModelSpec | dict | str" = setting(
        read=read_model,
        help="catalog name (see `autosearch models`), a model YAML file, or a Hugging Face "
        "config.json or the model's folder holding one (required, here or in the config file)",
    )
    cluster: "Cluster | dict | str" = setting(
        read=read_cluster,
        help="GPU:NODESxGPUS (e.g. h100-sxm:32x8), a GPU with --nnodes and --gpus-per-node, a "
        "cluster YAML file (gpu, n_nodes, gpus_per_node), or a profile YAML path[:NODESxGPUS]",
    )
    seq_len: int | None = setting(
        None,
        read=read_seq_len,
        help="training sequence length in tokens, replacing the model's (a Hugging Face "
        "config.json gives its maximum positions, often far longer than one trains)",
    )
    lora_rank: int | None = setting(
        None,
        read=read_lora_rank,
        help="fine-tune with LoRA adapters of this rank on a frozen model (frozen weights keep "
        "no gradient or optimizer state); replaces the model's lora",
    )
    lora_targets: str | None = setting(
        None,
        read=read_lora_targets,
        metavar="NAMES",
        help="the linear layers that get adapters, with --lora-rank: comma-separated q, k, v, "
        "o, gate, up, down, or attention, mlp, all (default: every linear layer of a block)",
    )
    nnodes: int | None = setting(
        None,
        read=read_count,
        help="number of nodes, with --cluster GPU (instead of GPU:NODESxGPUS)",
    )
    gpus_per_node: int | None = setting(
        None, read=read_count, help="devices per node, with --cluster GPU and --nnodes"
    )
    runtime: str | None = setting(
        None,
        read=read_text,
        help="runtime the cost model assumes (cost_models/runtimes.yaml): torch (the Engine, "
        "default), torchtitan, megatron-core, composer-fsdp, deepspeed, megatron-sc21 "
        "(Megatron-LM as in Narayanan et al. 2021), metaseq (as OPT-175B ran it), or a dated "
        "release: nemo-24.07 ... nemo-25.07, megatron-bridge-25.09 ... megatron-bridge-26.08, "
        "torchtitan-2412",
    )
    global_batch_size: int = setting(
        read=read_batch, help="sequences per optimizer step (required, here or in --config)"
    )
    n_trials: int | None = setting(
        None,
        read=read_count,
        help="finished trials the study should hold (a resumed study runs only the rest): "
        "every layout when they cover the space, else a quarter of them sampled (10 to 100) "
        "and the rest a local search from the best layouts (with --sampler, all sampled); "
        "default: see --time-budget",
    )
    time_budget: float = setting(
        10.0,
        read=read_seconds,
        metavar="SECONDS",
        help="seconds the default search aims at (no --n-trials, no --sampler): every layout "
        "when scoring them all is priced within them, else 100 sampled trials and a local "
        "search from the best layouts that stops when the budget is spent (the same command "
        "again goes on from there); 0: the local search runs to its end (default 10). Counted "
        "in priced work (the cost model's time per estimate), not on a clock, so every machine "
        "and every door picks the same strategy",
    )
    sampler: str | None = setting(
        None,
        read=read_choice("sampler", SAMPLERS),
        choices=SAMPLERS,
        help="default: exhaustive when --n-trials covers the whole space, else tpe for one "
        "objective and nsga2 for two",
    )
    objective: str = setting(
        "throughput",
        read=read_choice("objective", OBJECTIVES, OBJECTIVE_ALIASES),
        choices=OBJECTIVES,
        help="what to maximise: tokens/s (default); tokens/s at the slow end of each "
        "prediction's error band (pessimistic); or a Pareto front of tokens/s against peak "
        "memory or against dollars per token",
    )
    price_per_gpu_hour: float | None = setting(
        None,
        read=read_price,
        help="dollars per device-hour: needed by throughput-cost; with any objective, adds "
        "dollars per million tokens to the summary, report.md and top_k.csv",
    )
    memory_margin: float | None = setting(
        None,
        read=read_margin,
        metavar="FRACTION",
        help="device memory held back: a strategy fits when its predicted peak is at most "
        "(1 - FRACTION) x capacity, e.g. 0.1 or 10%%; default: from the measured memory error "
        "of runs of this kind (cost_models/memory_bands.yaml)",
    )
    space: str | None = setting(
        None, read=read_text, help="search space YAML, or a shipped space name (default, megatron)"
    )
    pin: dict[str, Any] = setting(
        {},
        read=read_pins,
        repeat=True,
        metavar="KEY=VALUE",
        help="pin or narrow a dimension, e.g. --pin tp=8 --pin recompute=selective,full "
        "(repeatable)",
    )
    fp8: bool = setting(
        False,
        read=read_switch,
        switch=True,
        help="search float8 matmuls too, where the runtime and GPU run them (off by default: "
        "they change the numerics of training, not only its speed)",
    )
    trial_unit: str | None = setting(
        None,
        read=read_choice("trial unit", TRIAL_UNITS),
        choices=TRIAL_UNITS,
        help="layout (default for throughput): score every recompute/sp/zero/amp of a sampled "
        "layout; strategy: one strategy per trial",
    )
    storage: str | None = setting(
        None,
        read=read_text,
        help="Optuna storage: a .journal or .db file, or an RDB URL (default: OUT/study.journal)",
    )
    storage_shared_ok: bool = setting(
        False,
        read=read_switch,
        switch=True,
        help="let the study add Optuna's tables to a SQLite file or database that holds tables "
        "of its own (refused by default; once Optuna's tables are there it opens without this)",
    )
    study_name: str | None = setting(
        None,
        read=_study_name,
        help="default: <model>_<cluster>_gbs<batch>_<objective> (letters, digits and ._+=- only)",
    )
    seed: int = setting(
        0,
        read=read_seed,
        help=f"sampler seed, 0 to {MAX_SEED:,} (default 0, so the same command picks the same "
        "strategy; give parallel workers on one study different seeds)",
    )
    top_k: int = setting(5, read=read_count, help="distinct strategies to keep (default 5)")
    out: str | None = setting(
        None,
        read=read_text,
        help="output folder (the CLI's default: results/<study name>/; from Python, None "
        "writes nothing)",
    )
    use_recipes: bool = setting(
        True,
        read=read_switch,
        flag="--no-recipes",
        negate=True,
        help="do not enqueue the usual recipes first",
    )

    RENAMED = {  # the flag's name, as config files wrote it before
        "no_recipes": ("use_recipes", lambda v: (not v) if isinstance(v, bool) else v)
    }

    def __post_init__(self) -> None:
        super().__post_init__()
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
        return super().from_dict(settings_of(data), what=what)


def required_fields() -> tuple[str, ...]:
    """The settings without a default (model, cluster, global_batch_size)."""
    return tuple(f.name for f in dataclasses.fields(TuneConfig) if required(f))


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
