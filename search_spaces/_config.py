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

import os
from importlib import resources
from typing import Any

from autosearch.core import dimensions
from autosearch.core._io import parse_yaml_mapping, positive_int, read_yaml_mapping
from autosearch.core.errors import SpecError
from autosearch.core.strategy import ALIASES

_ALL_WORDS = ("all", "any", "auto", "*")
# The searched dimensions (`autosearch.core.dimensions`: those with a space default): integer
# ones take a list of allowed values or None (every value the rules allow), the others a list of
# their legal values.
_DIMS = {d.name: d for d in dimensions.DIMENSIONS if d.searched}
_INT_DIMS = tuple(n for n, d in _DIMS.items() if d.kind in (dimensions.DEGREE, dimensions.SIZE))
_CHOICE_DIMS = {n: d.choices for n, d in _DIMS.items() if n not in _INT_DIMS}
_FLAG_DIMS = tuple(n for n, d in _DIMS.items() if d.kind == dimensions.FLAG)
# The bounds of the space that are not dimensions, with their defaults.
_BOUNDS: dict[str, Any] = {
    "tp_within_node": True,
    "max_micro_batch_size": 32,
    "max_virtual_stages": None,
    "uneven_pipeline": False,
}
_BOOL_WORDS = {"true": True, "false": False, "yes": True, "no": False, "on": True, "off": False}


class SpaceConfig:
    """Allowed values per dimension (``None`` = every value the model and cluster allow).

    Its keys are the searched dimensions of `autosearch.core.dimensions` (each read as an
    attribute: ``config.tp``), with these bounds:

    Args:
        tp_within_node: keep the tensor-parallel group inside one node (its all-reduces run on
            every layer and would cross the network otherwise).
        max_micro_batch_size: upper bound applied when ``micro_batch_size`` is ``None``.
        max_virtual_stages: upper bound applied when ``virtual_stages`` is ``None``.
        uneven_pipeline: allow pipeline degrees that do not divide the layers (the middle
            stages take the extra layers; `autosearch.core.rules.split_layers`).
        **dimensions: the allowed values of each dimension (defaults: the registry's, e.g. every
            dp, tp, pp, micro-batch; cp 1, fp8 none, compile and async TP off), each kept only
            where the hardware (fp8) and the layout (async_tp needs tp > 1) allow it.

    Immutable: `narrowed` returns a new one.
    """

    __slots__ = ("_values",)
    KEYS = tuple(_DIMS) + tuple(_BOUNDS)

    def __init__(self, **values: Any) -> None:
        unknown = [k for k in values if k not in self.KEYS]
        if unknown:
            raise SpecError(
                f"search space: unknown key(s) {', '.join(map(repr, unknown))}; valid keys are "
                f"{', '.join(sorted(self.KEYS))}"
            )
        merged = {n: d.space for n, d in _DIMS.items()} | _BOUNDS | values
        object.__setattr__(self, "_values", _checked(merged))

    def __getattr__(self, name: str) -> Any:
        if name != "_values" and name in self._values:
            return self._values[name]
        raise AttributeError(f"SpaceConfig has no key {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("SpaceConfig is immutable; use narrowed()")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SpaceConfig) and self._values == other._values

    def __hash__(self) -> int:
        return hash(tuple(self._values.items()))

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self._values.items())
        return f"SpaceConfig({inner})"

    def __reduce__(self):
        return (_rebuild, (self._values,))

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
        changes: dict[str, Any] = {}
        unknown = []
        for key, value in pins.items():
            key = ALIASES.get(key, key)
            if key not in self.KEYS:
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
                f"{', '.join(sorted(self.KEYS))}"
            )
        return SpaceConfig(**(self._values | changes))

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self._values.items()}


def _rebuild(values: dict[str, Any]) -> SpaceConfig:
    return SpaceConfig(**values)


def _checked(values: dict[str, Any]) -> dict[str, Any]:
    """`values` normalised: integer lists sorted and unique, choices in their canonical order;
    SpecError naming every bad value."""
    out, problems = dict(values), []
    for name in _INT_DIMS:
        value = out[name]
        if value is None:
            continue
        try:
            ints = tuple(sorted({positive_int(v, name) for v in _as_tuple(value)}))
            if not ints:
                raise SpecError(f"{name} is an empty list; give at least one value, or 'all'")
            out[name] = ints
        except SpecError as exc:
            problems.append(str(exc))
    for name, legal in _CHOICE_DIMS.items():
        value = out[name]
        if value is None:
            out[name] = tuple(legal)
            continue
        chosen: list[Any] = []
        for v in _as_tuple(value):
            if name in _FLAG_DIMS and isinstance(v, str):
                v = _BOOL_WORDS.get(v.lower(), v)
            if name == "recompute" and v is False:  # YAML reads `no` as false
                v = "none"
            if isinstance(v, str):
                v = v.lower()
            if name not in _FLAG_DIMS and isinstance(v, bool) or v not in legal:
                problems.append(f"{name} value {v!r} is not one of {', '.join(map(str, legal))}")
            elif v not in chosen:
                chosen.append(v)
        if not chosen and not problems:
            problems.append(
                f"{name} is an empty list; give at least one of {', '.join(map(str, legal))}"
            )
        # Keep the canonical order of the legal values, so equal configs compare equal.
        out[name] = tuple(v for v in legal if v in chosen)
    for name in ("tp_within_node", "uneven_pipeline"):
        if not isinstance(out[name], bool):
            problems.append(f"{name} must be true or false, got {out[name]!r}")
    for name in ("max_micro_batch_size", "max_virtual_stages"):
        if out[name] is not None:
            try:
                out[name] = positive_int(out[name], name)
            except SpecError as exc:
                problems.append(str(exc))
    if problems:
        raise SpecError(problems, context="search space")
    return out


def shipped_spaces() -> list[str]:
    """Names of the space files shipped in ``search_spaces/``."""
    folder = resources.files("search_spaces")
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml"))


def _as_tuple(value: Any) -> tuple:
    if isinstance(value, (list, tuple, set, frozenset)):
        return tuple(value)
    return (value,)
