"""SearchSpace: every valid parallel strategy for a model on a cluster at a global batch size.

The space is built once, as a tree whose every leaf is valid by construction:

    tp -> pp -> micro_batch_size -> pipeline (schedule, virtual stages)      [the "layout"]
    x recompute x sequence_parallel (tp > 1 only) x zero_stage x amp        [independent axes]

Layout rules: the functions of `autosearch.core.rules`, the same ones `Strategy.problems` composes,
applied level by level: tp divides n_heads and n_kv_heads (and stays
inside a node unless `tp_within_node` is off); pp divides n_layers and world/tp; dp =
world/(tp*pp);
micro_batch_size splits global_batch/dp into m micro-batches with m >= pp when pp > 1 (a pipeline
needs one micro-batch per stage to fill); interleaved 1F1B needs pp*v to divide n_layers and m to
be
a multiple of pp (Narayanan et al. 2021, sec. 2.2). Branches with no valid leaf are pruned, so a
sampler walking the tree can never reach an invalid strategy.

How Optuna samples it (`suggest`): one categorical parameter per tree level, in order. A level's
choices depend on the choices above it (the micro-batch sizes that split the batch depend on dp),
so the parameter *name carries its choice list*, e.g. ``micro_batch_size[1,2,4]``: the same name
always has the same choices, in every trial and every process, as Optuna requires of a
distribution; and layouts that share a choice list share a parameter, so TPE pools what it
learns about, say, micro-batch sizes across all the meshes that admit the same sizes. The four
independent axes are plain parameters (``recompute``, ``zero_stage``, ``amp``, and
``sequence_parallel`` when tp > 1). A level with a single choice is not sampled at all.

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
from typing import TYPE_CHECKING, Any, NamedTuple

from autosearch.core import rules
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


class Layout(NamedTuple):
    """What a trial of the layout kind samples; every other axis is scanned inside the trial."""

    dp: int
    tp: int
    pp: int
    micro_batch_size: int
    pipeline_schedule: str
    virtual_stages: int
    cp: int = 1


def pipeline_label(schedule: str, virtual_stages: int) -> str:
    """The categorical value of a pipeline option: ``1f1b``, ``gpipe``, ``interleaved_1f1b_v2``."""
    return f"{INTERLEAVED}_v{virtual_stages}" if schedule == INTERLEAVED else schedule


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _keyed(dim: str, labels: list[str]) -> str:
    """Parameter name that carries its choice list: ``micro_batch_size[1,2,4]``."""
    return f"{dim}[{','.join(labels)}]"


class SearchSpace(BaseSearchSpace):
    """Every valid strategy for (model, cluster, global batch size), narrowed by pins.

    Args:
        model: a ModelSpec or a catalog name / YAML path.
        cluster: a Cluster or its text form (``h100-sxm:32x8``).
        global_batch_size: sequences per optimizer step.
        config: a SpaceConfig, or a space YAML (path or shipped name such as ``megatron``);
            defaults to ``search_spaces/default.yaml``.
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
        c, m, world = self.config, self.model, self.cluster.world_size
        gpn = self.cluster.nvlink_domain  # tp stays on NVLink: a node, or a rack (GB200 NVL72)
        peaks = self.cluster.profile.peak_flops
        # Preference order, so that among equally fast strategies bf16 comes first.
        self.amps = tuple(a for a in ("bf16", "fp16", "fp32") if a in c.amp and a in peaks)
        if not self.amps:
            raise SpecError(
                f"amp {', '.join(c.amp)} not supported by hardware profile"
                f" {self.cluster.profile.name!r} (it has peaks for"
                f" {', '.join(peaks)}); allow one of those"
            )
        self.recomputes, self.zero_stages = c.recompute, c.zero_stage
        # fp8 only on hardware with fp8 units; compile as allowed
        self.fp8s = tuple(f for f in c.fp8 if rules.fp8_problem(f, peaks) is None) or ("none",)
        self.compiles = c.compile
        dropped: list[str] = []  # why candidate values were dropped, for the empty-space message

        # The layout rules are those of Strategy.problems, applied level by level.
        tps = [t for t in _divisors(world) if rules.tp_problem(t, m) is None]
        if c.tp_within_node:
            tps = [t for t in tps if t <= gpn]
        if c.tp is not None:
            tps = [t for t in tps if t in c.tp]
        # `sequence_parallel: true` needs tp > 1
        tps = [t for t in tps if self._sequence_parallel_choices(t)]
        dropped.append(
            f"tp in {tps} (divides {world} devices, n_heads={m.n_heads}, n_kv_heads={m.n_kv_heads}"
            + (f", <= {gpn} per node" if c.tp_within_node else "")
            + ")"
        )

        schedules_pp1 = [str(s) for s in ("1f1b", "gpipe") if s in c.pipeline_schedule][:1]
        Tree = dict[int, dict[int, dict[int, dict[int, tuple[tuple[str, int], ...]]]]]
        tree: Tree = {}
        for tp in tps:
            for cp in _divisors(world // tp):
                if (c.cp is not None and cp not in c.cp) or rules.context_parallel_problem(
                    cp, m.seq_len
                ) is not None:
                    continue
                for pp in _divisors(world // (tp * cp)):
                    dp = world // (tp * cp * pp)
                    if (
                        rules.layers_problem(pp, 1, m, uneven=c.uneven_pipeline) is not None
                        or (c.pp is not None and pp not in c.pp)
                        or (c.dp is not None and dp not in c.dp)
                    ):
                        continue
                    if pp == 1 and not schedules_pp1:
                        continue
                    mbs = self._micro_batches(dp, pp, schedules_pp1)
                    if mbs:
                        tree.setdefault(tp, {}).setdefault(cp, {})[pp] = mbs
        if not tree:
            raise SpecError(self._empty_message(tps, dropped), context="search space is empty")
        self._tree = tree
        self._sp_choices = {tp: self._sequence_parallel_choices(tp) for tp in tree}
        self._async_choices = {
            tp: tuple(a for a in c.async_tp if rules.async_tp_problem(a, tp) is None) or (False,)
            for tp in tree
        }
        self.tps = tuple(sorted(tree))
        # The size, counted per layout: leaves x independent axes.
        other = (
            len(self.recomputes)
            * len(self.zero_stages)
            * len(self.amps)
            * len(self.fp8s)
            * len(self.compiles)
        )
        self._n_layouts = sum(len(opts) for _, opts in self._leaves())
        self._size = sum(
            len(opts) * len(self._sp_choices[tp]) * len(self._async_choices[tp]) * other
            for (tp, _, _, _), opts in self._leaves()
        )

    def _micro_batches(
        self, dp: int, pp: int, schedules_pp1: list[str]
    ) -> dict[int, tuple[tuple[str, int], ...]]:
        c, gbs = self.config, self.global_batch_size
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
            options = self._pipeline_options(pp, n_micro, schedules_pp1)
            if options:
                mbs[mb] = options
        return mbs

    def _leaves(self) -> Iterator[tuple[tuple[int, int, int, int], tuple[tuple[str, int], ...]]]:
        """((tp, cp, pp, micro_batch_size), pipeline options) of every branch of the tree."""
        for tp, cps in self._tree.items():
            for cp, pps in cps.items():
                for pp, mbs in pps.items():
                    for mb, options in mbs.items():
                        yield (tp, cp, pp, mb), options

    def _pipeline_options(
        self, pp: int, n_micro: int, schedules_pp1: list[str]
    ) -> tuple[tuple[str, int], ...]:
        c, layers = self.config, self.model.n_layers
        if pp == 1:
            return ((schedules_pp1[0], 1),)
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

    def _sequence_parallel_choices(self, tp: int) -> tuple[bool, ...]:
        allowed = self.config.sequence_parallel
        if rules.sequence_parallel_problem(True, tp, self.model.seq_len) is not None:
            return (False,) if False in allowed else ()
        return allowed

    def _empty_message(self, tps: list[int], dropped: list[str]) -> str:
        c, m, world, gbs = self.config, self.model, self.cluster.world_size, self.global_batch_size
        if not tps:
            return (
                f"no tensor-parallel degree is allowed for {m.name} on {self.cluster.name}:"
                f" {dropped[0]}; pins tp={list(c.tp) if c.tp else 'all'},"
                f" tp_within_node={c.tp_within_node}. Widen tp or set tp_within_node: false"
            )
        return (
            f"no (dp, tp, pp, micro_batch_size, schedule) of {world} devices splits"
            f" global_batch_size={gbs} for {m.name} ({m.n_layers} layers): {dropped[0]}; pp must"
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
        """Number of layouts (dp, tp, pp, cp, micro-batch, schedule): the groups of
        `suggest_group`."""
        return self._n_layouts

    def layouts(self) -> Iterator[Layout]:
        """Every valid layout: (dp, tp, pp, micro_batch_size, schedule, virtual_stages, cp)."""
        world = self.cluster.world_size
        for (tp, cp, pp, mb), options in self._leaves():
            for schedule, v in options:
                yield Layout(world // (tp * cp * pp), tp, pp, mb, schedule, v, cp)

    def group_params(self, *, every: int = 1) -> Iterator[dict[str, Any]]:
        """The trial parameters of every layout (of every `every`-th), in `layouts` order. One
        strategy of each is built to name them: 1,740 instead of the 99,180 strategies of GPT-3
        175B on 384 GPUs, and none for the layouts skipped."""
        for layout in itertools.islice(self.layouts(), 0, None, every):
            yield self.params_of(next(self._group(layout)), group=True)

    def _group(self, layout: Layout) -> Iterator[Strategy]:
        """The strategies of one layout: every combination of the independent axes."""
        for rc in self.recomputes:
            for sp in self._sp_choices[layout.tp]:
                for zero in self.zero_stages:
                    for amp in self.amps:
                        for fp8 in self.fp8s:
                            for compiled in self.compiles:
                                for async_tp in self._async_choices[layout.tp]:
                                    yield self._strategy(
                                        layout,
                                        recompute=rc,
                                        sequence_parallel=sp,
                                        zero_stage=zero,
                                        amp=amp,
                                        fp8=fp8,
                                        compile=compiled,
                                        async_tp=async_tp,
                                    )

    def _strategy(self, layout: Layout, **axes: Any) -> Strategy:
        return Strategy(
            dp=layout.dp,
            tp=layout.tp,
            pp=layout.pp,
            cp=layout.cp,
            micro_batch_size=layout.micro_batch_size,
            global_batch_size=self.global_batch_size,
            pipeline_schedule=layout.pipeline_schedule,
            virtual_stages=layout.virtual_stages,
            **axes,
        )

    def enumerate(self) -> Iterator[Strategy]:
        for layout in self.layouts():
            yield from self._group(layout)

    def suggest(self, trial: "optuna.trial.BaseTrial") -> Strategy:
        layout = self._suggest_layout(trial)
        pick = _picker(trial)
        recompute = pick("recompute", self.recomputes)
        sp_choices = self._sp_choices[layout.tp]
        sp = (
            pick("sequence_parallel", sp_choices) if sp_choices == (False, True) else sp_choices[0]
        )
        zero = pick("zero_stage", self.zero_stages)
        amp = pick("amp", self.amps)
        fp8 = pick("fp8", self.fp8s)
        compiled = pick("compile", self.compiles)
        async_choices = self._async_choices[layout.tp]
        async_tp = pick("async_tp", async_choices) if len(async_choices) > 1 else async_choices[0]
        return self._strategy(
            layout,
            recompute=recompute,
            sequence_parallel=sp,
            zero_stage=zero,
            amp=amp,
            fp8=fp8,
            compile=compiled,
            async_tp=async_tp,
        )

    def suggest_group(self, trial: "optuna.trial.BaseTrial") -> tuple[Strategy, ...]:
        """Sample a layout (tp, cp, pp, micro-batch, schedule); return it with every
        combination of recompute x sequence parallel x ZeRO stage x amp (x fp8, compile and
        async TP where allowed)."""
        return tuple(self._group(self._suggest_layout(trial)))

    def _suggest_layout(self, trial: "optuna.trial.BaseTrial") -> Layout:
        pick = _picker(trial)
        tp = pick("tp", self.tps)
        cps = self._tree[tp]
        cp = pick(_keyed("cp", [str(c) for c in cps]), tuple(cps))
        pps = cps[cp]
        pp = pick(_keyed("pp", [str(p) for p in pps]), tuple(pps))
        mbs = pps[pp]
        mb = pick(_keyed("micro_batch_size", [str(b) for b in mbs]), tuple(mbs))
        options = mbs[mb]
        labels = tuple(pipeline_label(s, v) for s, v in options)
        label = pick(_keyed("pipeline", list(labels)), labels)
        schedule, v = options[labels.index(label)]
        return Layout(self.cluster.world_size // (tp * cp * pp), tp, pp, mb, schedule, v, cp)

    def params_of(self, strategy: Strategy, *, group: bool = False) -> dict[str, Any]:
        s = strategy
        where = f"strategy {s.short()} is not in this search space"
        cps = self._tree.get(s.tp)
        if cps is None:
            raise SpecError(f"{where}: tp={s.tp} is not one of {list(self.tps)}")
        pps = cps.get(s.cp)
        if pps is None:
            raise SpecError(f"{where}: cp={s.cp} is not one of {list(cps)} for tp={s.tp}")
        mbs = pps.get(s.pp)
        if mbs is None or s.world_size != self.cluster.world_size:
            raise SpecError(
                f"{where}: (dp, tp, pp, cp) = ({s.dp}, {s.tp}, {s.pp}, {s.cp}) is not a valid"
                " split here"
            )
        if s.global_batch_size != self.global_batch_size:
            raise SpecError(
                f"{where}: global_batch_size {s.global_batch_size} != {self.global_batch_size}"
            )
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
        if s.recompute_num_layers is not None or s.pipeline_split is not None:
            raise SpecError(f"{where}: the space holds no recompute_num_layers or pipeline_split")
        axes = (
            ("recompute", s.recompute, self.recomputes),
            ("sequence_parallel", s.sequence_parallel, self._sp_choices[s.tp]),
            ("zero_stage", s.zero_stage, self.zero_stages),
            ("amp", s.amp, self.amps),
            ("fp8", s.fp8, self.fp8s),
            ("compile", s.compile, self.compiles),
            ("async_tp", s.async_tp, self._async_choices[s.tp]),
        )
        for name, value, choices in axes:
            if value not in choices:
                raise SpecError(f"{where}: {name}={value} is not one of {list(choices)}")
        params: dict[str, Any] = {}
        if len(self.tps) > 1:
            params["tp"] = s.tp
        if len(cps) > 1:
            params[_keyed("cp", [str(c) for c in cps])] = s.cp
        if len(pps) > 1:
            params[_keyed("pp", [str(p) for p in pps])] = s.pp
        if len(mbs) > 1:
            params[_keyed("micro_batch_size", [str(b) for b in mbs])] = s.micro_batch_size
        if len(options) > 1:
            params[_keyed("pipeline", [pipeline_label(*o) for o in options])] = pipeline_label(
                schedule, s.virtual_stages
            )
        if group:
            return params
        for name, value, choices in axes:
            if len(choices) > 1:
                params[name] = value
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

        def union(choices: dict[int, tuple]) -> tuple:
            return tuple(dict.fromkeys(v for tp in self.tps for v in choices[tp]))

        return {
            "dp": tuple(sorted({lay.dp for lay in layouts})),
            "tp": self.tps,
            "pp": tuple(sorted({lay.pp for lay in layouts})),
            "cp": tuple(sorted({lay.cp for lay in layouts})),
            "micro_batch_size": tuple(sorted({lay.micro_batch_size for lay in layouts})),
            "pipeline": tuple(pipeline_label(*o) for o in pipelines),
            "recompute": self.recomputes,
            "sequence_parallel": union(self._sp_choices),
            "zero_stage": self.zero_stages,
            "amp": self.amps,
            "fp8": self.fp8s,
            "compile": self.compiles,
            "async_tp": union(self._async_choices),
        }

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
        splits = {(lay.dp, lay.tp, lay.pp, lay.cp) for lay in self.layouts()}
        extra = "".join(
            f" x {name} {list(values)}"
            for name, values in (("fp8", self.fp8s), ("compile", self.compiles))
            if len(values) > 1
        )
        return (
            f"{self.size:,} strategies for {self.model.name} on {self.cluster.name} at global"
            f" batch {self.global_batch_size}: {len(splits)} (dp, tp, pp, cp) splits,"
            f" {self.n_groups} layouts with micro-batch and schedule, x recompute"
            f" {list(self.recomputes)} x zero {list(self.zero_stages)} x amp {list(self.amps)}"
            f"{extra} x sequence parallel where tp > 1"
        )

    def __repr__(self) -> str:
        return (
            f"SearchSpace({self.model.name!r}, {self.cluster.name!r},"
            f" global_batch_size={self.global_batch_size}, size={self.size})"
        )


def _picker(trial: "optuna.trial.BaseTrial"):
    def pick(name: str, choices: tuple) -> Any:
        return choices[0] if len(choices) == 1 else trial.suggest_categorical(name, choices)

    return pick


def _fmt(values: tuple | None) -> str:
    return "all" if values is None else str(list(values))
