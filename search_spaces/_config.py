"""SpaceConfig: which values each strategy dimension may take, before the model and cluster rules.

A dimension is either ``None`` ("every value the rules allow": all divisors, all virtual stages)
or a tuple of allowed values. Pinning is narrowing to one value. The same keys are read from
Python keywords and from YAML (``search_spaces/default.yaml`` documents every key); Paddle's
``mp``/``mp_degree`` are accepted as aliases of ``tp`` at this edge, as in Strategy files.

Example:
    >>> from search_spaces import SpaceConfig
    >>> c = SpaceConfig.default().narrowed(tp=8, recompute=["selective", "full"])
    >>> c.tp, c.recompute
    ((8,), ('selective', 'full'))
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from importlib import resources
from typing import Any

from autosearch.core._io import parse_yaml_mapping, positive_int, read_yaml_mapping
from autosearch.core.errors import SpecError
from autosearch.core.strategy import ALIASES, AMP, FP8, PIPELINE_SCHEDULES, RECOMPUTE, ZERO_STAGES

_ALL_WORDS = ("all", "any", "auto", "*")
_INT_DIMS = ("dp", "tp", "pp", "micro_batch_size", "virtual_stages", "cp")
_CHOICE_DIMS = {
    "pipeline_schedule": PIPELINE_SCHEDULES,
    "recompute": RECOMPUTE,
    "amp": AMP,
    "zero_stage": ZERO_STAGES,
    "sequence_parallel": (False, True),
    "fp8": FP8,
    "compile": (False, True),
    "async_tp": (False, True),
}
_BOOL_WORDS = {"true": True, "false": False, "yes": True, "no": False, "on": True, "off": False}


@dataclass(frozen=True, kw_only=True)
class SpaceConfig:
    """Allowed values per dimension (``None`` = every value the model and cluster allow).

    Args:
        dp, tp, pp: allowed parallel degrees (their product must still equal the world size).
        micro_batch_size: allowed micro-batch sizes (each must still split the global batch).
        virtual_stages: allowed model chunks per pipeline rank for ``interleaved_1f1b``.
        pipeline_schedule, recompute, sequence_parallel, zero_stage, amp: allowed values.
        tp_within_node: keep the tensor-parallel group inside one node (its all-reduces run on
            every layer and would cross the network otherwise).
        max_micro_batch_size: upper bound applied when ``micro_batch_size`` is ``None``.
        max_virtual_stages: upper bound applied when ``virtual_stages`` is ``None``.
        cp: allowed context-parallel degrees (default 1: off).
        fp8, compile, async_tp: allowed values (defaults: none, false, false), each kept only
            where the hardware (fp8) and the layout (async_tp needs tp > 1) allow it.
        uneven_pipeline: allow pipeline degrees that do not divide the layers (the middle
            stages take the extra layers; `autosearch.core.rules.split_layers`).
    """

    dp: tuple[int, ...] | None = None
    tp: tuple[int, ...] | None = None
    pp: tuple[int, ...] | None = None
    micro_batch_size: tuple[int, ...] | None = None
    virtual_stages: tuple[int, ...] | None = None
    pipeline_schedule: tuple[str, ...] = PIPELINE_SCHEDULES
    recompute: tuple[str, ...] = RECOMPUTE
    sequence_parallel: tuple[bool, ...] = (False, True)
    zero_stage: tuple[int, ...] = ZERO_STAGES
    amp: tuple[str, ...] = AMP
    tp_within_node: bool = True
    max_micro_batch_size: int | None = 32
    max_virtual_stages: int | None = None
    cp: tuple[int, ...] | None = (1,)
    fp8: tuple[str, ...] = ("none",)
    compile: tuple[bool, ...] = (False,)
    async_tp: tuple[bool, ...] = (False,)
    uneven_pipeline: bool = False

    def __post_init__(self) -> None:
        problems = []
        for name in _INT_DIMS:
            value = getattr(self, name)
            if value is None:
                continue
            try:
                values = tuple(sorted({positive_int(v, name) for v in _as_tuple(value)}))
                if not values:
                    raise SpecError(f"{name} is an empty list; give at least one value, or 'all'")
                object.__setattr__(self, name, values)
            except SpecError as exc:
                problems.append(str(exc))
        for name, legal in _CHOICE_DIMS.items():
            value = getattr(self, name)
            if value is None:
                object.__setattr__(self, name, tuple(legal))
                continue
            chosen: list[Any] = []
            for v in _as_tuple(value):
                if name in ("sequence_parallel", "compile", "async_tp") and isinstance(v, str):
                    v = _BOOL_WORDS.get(v.lower(), v)
                if name == "recompute" and v is False:  # YAML reads `no` as false
                    v = "none"
                if isinstance(v, str):
                    v = v.lower()
                if name == "zero_stage" and isinstance(v, bool) or v not in legal:
                    problems.append(
                        f"{name} value {v!r} is not one of {', '.join(map(str, legal))}"
                    )
                elif v not in chosen:
                    chosen.append(v)
            if not chosen and not problems:
                problems.append(
                    f"{name} is an empty list; give at least one of {', '.join(map(str, legal))}"
                )
            # Keep the canonical order of the legal values, so equal configs compare equal.
            object.__setattr__(self, name, tuple(v for v in legal if v in chosen))
        for name in ("tp_within_node", "uneven_pipeline"):
            if not isinstance(getattr(self, name), bool):
                problems.append(f"{name} must be true or false, got {getattr(self, name)!r}")
        for name in ("max_micro_batch_size", "max_virtual_stages"):
            value = getattr(self, name)
            if value is not None:
                try:
                    object.__setattr__(self, name, positive_int(value, name))
                except SpecError as exc:
                    problems.append(str(exc))
        if problems:
            raise SpecError(problems, context="search space")

    # ---- construction --------------------------------------------------------------------------
    @classmethod
    def default(cls) -> "SpaceConfig":
        """The shipped ``search_spaces/default.yaml``."""
        text = (
            resources.files("search_spaces").joinpath("default.yaml").read_text(encoding="utf-8")
        )
        return cls.from_dict(
            parse_yaml_mapping(text, what="search_spaces/default.yaml"),
            what="search_spaces/default.yaml",
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, what: str = "search space") -> "SpaceConfig":
        return cls().narrowed(what=what, **data)

    @classmethod
    def from_yaml(cls, source: "str | os.PathLike") -> "SpaceConfig":
        """Read a space file; a bare name (``megatron``) means ``search_spaces/<name>.yaml``."""
        path = os.fspath(source)
        if (
            not os.path.exists(path)
            and not path.endswith((".yaml", ".yml"))
            and os.sep not in path
        ):
            shipped = resources.files("search_spaces").joinpath(f"{path}.yaml")
            if shipped.is_file():
                return cls.from_dict(
                    parse_yaml_mapping(
                        shipped.read_text(encoding="utf-8"), what=f"space {path!r}"
                    ),
                    what=f"search space {path!r}",
                )
            raise SpecError(
                f"search space {path!r} is neither a YAML file nor a shipped space; shipped"
                f" spaces: {', '.join(shipped_spaces())}"
            )
        data = read_yaml_mapping(path, what="search space")
        if "space" in data and isinstance(data["space"], dict):
            data = data["space"]
        return cls.from_dict(data, what=f"search space file {path!r}")

    def narrowed(self, *, what: str = "search space", **pins: Any) -> "SpaceConfig":
        """A copy with some dimensions pinned (a scalar) or narrowed (a list); ``"all"`` or None
        re-opens an integer dimension. Unknown keys are rejected with the list of valid ones."""
        names = {f.name for f in dataclasses.fields(self)}
        changes: dict[str, Any] = {}
        unknown = []
        for key, value in pins.items():
            key = ALIASES.get(key, key)
            if key not in names:
                unknown.append(key)
                continue
            if isinstance(value, str) and value.lower() in _ALL_WORDS:
                value = None
            if value is None and key in _CHOICE_DIMS:
                value = _CHOICE_DIMS[key]
            if key in ("tp_within_node", "uneven_pipeline") and isinstance(value, str):
                value = _BOOL_WORDS.get(value.lower(), value)
            changes[key] = value
        if unknown:
            raise SpecError(
                f"{what}: unknown key(s) {', '.join(map(repr, unknown))}; valid keys are "
                f"{', '.join(sorted(names))}"
            )
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return {
            f.name: list(v) if isinstance(v, tuple) else v
            for f in dataclasses.fields(self)
            for v in [getattr(self, f.name)]
        }


def shipped_spaces() -> list[str]:
    """Names of the space files shipped in ``search_spaces/``."""
    folder = resources.files("search_spaces")
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml"))


def _as_tuple(value: Any) -> tuple:
    if isinstance(value, (list, tuple, set, frozenset)):
        return tuple(value)
    return (value,)
