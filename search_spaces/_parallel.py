"""SearchSpace: every valid parallel strategy for a model on a cluster at a global batch size.

The space is built once, as a tree whose every leaf is valid by construction:

    tp -> cp -> pp -> micro_batch_size -> pipeline (schedule, virtual stages)   [the "layout"]
    x recompute x sequence_parallel x zero_stage x amp x fp8 x compile x async_tp   [axes]

The levels come from the dimension registry (`autosearch.core.dimensions`): the degree levels
(`MESH_LEVELS`, tp, cp, pp; dp is what they leave of the world; then the folded degrees, ep,
each a divisor of the ranks it splits) are built by one loop, each value a divisor of the
devices the levels above leave, kept when the space allows it and every
rule of `autosearch.core.rules.RULES` that it completes holds (the rules `Strategy.problems`
composes: tp divides n_heads and n_kv_heads, cp splits the sequence ...); tp also stays inside a
node unless `tp_within_node` is off, and pp divides n_layers unless `uneven_pipeline`.
micro_batch_size splits global_batch/dp into m micro-batches with m >= pp when pp > 1 (a pipeline
needs one micro-batch per stage to fill); interleaved 1F1B needs pp*v to divide n_layers and m to
be a multiple of pp (Narayanan et al. 2021, sec. 2.2). The axes (`AXES`) keep the space's values
that their rules allow for the layout (sequence parallel and async TP need tp > 1, fp8 a GPU with
fp8 units). Branches with no valid leaf are pruned, so a sampler walking the tree can never reach
an invalid strategy.

How Optuna samples it (`suggest`): one categorical parameter per tree level, in order. A level's
choices depend on the choices above it (the micro-batch sizes that split the batch depend on dp),
so the parameter *name carries its choice list*, e.g. ``micro_batch_size[1,2,4]``: the same name
always has the same choices, in every trial and every process, as Optuna requires of a
distribution; and layouts that share a choice list share a parameter, so TPE pools what it
learns about, say, micro-batch sizes across all the meshes that admit the same sizes. The first
level and the axes are plain parameters (``tp``, ``recompute``, ``zero_stage``, ``amp`` ...) while
their choices are the same in every layout. A level with a single choice is not sampled at all.

Pipeline schedules with pp = 1 are meaningless (there is no pipeline), so pp = 1 strategies carry
the canonical ``1f1b`` (or ``gpipe`` if only that is allowed) instead of two identical copies.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from autosearch.core import dimensions, rules
from autosearch.core._io import positive_int
from autosearch.core.errors import SpecError
from autosearch.core.hardware import Cluster
from autosearch.core.model_spec import ModelSpec
from autosearch.core.strategy import Strategy
from search_spaces._base import BaseSearchSpace
from search_spaces._config import SpaceConfig

if TYPE_CHECKING:  # pragma: no cover
    import optuna

INTERLEAVED = rules.INTERLEAVED
MESH_LEVELS = dimensions.MESH_LEVELS
# The degree levels from the root: the mesh degrees (they use up the devices; dp takes the
# rest), then the folded ones (ep: they split ranks the mesh already counts).
TREE_LEVELS = dimensions.MESH_LEVELS + dimensions.FOLDED_LEVELS
AXES = dimensions.AXES
# What a layout holds: the degrees (dp and the mesh levels), the micro-batch and the pipeline.
LAYOUT_FIELDS = tuple(
    d.name
    for d in dimensions.DIMENSIONS
    if d.level in (dimensions.REST, dimensions.MESH, dimensions.FOLDED, dimensions.LAYOUT)
)
# amp in preference order, so that among equally fast strategies bf16 comes first.
AMP_PREFERENCE = ("bf16", "fp16", "fp32")
_DEFAULTS = {d.name: d.default for d in dimensions.DIMENSIONS}
# Axes the space's description names only where they take more than one value.
QUIET_AXES: tuple[str, ...] = ("fp8", "compile", "async_tp", "offload_optimizer")
QUIET_AXES += ("offload_params", "offload_activations")


class Layout:
    """What a trial of the layout kind samples: the degrees, the micro-batch size and the
    pipeline (`LAYOUT_FIELDS`, read as attributes: ``layout.tp``); every axis is scanned inside
    the trial."""

    __slots__ = ("values",)

    def __init__(self, **values: Any):
        object.__setattr__(self, "values", values)

    def __getattr__(self, name: str) -> Any:
        if name != "values" and name in self.values:
            return self.values[name]
        raise AttributeError(f"a layout has no {name!r}; it holds {', '.join(LAYOUT_FIELDS)}")

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("a Layout is immutable")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and self.values == other.values

    def __hash__(self) -> int:
        return hash(tuple(self.values.items()))

    def __repr__(self) -> str:
        return f"Layout({', '.join(f'{k}={v!r}' for k, v in self.values.items())})"

    def label(self) -> str:
        """``dp8-tp2-pp4-mb1-interleaved_1f1bv2``: the registry's labels of what it holds."""
        dims = tuple(d for d in dimensions.LABEL_ORDER if d.name in LAYOUT_FIELDS)
        return dimensions.join_labels(self, dims)


