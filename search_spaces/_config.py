"""SpaceConfig: which values each strategy dimension may take, before the model and cluster rules.

A dimension is either ``None`` ("every value the rules allow": all divisors, all virtual stages)
or a tuple of allowed values. Pinning is narrowing to one value. The same keys are read from
Python keywords and from YAML (``search_spaces/default.yaml`` documents every key); Paddle's
``mp``/``mp_degree`` are accepted as aliases of ``tp`` at this edge, as in Strategy files.

A dimension that some runtimes cannot run (one that declares `features` in the registry: cp,
ep, recompute, fp8, compile, async_tp) and the ``uneven_pipeline`` and ``ep_over_tp`` bounds may
also be ``supported``: every value that the runtime runs on the cluster's device (its
``supports`` in cost_models/runtimes.yaml, and ``devices`` where a feature needs a kind of
device), resolved by
`SpaceConfig.resolved` once the runtime, model and cluster are known. The default space
(``default.yaml``) is written that way, so a dimension a runtime gains joins its default space
without a change here. Two rules of the default space are not the runtime's:

- context parallel is opened only for sequences of at least `CP_MIN_SEQ_LEN` tokens;
- fp8 is searched only when asked (``resolved(fp8=True)``: ``autosearch tune --fp8``), since
  float8 matmuls change the numerics of training, not only its speed.

Example:
    >>> from search_spaces import SpaceConfig
    >>> c = SpaceConfig.default().narrowed(tp=8, recompute=["selective", "full"])
    >>> c.tp, c.recompute
    ((8,), ('selective', 'full'))
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING, Any

from autosearch.core import dimensions
from autosearch.core._io import parse_yaml_mapping, positive_int, read_yaml_mapping
from autosearch.core.errors import SpecError
from autosearch.core.strategy import ALIASES, Strategy

if TYPE_CHECKING:  # pragma: no cover
    from autosearch.core.hardware import Cluster
    from autosearch.core.model_spec import ModelSpec
    from autosearch.core.runtime import RuntimeOptions

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
    "ep_over_tp": False,
    "etp_below_tp": False,
}
_BOOL_WORDS = {"true": True, "false": False, "yes": True, "no": False, "on": True, "off": False}
# "Every value the runtime runs here": the dimensions a runtime may lack (those with features),
# and the bounds a runtime feature opens: {bound: (feature, what the runtime does)}.
SUPPORTED = "supported"
_RUNTIME_DIMS = tuple(n for n, d in _DIMS.items() if d.features)
_FEATURE_BOUNDS = {
    "uneven_pipeline": ("uneven_pp", "split layers unevenly"),
    "ep_over_tp": ("ep_over_tp", "run expert-parallel groups over tensor-parallel ranks"),
    "etp_below_tp": ("etp_below_tp", "split experts over fewer ranks than tp"),
}
_RUNTIME_KEYS = (*_RUNTIME_DIMS, *_FEATURE_BOUNDS)
# Context parallel splits the sequence; it pays for its K/V exchange only on long sequences.
# Megatron Core's parallelism guide (docs.nvidia.com/megatron/parallelism-guide, "Parallelism
# Strategies Guide", its summary table) lists CP as "best for long sequences (8K+ tokens)".
CP_MIN_SEQ_LEN = 8192
# Float8 matmuls change the numerics of training (loss curves are compared, not assumed equal):
# the default space searches them only when asked.
OPT_IN = {"fp8": "float8 matmuls change the numerics of training"}
# Offload to host memory trades step time for device memory: the default space opens it only
# where it is needed, `resolved(offload=True)`; the tuner asks so where no strategy fits
# without it: the memory floor above the device, or none of the space's leanest strategies
# fitting (autosearch/tuning/_advice.py, `offload_needed`).
OFFLOAD = ("offload_optimizer", "offload_params", "offload_activations")
# GPU architectures to CUDA compute capabilities, to match a runtime's `devices` (cuda>=8.9).
_CAPABILITY = {"ampere": "8.0", "ada": "8.9", "hopper": "9.0", "blackwell": "10.0"}


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
        ep_over_tp: allow expert-parallel degrees that take tensor-parallel ranks (ep not
            dividing dp x cp: Megatron-Core's folding and torchtitan's etp=1 do; the Engine's
            experts fold only the data- and context-parallel ranks).
        etp_below_tp: allow expert-tensor-parallel degrees between 1 and tp (Megatron-Core
            does; torchtitan and the Engine split experts over all tp ranks or none).
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
        """The shipped ``search_spaces/default.yaml``; a dimension a runtime may lack that the
        file does not name is ``supported`` (a dimension declared later joins the default space
        of every runtime that runs it)."""
        text = (
            resources.files("search_spaces").joinpath("default.yaml").read_text(encoding="utf-8")
        )
        data = parse_yaml_mapping(text, what="search_spaces/default.yaml")
        return cls.from_dict(
            {name: SUPPORTED for name in _RUNTIME_DIMS} | data, what="search_spaces/default.yaml"
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
        if "space" in data:  # a space under `space:`, as a study.yaml records it
            others = sorted(str(k) for k in data if k != "space")
            if others or not isinstance(data["space"], dict):
                raise SpecError(
                    f"search space file {path!r}: "
                    + (
                        f"{', '.join(others)} beside 'space' would be ignored; put every "
                        "dimension under space:, or write the file without it"
                        if others
                        else f"space must be a mapping of dimension: values, got "
                        f"{type(data['space']).__name__}"
                    )
                )
            data = data["space"]
        return cls.from_dict(data, what=f"search space file {path!r}")

    def narrowed(self, *, what: str = "search space", **pins: Any) -> "SpaceConfig":
        """A copy with some dimensions pinned (a scalar) or narrowed (a list); ``"all"`` or None
        re-opens an integer dimension. Unknown keys are rejected with the list of valid ones."""
        changes: dict[str, Any] = {}
        spelled: dict[str, str] = {}
        unknown = []
        for given, value in pins.items():
            key = ALIASES.get(given, given)
            if key not in self.KEYS:
                unknown.append(key)
                continue
            if key in spelled:  # mp and tp: one dimension given twice
                raise SpecError(
                    f"{what}: {spelled[key]!r} and {given!r} both set {key}; give it once"
                )
            spelled[key] = given
            if isinstance(value, str) and value.lower() in _ALL_WORDS:
                value = None
            if value is None and key in _CHOICE_DIMS:
                value = _CHOICE_DIMS[key]
            if isinstance(value, str) and value.lower() == SUPPORTED:
                value = SUPPORTED
            if key in ("tp_within_node", *_FEATURE_BOUNDS) and isinstance(value, str):
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

    # ---- the runtime's space -------------------------------------------------------------------
    @property
    def resolved_already(self) -> bool:
        """No key is left at ``supported``."""
        return SUPPORTED not in self._values.values()

    def resolved(
        self,
        *,
        runtime: "RuntimeOptions | str | None",
        model: "ModelSpec",
        cluster: "Cluster",
        fp8: bool = False,
        offload: bool = False,
    ) -> tuple["SpaceConfig", tuple["Opened", ...]]:
        """This config with every ``supported`` replaced by the values `runtime` runs on the
        cluster's device, and why each dimension a runtime may lack is open or not.

        Args:
            runtime: a RuntimeOptions or a preset name (None: ``torch``, the Engine).
            model: the model (context parallel opens for `CP_MIN_SEQ_LEN` tokens and more).
            cluster: the cluster (its device: ``cpu``, or a GPU architecture).
            fp8: search fp8 where it is ``supported`` (`OPT_IN`: it changes numerics); without
                it fp8 stays ``none`` there.
            offload: search offload to host memory where it is ``supported`` (`OFFLOAD`: only
                where nothing fits without it) and the hardware profile describes the host.

        Returns:
            (the resolved SpaceConfig, one `Opened` per dimension a runtime may lack and per
            bound a runtime feature opens, in registry order).
        """
        from autosearch.core.runtime import RuntimeOptions

        rt = RuntimeOptions.get(runtime)
        device = device_of(cluster)
        values, notes = dict(self._values), []
        for name in _RUNTIME_KEYS:
            value, why = values[name], "as pinned (a pin or the space file)"
            if value == SUPPORTED and name in OFFLOAD and not offload:
                value = (_DIMS[name].default,)
                why = "not searched: the model's states fit the devices without offload"
            elif value == SUPPORTED and name in OFFLOAD and cluster.profile.host is None:
                value = (_DIMS[name].default,)
                why = f"hardware profile {cluster.profile.name!r} describes no host memory"
            elif value == SUPPORTED:
                value, why = _supported_values(name, rt, device, model, fp8=fp8)
                if name in OFFLOAD and len(value) > 1:
                    why = "nothing fits the devices without it; " + why
            values[name] = value
            notes.append(Opened(name=name, values=value, why=why))
        return SpaceConfig(**values), tuple(notes)


def runtime_problems(
    choices: "dict[str, tuple[Any, ...]]",
    *,
    uneven_pipeline: bool,
    runtime: "RuntimeOptions | str | None",
    cluster: "Cluster",
    ep_over_tp: bool = False,
    model: "ModelSpec | None" = None,
    etp_below_tp: bool = False,
) -> list[str]:
    """What a space asks that `runtime` cannot run on the cluster's device (for `model`, where
    given), one message per dimension naming a runtime that runs it: `choices` are the values
    each dimension takes in the space (`SearchSpace.plain_choices`), `uneven_pipeline` and
    `ep_over_tp` its bounds."""
    from autosearch.core.runtime import RUNTIMES, RuntimeOptions

    rt, device = RuntimeOptions.get(runtime), device_of(cluster)
    out = []
    for name in _RUNTIME_DIMS:
        bad = [v for v in choices.get(name, ()) if not _runs(rt, name, v, device, model)[0]]
        if not bad:
            continue
        why = _runs(rt, name, bad[0], device, model)[1]
        others = [
            r.name
            for r in RUNTIMES.values()
            if r.name != rt.name and all(_runs(r, name, v, device, model)[0] for v in bad)
        ]
        hint = (f"use --runtime {others[0]} (it runs it), or " if others else "") + (
            f"keep {name} to {_fmt_values([_DIMS[name].default])} (a pin, or the space file)"
        )
        out.append(f"{name} {_fmt_values(bad)}: {why}; {hint}")
    bounds = {
        "uneven_pipeline": uneven_pipeline,
        "ep_over_tp": ep_over_tp,
        "etp_below_tp": etp_below_tp,
    }
    for bound, (feature, does) in _FEATURE_BOUNDS.items():
        if bounds[bound] is True and feature not in rt.supports:
            out.append(
                f"{bound}: runtime {rt.name!r} does not {does} (it supports "
                f"{', '.join(rt.supports) or 'none of them'}); set {bound} false"
            )
    return out


@dataclass(frozen=True)
class Opened:
    """Why a dimension a runtime may lack is searched over `values` (``None``: every value the
    rules allow) or held at its default, in one line (`why`)."""

    name: str
    values: Any
    why: str

    def describe(self) -> str:
        shown = "all" if self.values is None else _fmt_values(self.values)
        return f"{self.name:<16} {shown:<28} {self.why}"


def device_of(cluster: "Cluster") -> str:
    """``cpu``, or ``cuda:<capability>`` from the profile's GPU architecture (``cuda`` when the
    profile names none): the form a runtime's ``devices`` are matched against."""
    profile = cluster.profile
    if profile.device_type != "cuda":
        return profile.device_type
    capability = _CAPABILITY.get(profile.architecture)
    return f"cuda:{capability}" if capability else "cuda"