def pipeline_label(schedule: str, virtual_stages: int) -> str:
    """The categorical value of a pipeline option: ``1f1b``, ``gpipe``, ``interleaved_1f1b_v2``."""
    return f"{INTERLEAVED}_v{virtual_stages}" if schedule == INTERLEAVED else schedule


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _keyed(dim: str, labels: list[str]) -> str:
    """Parameter name that carries its choice list: ``micro_batch_size[1,2,4]``."""
    return f"{dim}[{','.join(labels)}]"


def _completed_rules(known: tuple[str, ...], name: str) -> tuple[rules.Rule, ...]:
    """The rules that `name` completes: every dimension they read is known once it is."""
    before = set(known)
    after = before | {name}
    return tuple(r for r in rules.RULES if set(r.reads) <= after and not set(r.reads) <= before)


class SearchSpace(BaseSearchSpace):
    """Every valid strategy for (model, cluster, global batch size), narrowed by pins.

    Args:
        model: a ModelSpec or a catalog name / YAML path.
        cluster: a Cluster or its text form (``h100-sxm:32x8``).
        global_batch_size: sequences per optimizer step.
        config: a SpaceConfig, or a space YAML (path or shipped name such as ``megatron``);
            defaults to ``search_spaces/default.yaml``.
        runtime: the runtime whose ``supports`` resolve the config's ``supported`` values
            (`SpaceConfig.resolved`; default ``torch``, the Engine).
        **pins: per-dimension narrowing on top of `config`: a scalar pins (``tp=8``), a list
            narrows (``recompute=["selective", "full"]``), ``"all"`` re-opens.

    Raises:
        SpecError: a pin is malformed, or no strategy satisfies the rules and pins (the message
            says which rule emptied the space).

    Example:
        >>> from search_spaces import SearchSpace
        >>> space = SearchSpace("llama3-8b", "h100-sxm:8x8", global_batch_size=512, amp="bf16")
        >>> space.size > 1000, all(s.amp == "bf16" for s in space.enumerate())
        (True, True)
    """

    def __init__(
        self,
        model: "ModelSpec | str",
        cluster: "Cluster | str",
        *,
        global_batch_size: int,
        config: "SpaceConfig | str | os.PathLike | None" = None,
        runtime: Any = None,
        **pins: Any,
    ):
        self.model = ModelSpec.load(model)
        self.cluster = Cluster.parse(cluster)
        self.global_batch_size = positive_int(global_batch_size, "global_batch_size")
        if config is None:
            config = SpaceConfig.default()
        elif not isinstance(config, SpaceConfig):
            config = SpaceConfig.from_yaml(config)
        self.config = config.narrowed(**pins) if pins else config
        if not self.config.resolved_already:
            self.config, _ = self.config.resolved(
                runtime=runtime, model=self.model, cluster=self.cluster
            )
        self._build()

    @classmethod
    def from_yaml(
        cls,
        path: "str | os.PathLike",
        model: "ModelSpec | str",
        cluster: "Cluster | str",
        *,
        global_batch_size: int,
        **pins: Any,
    ) -> "SearchSpace":
        """The space of a YAML file (or shipped name), with optional extra pins."""
        return cls(
            model,
            cluster,
            global_batch_size=global_batch_size,
            config=SpaceConfig.from_yaml(path),
            **pins,
        )

    # ---- building the tree ---------------------------------------------------------------------
    def _build(self) -> None:
        c, world = self.config, self.cluster.world_size
        peaks = self.cluster.profile.peak_flops
        self.amps = tuple(a for a in AMP_PREFERENCE if a in c.amp and a in peaks)
        if not self.amps:
            raise SpecError(
                f"amp {', '.join(c.amp)} not supported by hardware profile"
                f" {self.cluster.profile.name!r} (it has peaks for"
                f" {', '.join(peaks)}); allow one of those"
            )
        self._axis_values = {name: getattr(c, name) for name in AXES} | {"amp": self.amps}
        self._combo_rules = self._rules_across_axes()
        across = {rule.name for rule, _ in self._combo_rules}
        self._axis_rules = {
            name: tuple(r for r in rules.rules_reading(name) if r.name not in across)
            for name in AXES
        }
        self._combos_cache: dict[tuple[int, ...], tuple[tuple[Any, ...], ...]] = {}
        self._axes_cache: dict[tuple[int, ...], tuple[tuple[Any, ...], ...] | None] = {}
        self._checked: set[tuple[str, Any]] = set()  # axis values a Strategy has checked
        self._schedules_pp1 = [str(s) for s in ("1f1b", "gpipe") if s in c.pipeline_schedule][:1]
        self._dropped: dict[str, list[int]] = {}  # the first level's candidates, for messages
        self._axis_refusals: dict[str, str] = {}  # an axis left without values, and why
        tree = self._subtree(0, {}, world)
        if not tree:
            raise SpecError(self._empty_message(), context="search space is empty")
        self._tree = tree
        first = MESH_LEVELS[0]
        self.tps = tuple(sorted(tree)) if first == "tp" else ()
        leaves = list(self._leaves())
        seen: list[set[Any]] = [set() for _ in AXES]
        for degrees in {degrees for degrees, _, _ in leaves}:
            for values, axis in zip(seen, self._axes(degrees) or ()):
                values.update(axis)
        self._unions = {
            name: tuple(v for v in self._axis_values[name] if v in values)
            for name, values in zip(AXES, seen)
        }
        self._n_layouts = sum(len(options) for _, _, options in leaves)
        self._size = sum(
            len(options) * self._n_combinations(degrees) for degrees, _, options in leaves
        )
        if self._combo_rules and not self._size:  # the axes' values never go together
            rule, names = self._combo_rules[0]
            raise SpecError(
                f"no combination of the space's {', '.join(names)} follows the {rule.name} "
                "rule; widen one of them",
                context="search space is empty",
            )
        # Legacy names of the axis choices: recompute, zero stages, fp8s, compiles.
        self.recomputes, self.zero_stages = c.recompute, c.zero_stage
        self.fp8s, self.compiles = self._axis_union("fp8"), c.compile

    def _subtree(self, depth: int, known: dict[str, int], left: int) -> dict:
        """The levels from `TREE_LEVELS[depth]` down, for the degrees `known` leaving `left`
        devices: {value: subtree}, with the micro-batch levels under the last degree."""
        if depth == len(MESH_LEVELS) and "dp" not in known:  # dp: the devices left
            if self.config.dp is not None and left not in self.config.dp:
                return {}
            known = {**known, "dp": left}
        if depth == len(TREE_LEVELS):
            return self._micro_level(known)
        name = TREE_LEVELS[depth]
        folds = dimensions.BY_NAME[name].folds
        completed = _completed_rules(tuple(known), name)
        pins = getattr(self.config, name)
        out = {}
        for value in _divisors(math.prod(known[f] for f in folds) if folds else left):
            values = {**known, name: value}
            if pins is not None and value not in pins:
                continue
            if any(r.check(values, self.model, self.cluster) for r in completed):
                continue
            if not self._space_allows(name, value, values):
                continue
            if depth == 0:
                self._dropped.setdefault(name, []).append(value)
            sub = self._subtree(depth + 1, values, left if folds else left // value)
            if sub:
                out[value] = sub
        return out

    def _space_allows(self, name: str, value: int, known: dict[str, int]) -> bool:
        """The space's own bounds on a degree (beyond the rules every strategy follows)."""
        c, m = self.config, self.model
        if name == "ep" and not c.ep_over_tp:
            # the runtime's expert groups take data- and context-parallel ranks only
            return (known["dp"] * known["cp"]) % value == 0
        if name == "etp" and not c.etp_below_tp:
            # the runtime splits experts over all tp ranks or none (torchtitan's etp)
            return value in (1, known["tp"])
        if name == "tp":
            # tp stays on NVLink: a node, or a rack (GB200 NVL72)
            return not c.tp_within_node or value <= self.cluster.nvlink_domain
        if name == "pp":
            return rules.layers_problem(value, 1, m, uneven=c.uneven_pipeline) is None and (
                value > 1 or bool(self._schedules_pp1)
            )
        return True

    def _micro_level(self, degrees: dict[str, int]) -> dict[int, tuple[tuple[str, int], ...]]:
        """{micro_batch_size: pipeline options} for one split of the devices (empty when the
        split's dp is pinned out or an axis has no value left)."""
        c, gbs, dp, pp = self.config, self.global_batch_size, degrees["dp"], degrees["pp"]
        if self._axes(tuple(degrees[n] for n in TREE_LEVELS)) is None:
            return {}
        per_rank = gbs // dp if rules.batch_problem(gbs, dp, 1) is None else 0
        mbs = {}
        for mb in _divisors(per_rank) if per_rank else []:
            if c.micro_batch_size is not None:
                if mb not in c.micro_batch_size:
                    continue
            elif c.max_micro_batch_size is not None and mb > c.max_micro_batch_size:
                continue
            n_micro = per_rank // mb
            if rules.microbatch_problem(pp, n_micro, "1f1b") is not None:
                continue
            options = self._pipeline_options(pp, n_micro)
            if options:
                mbs[mb] = options
        return mbs

    def _pipeline_options(self, pp: int, n_micro: int) -> tuple[tuple[str, int], ...]:
        c, layers = self.config, self.model.n_layers
        if pp == 1:
            return ((self._schedules_pp1[0], 1),)
        out: list[tuple[str, int]] = [
            (s, 1) for s in ("gpipe", "1f1b") if s in c.pipeline_schedule
        ]
        if INTERLEAVED in c.pipeline_schedule:
            candidates = (
                range(2, layers // pp + 1) if c.uneven_pipeline else _divisors(layers // pp)
            )
            for v in candidates:
                if v == 1 or (c.virtual_stages is not None and v not in c.virtual_stages):
                    continue
                if (
                    rules.microbatch_problem(pp, n_micro, INTERLEAVED) is not None
                    or rules.layers_problem(pp, v, self.model, uneven=c.uneven_pipeline)
                    is not None
                ):
                    continue
                if (
                    c.virtual_stages is None
                    and c.max_virtual_stages is not None
                    and v > c.max_virtual_stages
                ):
                    continue
                out.append((INTERLEAVED, v))
        return tuple(out)

    def _axes(self, degrees: tuple[int, ...]) -> tuple[tuple[Any, ...], ...] | None:
        """The values of every axis (`AXES` order) for the `degrees` (`TREE_LEVELS` order), or
        None when an axis has none left."""
        if degrees not in self._axes_cache:
            self._axes_cache[degrees] = self._axes_for(**dict(zip(TREE_LEVELS, degrees)))
        return self._axes_cache[degrees]

    def _axes_for(self, **degrees: int) -> tuple[tuple[Any, ...], ...] | None:
        """Each axis's space values that its rules allow with these degrees (the others at
        their defaults), or None when one has none left."""
        values = {**_DEFAULTS, **degrees, "global_batch_size": self.global_batch_size}
        out = []
        for name in AXES:
            checks = self._axis_rules[name]
            allowed, refused = [], []
            for v in self._axis_values[name]:
                why = [r.check({**values, name: v}, self.model, self.cluster) for r in checks]
                messages = [w for w in why if w is not None]
                if messages:
                    refused.append(messages[0])
                else:
                    allowed.append(v)
            if not allowed:
                self._axis_refusals.setdefault(name, refused[0])
                return None
            out.append(tuple(allowed))
        return tuple(out)

    def _rules_across_axes(self) -> tuple[tuple[rules.Rule, tuple[str, ...]], ...]:
        """The rules that read two axes or more (offload_params needs zero_stage 3 and
        offload_optimizer) and refuse some combination of the space's values, with the axes
        each reads: a layout keeps only the combinations they allow. None in a space whose
        axes combine freely (every shipped space unless offload is opened)."""
        out = []
        for rule in rules.RULES:
            names = tuple(n for n in rule.reads if n in AXES)
            if len(names) < 2:
                continue
            base = {**_DEFAULTS, "global_batch_size": self.global_batch_size}
            combos = itertools.product(*(self._axis_values[n] for n in names))
            if any(
                rule.check({**base, **dict(zip(names, c))}, self.model, self.cluster)
                for c in combos
            ):
                out.append((rule, names))
        return tuple(out)

    def _combinations(self, degrees: tuple[int, ...]) -> tuple[tuple[Any, ...], ...]:
        """The combinations of the axes' values (`AXES` order) for `degrees` that the rules
        across axes allow (`_rules_across_axes`)."""
        hit = self._combos_cache.get(degrees)
        if hit is None:
            axes = self._axes(degrees) or ()
            base = {**_DEFAULTS, **dict(zip(TREE_LEVELS, degrees))}
            base["global_batch_size"] = self.global_batch_size
            hit = tuple(
                combo
                for combo in itertools.product(*axes)
                if all(
                    rule.check({**base, **dict(zip(AXES, combo))}, self.model, self.cluster)
                    is None
                    for rule, _ in self._combo_rules
                )
            )
            self._combos_cache[degrees] = hit
        return hit

    def _n_combinations(self, degrees: tuple[int, ...]) -> int:
        axes = self._axes(degrees) or ()
        if not self._combo_rules:
            return math.prod(len(a) for a in axes)
        return len(self._combinations(degrees))

    def _axis_choices(
        self, degrees: tuple[int, ...], axes: tuple[tuple[Any, ...], ...], chosen: dict[str, Any]
    ) -> tuple[tuple[Any, ...], ...]:
        """Each axis's values given the values `chosen` of the axes before it (`AXES` order),
        where rules across axes narrow them: what the sampler offers, one axis at a time."""
        if not self._combo_rules:
            return axes
        combos = self._combinations(degrees)
        out = []
        for i, name in enumerate(AXES):
            if i:  # the combinations that hold the axis before's chosen value
                before = chosen[AXES[i - 1]]
                combos = tuple(c for c in combos if c[i - 1] == before)
            out.append(tuple(v for v in axes[i] if any(c[i] == v for c in combos)))
            if name not in chosen:
                break
        return tuple(out) + axes[len(out) :]

    def _axis_union(self, name: str) -> tuple[Any, ...]:
        """Every value axis `name` takes somewhere in the space, in the space's order."""
        return self._unions[name]

    def _leaves(self) -> Iterator[tuple[tuple[int, ...], int, tuple[tuple[str, int], ...]]]:
        """(degrees in `TREE_LEVELS` order, micro_batch_size, pipeline options) of every
        branch of the tree."""

        def walk(node: dict, prefix: tuple[int, ...]):
            if len(prefix) == len(TREE_LEVELS):
                for mb, options in node.items():
                    yield prefix, mb, options
                return
            for value, sub in node.items():
                yield from walk(sub, prefix + (value,))

        yield from walk(self._tree, ())

    def _empty_message(self) -> str:
        c, m, world, gbs = self.config, self.model, self.cluster.world_size, self.global_batch_size
        first = MESH_LEVELS[0]
        kept = self._dropped.get(first, [])
        gpn = self.cluster.nvlink_domain
        if self._axis_refusals:
            name, why = next(iter(self._axis_refusals.items()))
            return (
                f"{name} {list(getattr(c, name))} is not allowed for {m.name} on"
                f" {self.cluster.name} where the other pins leave a layout: {why}"
            )
        if not kept:
            return (
                f"no tensor-parallel degree is allowed for {m.name} on {self.cluster.name}:"
                f" tp must divide {world} devices, n_heads={m.n_heads}, n_kv_heads="
                f"{m.n_kv_heads}"
                + (f", <= {gpn} per NVLink domain" if c.tp_within_node else "")
                + f"; pins tp={list(c.tp) if c.tp else 'all'},"
                f" tp_within_node={c.tp_within_node}. Widen tp or set tp_within_node: false"
            )
        return (
            f"no (dp, tp, pp, micro_batch_size, schedule) of {world} devices splits"
            f" global_batch_size={gbs} for {m.name} ({m.n_layers} layers): tp in {kept}"
            f" (divides {world} devices, n_heads={m.n_heads}, n_kv_heads={m.n_kv_heads}"
            + (f", <= {gpn} per NVLink domain" if c.tp_within_node else "")
            + "); pp must"
            f" divide {m.n_layers} layers, dp must divide {gbs}, and a pipeline of pp stages"
            " needs >= pp micro-batches per step. Pins:"
            f" dp={_fmt(c.dp)}, pp={_fmt(c.pp)}, cp={_fmt(c.cp)},"
            f" micro_batch_size={_fmt(c.micro_batch_size)},"
            f" pipeline_schedule={list(c.pipeline_schedule)}. Use a global batch that is a"
            " multiple of the data-parallel degree, or widen the pins"
        )

    # ---- the interface -------------------------------------------------------------------------
    @property
    def size(self) -> int:
        return self._size

    @property
    def n_groups(self) -> int:
        """Number of layouts (degrees, micro-batch, schedule): the groups of `suggest_group`."""
        return self._n_layouts

    def layouts(self) -> Iterator[Layout]:
        """Every valid layout: its degrees, micro-batch size, schedule and virtual stages."""
        world = self.cluster.world_size
        for degrees, mb, options in self._leaves():
            mesh = dict(zip(TREE_LEVELS, degrees))
            dp = world // math.prod(mesh[n] for n in MESH_LEVELS)
            for schedule, v in options:
                yield self._layout(dp, mesh, mb, schedule, v)

    @staticmethod
    def _layout(dp: int, mesh: dict[str, int], mb: int, schedule: str, v: int) -> Layout:
        values = {
            "dp": dp,
            **mesh,
            "micro_batch_size": mb,
            "pipeline_schedule": schedule,
            "virtual_stages": v,
        }
        return Layout(**{name: values[name] for name in LAYOUT_FIELDS})

    def group_params(self, *, every: int = 1) -> Iterator[dict[str, Any]]:
        """The trial parameters of every layout (of every `every`-th), in `layouts` order. One
        strategy of each is built to name them: 1,740 instead of the 99,180 strategies of GPT-3
        175B on 384 GPUs, and none for the layouts skipped."""
        for layout in itertools.islice(self.layouts(), 0, None, every):
            yield self.params_of(next(self.strategies_of(layout)), group=True)

    def strategies_of(self, layout: Layout) -> Iterator[Strategy]:
        """The strategies of one layout: every combination of the axes' values."""
        axes = self._axes(tuple(getattr(layout, n) for n in TREE_LEVELS))
        assert axes is not None  # the tree holds no layout without axis values
        base = dict(layout.values, global_batch_size=self.global_batch_size)
        first = None
        combos = (
            self._combinations(tuple(getattr(layout, n) for n in TREE_LEVELS))
            if self._combo_rules
            else itertools.product(*axes)
        )
        for combo in combos:
            values = dict(zip(AXES, combo))
            if first is None or not self._checked.issuperset(values.items()):
                strategy = Strategy(**base, **values)  # checks every value once
                self._checked.update(values.items())
                first = first or strategy
                yield strategy
            else:  # values a Strategy has checked: the same fields, without the checks
                yield first.with_checked(values)

    def enumerate(self) -> Iterator[Strategy]:
        for layout in self.layouts():
            yield from self.strategies_of(layout)

    def suggest(self, trial: "optuna.trial.BaseTrial") -> Strategy:
        layout = self._suggest_layout(trial)
        axes = self._axes(tuple(getattr(layout, n) for n in TREE_LEVELS))
        assert axes is not None
        pick = _picker(trial)
        degrees = tuple(getattr(layout, n) for n in TREE_LEVELS)
        chosen: dict[str, Any] = {}
        for i, name in enumerate(AXES):
            values = self._axis_choices(degrees, axes, chosen)[i]
            chosen[name] = pick(self._axis_param(name, values), values)
        return Strategy(**layout.values, global_batch_size=self.global_batch_size, **chosen)

    def _axis_param(self, name: str, values: tuple[Any, ...]) -> str:
        """An axis's parameter name: plain while its values are its values everywhere in the
        space, else keyed by them (one distribution per name)."""
        return name if values == self._axis_union(name) else _keyed(name, list(map(str, values)))

    def suggest_group(self, trial: "optuna.trial.BaseTrial") -> tuple[Strategy, ...]:
        """Sample a layout (degrees, micro-batch, schedule); return it with every combination
        of the axes (recompute x sequence parallel x ZeRO stage x amp, and fp8, compile and async
        TP where allowed)."""
        return tuple(self.strategies_of(self._suggest_layout(trial)))

    def suggest_layout(self, trial: "optuna.trial.BaseTrial") -> Layout:
        """Sample a layout only: what `suggest_group` samples, before its strategies are built
        (`strategies_of`)."""
        return self._suggest_layout(trial)

    def _suggest_layout(self, trial: "optuna.trial.BaseTrial") -> Layout:
        pick = _picker(trial)
        node, mesh = self._tree, {}
        for depth, name in enumerate(TREE_LEVELS):
            choices = tuple(node)
            param = name if depth == 0 else _keyed(name, [str(c) for c in choices])
            mesh[name] = pick(param, choices)
            node = node[mesh[name]]
        mbs = node
        mb = pick(_keyed("micro_batch_size", [str(b) for b in mbs]), tuple(mbs))
        options = mbs[mb]
        labels = tuple(pipeline_label(s, v) for s, v in options)
        label = pick(_keyed("pipeline", list(labels)), labels)
        schedule, v = options[labels.index(label)]
        dp = self.cluster.world_size // math.prod(mesh[n] for n in MESH_LEVELS)
        return self._layout(dp, mesh, mb, schedule, v)

    def params_of(self, strategy: Strategy, *, group: bool = False) -> dict[str, Any]:
        s = strategy
        where = f"strategy {s.short()} is not in this search space"
        params: dict[str, Any] = {}
        node = self._tree
        for depth, name in enumerate(TREE_LEVELS):
            value = getattr(s, name)
            if value not in node:
                above = ", ".join(f"{n}={getattr(s, n)}" for n in TREE_LEVELS[:depth])
                raise SpecError(
                    f"{where}: {name}={value} is not one of {list(node)}"
                    + (f" for {above}" if above else "")
                )
            if len(node) > 1:
                param = name if depth == 0 else _keyed(name, [str(c) for c in node])
                params[param] = value
            node = node[value]
        if s.world_size != self.cluster.world_size:
            degrees = ", ".join(f"{n}={getattr(s, n)}" for n in dimensions.MESH_AXES)
            raise SpecError(f"{where}: ({degrees}) is not a valid split here")
        if s.global_batch_size != self.global_batch_size:
            raise SpecError(
                f"{where}: global_batch_size {s.global_batch_size} != {self.global_batch_size}"
            )
        mbs = node
        options = mbs.get(s.micro_batch_size)
        if options is None:
            raise SpecError(
                f"{where}: micro_batch_size={s.micro_batch_size} is not one of {list(mbs)} for"
                " this split"
            )
        schedule = s.pipeline_schedule if s.pp > 1 else options[0][0]
        if (schedule, s.virtual_stages) not in options:
            raise SpecError(
                f"{where}: pipeline {pipeline_label(s.pipeline_schedule, s.virtual_stages)} is not"
                f" one of {[pipeline_label(*o) for o in options]}"
            )
        if s.pp == 1 and s.pipeline_schedule != schedule:
            raise SpecError(f"{where}: with pp=1 the space uses the canonical schedule {schedule}")
        # where the space splits layers unevenly, the search may refine a strategy with the
        # pipeline split that balances its blocks' cost (`AnalyticCostModel.balanced_split`):
        # the split is not a parameter of the space, the strategy keeps its parameters
        refined = ("pipeline_split",) if self.config.uneven_pipeline else ()
        unsearched = [
            d.name
            for d in dimensions.DIMENSIONS
            if d.level is None
            and d.kind != dimensions.BATCH
            and d.name not in refined
            and getattr(s, d.name) != d.default
        ]
        if unsearched:
            raise SpecError(f"{where}: the space holds no {' or '.join(unsearched)}")
        axes = self._axes(tuple(getattr(s, n) for n in TREE_LEVELS))
        assert axes is not None
        for name, choices in zip(AXES, axes):
            if getattr(s, name) not in choices:
                raise SpecError(
                    f"{where}: {name}={getattr(s, name)} is not one of {list(choices)}"
                )
        if len(mbs) > 1:
            params[_keyed("micro_batch_size", [str(b) for b in mbs])] = s.micro_batch_size
        if len(options) > 1:
            params[_keyed("pipeline", [pipeline_label(*o) for o in options])] = pipeline_label(
                schedule, s.virtual_stages
            )
        if group:
            return params
        at = tuple(getattr(s, n) for n in TREE_LEVELS)
        chosen = {name: getattr(s, name) for name in AXES}
        if self._combo_rules and tuple(chosen.values()) not in self._combinations(at):
            raise SpecError(f"{where}: its {', '.join(AXES)} do not go together")
        for i, name in enumerate(AXES):
            choices = self._axis_choices(at, axes, {n: chosen[n] for n in AXES[:i]})[i]
            if len(choices) > 1:
                params[self._axis_param(name, choices)] = getattr(s, name)
        return params

    def plain_choices(self) -> dict[str, tuple[Any, ...]]:
        """Every value each Strategy dimension takes in the space, under its plain name (the
        parameter names of a stored trial: `autosearch.tuning._params`), from the tree without
        enumerating it: degrees and micro-batch sizes in increasing order, the other axes in the
        space's own order (so ``tp`` and the axes keep the choices of the sampler's names)."""
        layouts = list(self.layouts())
        order = {s: i for i, s in enumerate(("gpipe", "1f1b", INTERLEAVED))}
        pipelines = sorted(
            {(lay.pipeline_schedule, lay.virtual_stages) for lay in layouts},
            key=lambda o: (order.get(o[0], len(order)), o[1]),
        )
        out: dict[str, tuple[Any, ...]] = {}
        for d in dimensions.DIMENSIONS:
            if d.level in (dimensions.REST, dimensions.MESH, dimensions.FOLDED) or (
                d.name == "micro_batch_size"
            ):
                out[d.name] = tuple(sorted({getattr(lay, d.name) for lay in layouts}))
            elif d.plain == "pipeline":
                out["pipeline"] = tuple(pipeline_label(*o) for o in pipelines)
            elif d.level == dimensions.AXIS:
                out[d.name] = self._axis_union(d.name)
        return out

    def signature(self) -> dict[str, Any]:
        out = super().signature()
        blob = json.dumps(
            {
                "model": self.model.to_dict(),
                "cluster": self.cluster.to_dict(),
                "config": self.config.to_dict(),
            },
            sort_keys=True,
            default=str,
        )
        out["digest"] = hashlib.sha1(blob.encode()).hexdigest()[:12]
        return out

    def describe(self) -> str:
        """One paragraph: what the space contains, for logs and reports."""
        splits = {tuple(getattr(lay, n) for n in dimensions.DEGREES) for lay in self.layouts()}
        axes = " x ".join(
            f"{_AXIS_WORDS.get(name, name)} {list(self._axis_union(name))}"
            for name in AXES
            if name != "sequence_parallel"
            and (name not in QUIET_AXES or len(self._axis_union(name)) > 1)
        )
        return (
            f"{self.size:,} strategies for {self.model.name} on {self.cluster.name} at global"
            f" batch {self.global_batch_size}: {len(splits)} ({', '.join(dimensions.DEGREES)})"
            f" splits, {self.n_groups} layouts with micro-batch and schedule, x {axes}"
            " x sequence parallel where tp > 1"
        )

    def __repr__(self) -> str:
        return (
            f"SearchSpace({self.model.name!r}, {self.cluster.name!r},"
            f" global_batch_size={self.global_batch_size}, size={self.size})"
        )


_AXIS_WORDS = {"zero_stage": "zero"}


def _picker(trial: "optuna.trial.BaseTrial"):
    def pick(name: str, choices: tuple) -> Any:
        return choices[0] if len(choices) == 1 else trial.suggest_categorical(name, choices)

    return pick


def _fmt(values: tuple | None) -> str:
    return "all" if values is None else str(list(values))