def _runs(
    rt: "RuntimeOptions", name: str, value: Any, device: str, model: "ModelSpec | None" = None
) -> tuple[bool, str]:
    """Whether `rt` runs `name`=`value` on `device` (for `model`, where given: LoRA under tp),
    and if not, why (in words)."""
    probe = Strategy(**{name: value})
    own = {f.name for f in _DIMS[name].features if not f.of_strategy}  # not the space's bounds
    lacking = {k: how for k, how in rt.unsupported(probe, model).items() if k in own}
    if lacking:
        how = next(iter(lacking.values()))
        return False, (
            f"runtime {rt.name!r} does not run {how} (it supports "
            f"{', '.join(rt.supports) or 'none of them'})"
        )
    cannot = getattr(rt, "cannot_run_on", None)  # a preset's `devices`, where it declares them
    needs = cannot(probe, device) if cannot is not None else {}
    if needs:
        feature, devices = next(iter(needs.items()))
        return False, (
            f"runtime {rt.name!r} runs {feature} only on {', '.join(devices)}, and this "
            f"cluster's device is {device}"
        )
    return True, ""


def _supported_values(
    name: str, rt: "RuntimeOptions", device: str, model: "ModelSpec", *, fp8: bool
) -> tuple[Any, str]:
    """(the values of `name` that `rt` runs on `device`, why) for a ``supported`` key."""
    if name in _FEATURE_BOUNDS:
        feature, does = _FEATURE_BOUNDS[name]
        if feature not in rt.supports:
            return False, f"runtime {rt.name!r} does not {does}"
        if name == "uneven_pipeline" and model.mamba is not None:
            if "mamba_uneven_pp" not in rt.supports:  # the model's own bound (dimensions.py)
                return False, f"runtime {rt.name!r} does not {does} with Mamba-2 layers"
        return True, f"runtime {rt.name!r} can {does} (supports {feature})"
    d = _DIMS[name]
    if name in OPT_IN and not fp8:
        return (d.default,), f"not searched: {OPT_IN[name]}; --fp8 searches it"
    if d.kind == dimensions.DEGREE:  # every degree the rules allow, or none above 1
        ok, why = _runs(rt, name, 2, device, model)
        if not ok:
            return (1,), why
        if name == "cp" and model.seq_len < CP_MIN_SEQ_LEN:
            return (1,), (
                f"seq_len {model.seq_len:,} < {CP_MIN_SEQ_LEN:,}: context parallel pays off on "
                "long sequences (Megatron Core's parallelism guide: 8K+ tokens)"
            )
        return None, f"runtime {rt.name!r} runs it" + (
            f" and seq_len {model.seq_len:,} >= {CP_MIN_SEQ_LEN:,}" if name == "cp" else ""
        )
    kept: list[tuple[Any, str]] = []
    refused: list[tuple[Any, str]] = []
    for v in d.choices:
        ok, why = _runs(rt, name, v, device, model)
        (kept if ok else refused).append((v, why))
    values = tuple(v for v, _ in kept)
    if not refused:
        why = f"runtime {rt.name!r} runs every value"
    else:
        why = refused[0][1]
    if name in OPT_IN:
        why = f"searched (--fp8) where the GPU has fp8 units: {OPT_IN[name]}; " + why
    return values, why


def _fmt_values(values: Any) -> str:
    if isinstance(values, bool):
        return str(values).lower()
    return "[" + ", ".join(str(v).lower() if isinstance(v, bool) else str(v) for v in values) + "]"


def _rebuild(values: dict[str, Any]) -> SpaceConfig:
    return SpaceConfig(**values)


def _checked(values: dict[str, Any]) -> dict[str, Any]:
    """`values` normalised: integer lists sorted and unique, choices in their canonical order;
    SpecError naming every bad value."""
    out, problems = dict(values), []
    for name in out:
        if isinstance(out[name], str) and out[name].strip().lower() == SUPPORTED:
            out[name] = SUPPORTED
        if out[name] == SUPPORTED and name not in _RUNTIME_KEYS:
            problems.append(
                f"{name}: {SUPPORTED!r} is only for what a runtime may lack "
                f"({', '.join(_RUNTIME_KEYS)}); give values or 'all'"
            )
            out[name] = _DIMS[name].space if name in _DIMS else _BOUNDS[name]
    for name in _INT_DIMS:
        value = out[name]
        if value is None or value == SUPPORTED:
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
        if value == SUPPORTED:
            continue
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
    for name in ("tp_within_node", *_FEATURE_BOUNDS):
        if not isinstance(out[name], bool) and out[name] != SUPPORTED:
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
