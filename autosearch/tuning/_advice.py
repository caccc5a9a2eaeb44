"""What to change when a strategy does not fit in memory: answers a planner can act on.

Three answers, each found with the cost model and each a strategy or a cluster one can paste:

- `nearby_fixes`: the least change of a strategy that makes it fit. One dimension changed at
  a time first (ZeRO stage up, recompute none -> selective -> full, a smaller micro-batch, tp,
  pp or cp up with dp down on the same devices, sequence parallel on where tp > 1, ...), then
  pairs of such changes when no single one fits; the fastest fitting few of the first level
  that has any.
- `memory_floor_bytes`: the least memory any strategy on a cluster can need per device: the
  model states spread over every device. Above the usable memory, nothing can fit, and no
  search or scan has to say so.
- `smallest_cluster`: the fewest nodes of the same GPU and node shape on which the least
  memory-hungry strategy (`least_memory`) fits, by doubling the node count, then bisecting.

`no_fit_message` composes them into what `autosearch tune` says when nothing fits.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autosearch.core.errors import SpecError
from autosearch.core.strategy import RECOMPUTE, ZERO_STAGES, Strategy

if TYPE_CHECKING:  # pragma: no cover
    from autosearch.core.hardware import Cluster
    from autosearch.core.model_spec import ModelSpec
    from autosearch.core.report import CostReport
    from autosearch.core.runtime import RuntimeOptions
    from autosearch.tuning._margin import MemoryMargin
    from search_spaces import SpaceConfig

GiB = float(1 << 30)
MAX_FIXES = 3  # suggestions shown: the fastest few of the least change that fits
# How much activation memory each recompute keeps, from most to least (Korthikanti et al.
# 2022: selective recompute drops the attention core's activations, full keeps a layer's input).
RECOMPUTE_LEVEL = {"none": 0, "selective": 1, "selective_op": 1, "full": 2}
# A scan of every strategy of a space, to say exactly whether any fits, when the floor cannot
# say it; above this size the answer speaks of the strategies tried (as the search does).
MAX_SCAN = 2_000_000


# ---- records -----------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Fix:
    """A strategy that fits, and the fields it changes of the strategy asked."""

    strategy: Strategy
    report: "CostReport"
    changes: dict[str, Any]

    def label(self) -> str:
        """``zero_stage=3`` or ``dp=8,tp=8``: the changes, as `--strategy` writes them."""
        return ",".join(f"{k}={_text_of(v)}" for k, v in self.changes.items())

    def describe(self, asked: "CostReport") -> str:
        """``zero_stage=3 (71.2 GiB, 12,345 tokens/s, -8% vs asked)``."""
        return (
            f"{self.label()} ({self.report.peak_memory_bytes / GiB:,.1f} GiB, "
            f"{self.report.tokens_per_s:,.0f} tokens/s, {_versus(self.report, asked)} vs asked)"
        )

    def to_dict(self, asked: "CostReport") -> dict[str, Any]:
        return {
            "changes": {k: _plain(v) for k, v in self.changes.items()},
            "strategy": strategy_text(self.strategy),
            "peak_memory_bytes": self.report.peak_memory_bytes,
            "tokens_per_s": self.report.tokens_per_s,
            "tokens_per_s_vs_asked": self.report.tokens_per_s / asked.tokens_per_s - 1.0,
        }


@dataclass(frozen=True, kw_only=True)
class ClusterFit:
    """The smallest cluster found on which a strategy fits, and that strategy."""

    cluster: "Cluster"
    strategy: Strategy
    report: "CostReport"

    def describe(self) -> str:
        """``h100-sxm:16x8 (128 devices): dp=1,tp=8,... fits at 56.8 GiB per device, ...``."""
        return (
            f"{self.cluster.name} ({self.cluster.world_size:,} devices): "
            f"{strategy_text(self.strategy)} fits at {self.report.peak_memory_bytes / GiB:,.1f} "
            f"GiB per device, {self.report.tokens_per_s:,.0f} tokens/s"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "cluster": self.cluster.name,
            "n_nodes": self.cluster.n_nodes,
            "strategy": strategy_text(self.strategy),
            "peak_memory_bytes": self.report.peak_memory_bytes,
            "tokens_per_s": self.report.tokens_per_s,
        }


def strategy_text(s: Strategy) -> str:
    """The ``key=value`` text of `s` that ``--strategy`` reads back (`Strategy.parse`): its
    degrees and global batch, and every other field that is not at its default."""
    parts = []
    for f in dataclasses.fields(Strategy):
        value = getattr(s, f.name)
        if f.name in ("dp", "tp", "pp", "global_batch_size") or value != f.default:
            parts.append(f"{f.name}={_text_of(value)}")
    return ",".join(parts)


def _text_of(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):  # a pipeline split: 15/16/16/15
        return "/".join(map(str, value))
    return str(value)


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _versus(report: "CostReport", asked: "CostReport") -> str:
    return f"{report.tokens_per_s / asked.tokens_per_s - 1.0:+.0%}"


# ---- the least change that fits ----------------------------------------------------------------
def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def memory_moves(s: Strategy) -> Iterator[dict[str, Any]]:
    """Each single change of `s` that can lower its peak memory, as the fields it sets (the
    rules of the model and cluster are checked on the result, not here)."""
    for zero in ZERO_STAGES:
        if zero > s.zero_stage:
            yield {"zero_stage": zero}
    level = RECOMPUTE_LEVEL.get(s.recompute, 0)
    for recompute in RECOMPUTE:
        if RECOMPUTE_LEVEL.get(recompute, 0) > level:
            yield {"recompute": recompute}
    if s.recompute == "full" and s.recompute_num_layers is not None:
        yield {"recompute_num_layers": None}  # every layer, not some
    for mb in _divisors(s.micro_batch_size)[:-1]:
        yield {"micro_batch_size": mb}
    # the same devices in another mesh: dp down, tp / pp / cp up by the same factor
    for name in ("tp", "pp", "cp"):
        for factor in _divisors(s.dp)[1:]:
            move = {name: getattr(s, name) * factor, "dp": s.dp // factor}
            if name == "pp":  # a split of the old pipeline does not split the new one
                move["pipeline_split"] = None
            yield move
    if s.tp > 1 and not s.sequence_parallel:
        yield {"sequence_parallel": True}
    if s.pp > 1 and s.pipeline_schedule == "gpipe":  # 1F1B holds pp micro-batches, not all
        yield {"pipeline_schedule": "1f1b"}
    if s.amp == "fp32":
        yield {"amp": "bf16"}


def nearby_fixes(
    cost_model: Any,
    strategy: Strategy,
    *,
    margin_fraction: float,
    limit: int = MAX_FIXES,
) -> list[Fix]:
    """The least change of `strategy` that makes it fit: the fittest of one change at a time,
    else of two (`memory_moves`), each valid for the model, cluster and runtime and estimated
    by `cost_model`; at most `limit`, the fastest first, one per set of dimensions changed.

    Example:
        >>> from autosearch import Cluster, ModelSpec
        >>> from cost_models import AnalyticCostModel
        >>> cm = AnalyticCostModel(ModelSpec.load("llama3-8b"), Cluster.parse("h100-sxm:1x8"))
        >>> s = Strategy.parse("dp=8,global_batch_size=64")
        >>> [f.label() for f in nearby_fixes(cm, s, margin_fraction=0.1)]
        ['dp=1,tp=8']
    """
    seen = {strategy}
    singles = list(_candidates(strategy, seen))
    fixes = _fitting(cost_model, strategy, singles, margin_fraction)
    if not fixes:
        pairs = [
            (c2, {**m1, **m2})
            for c1, m1 in singles
            for c2, m2 in _candidates(c1, seen)
            if not (set(m1) & set(m2)) - {"dp", "pipeline_split"}
        ]
        fixes = _fitting(cost_model, strategy, pairs, margin_fraction)
    best: dict[frozenset, Fix] = {}
    for fix in fixes:  # the fastest of each set of dimensions changed
        key = frozenset(fix.changes)
        if key not in best or fix.report.tokens_per_s > best[key].report.tokens_per_s:
            best[key] = fix
    return sorted(best.values(), key=lambda f: -f.report.tokens_per_s)[:limit]


def _candidates(s: Strategy, seen: set) -> Iterator[tuple[Strategy, dict[str, Any]]]:
    for move in memory_moves(s):
        try:
            candidate = s.replace(**move)
        except SpecError:
            continue
        if candidate not in seen:
            seen.add(candidate)
            yield candidate, move


def _fitting(
    cost_model: Any,
    asked: Strategy,
    candidates: list[tuple[Strategy, dict[str, Any]]],
    margin_fraction: float,
) -> list[Fix]:
    out = []
    for candidate, _ in candidates:
        try:  # the model's, the cluster's and the runtime's rules
            report = cost_model.estimate(candidate)
        except SpecError:
            continue
        report = report.with_margin(margin_fraction * report.memory_capacity_bytes)
        if report.fits:
            changes = {
                f.name: getattr(candidate, f.name)
                for f in dataclasses.fields(Strategy)
                if getattr(candidate, f.name) != getattr(asked, f.name)
            }
            out.append(Fix(strategy=candidate, report=report, changes=changes))
    return out


@dataclass(frozen=True, kw_only=True)
class FitAdvice:
    """What makes a strategy that does not fit fit (`fit_advice`): the least changes of it that
    do, or, when no nearby one does, the smallest cluster on which the least memory-hungry
    strategy does (None: none up to the largest cluster autosearch models)."""

    asked: "CostReport"
    n_nodes: int  # of the cluster asked
    fixes: list[Fix]
    cluster_fit: ClusterFit | None

    def describe(self) -> str:
        """``does not fit: 228.2 GiB of 72.3 GiB usable; fits with zero_stage=3 (...)``, then
        one ``--strategy`` line to paste per suggestion."""
        r = self.asked
        head = (
            f"does not fit: {r.peak_memory_bytes / GiB:,.1f} GiB of "
            f"{r.memory_usable_bytes / GiB:,.1f} GiB usable"
        )
        if self.fixes:
            changes = "; or ".join(f"with {f.describe(r)}" for f in self.fixes)
            pastes = [f'  --strategy "{strategy_text(f.strategy)}"' for f in self.fixes]
            return "\n".join([f"{head}; fits {changes}", *pastes])
        fit = self.cluster_fit
        if fit is None:
            return (
                f"{head}; no strategy within two changes fits, nor the least memory-hungry "
                "strategy on any number of these nodes: use GPUs with more memory"
            )
        if fit.cluster.n_nodes == self.n_nodes:
            where = "the least memory-hungry strategy fits on this cluster"
        else:
            where = (
                f"the least memory-hungry strategy needs {fit.cluster.n_nodes} nodes (on "
                f"{fit.cluster.n_nodes - 1} it does not fit)"
            )
        return "\n".join(
            [
                f"{head}; nothing within two changes fits, and {where}: on {fit.describe()}",
                f'  --cluster {fit.cluster.name} --strategy "{strategy_text(fit.strategy)}"',
            ]
        )

    def to_dict(self) -> dict[str, Any]:
        """``fits_with`` (the suggestions) and ``smallest_cluster`` (None unless looked for and
        found), as `autosearch estimate --json` adds them."""
        return {
            "fits_with": [f.to_dict(self.asked) for f in self.fixes],
            "smallest_cluster": (
                self.cluster_fit.to_dict() if self.cluster_fit is not None else None
            ),
        }


def fit_advice(
    cost_model: Any,
    strategy: Strategy,
    report: "CostReport",
    *,
    margin_fraction: float,
    config: "SpaceConfig | None" = None,
) -> FitAdvice:
    """The `FitAdvice` of a strategy that does not fit: `nearby_fixes`, else `smallest_cluster`
    over `config` (default: the default space as `cost_model`'s runtime resolves it)."""
    from search_spaces import SpaceConfig

    fixes = nearby_fixes(cost_model, strategy, margin_fraction=margin_fraction)
    fit = None
    model, cluster = cost_model.model, cost_model.cluster
    if not fixes:
        if config is None:
            config, _ = SpaceConfig.default().resolved(
                runtime=cost_model.runtime, model=model, cluster=cluster
            )
        fit = smallest_cluster(
            model,
            cluster,
            strategy.global_batch_size,
            config=config,
            runtime=cost_model.runtime,
            margin_fraction=margin_fraction,
        )
    return FitAdvice(asked=report, n_nodes=cluster.n_nodes, fixes=fixes, cluster_fit=fit)


# ---- what no strategy can go below -------------------------------------------------------------
def state_bytes_per_param(runtime: "RuntimeOptions", *, trains: bool = True) -> float:
    """The fewest bytes of model state one parameter costs under `runtime`, summed over the
    devices that hold its shards: the data-parallel term's (weight, gradient, optimizer)
    bytes (`cost_models.terms.data_parallel.state_bytes`) with 16-bit weights where the runtime
    keeps them in the amp dtype. A frozen parameter (`trains` False: LoRA's base model) keeps
    its weight only."""
    from cost_models.terms.data_parallel import state_bytes

    weight, grad, optimizer = state_bytes(runtime, 2.0)
    return float(weight + grad + optimizer) if trains else float(weight)


def memory_floor_bytes(
    model: "ModelSpec", cluster: "Cluster", runtime: "RuntimeOptions | str | None" = None
) -> float:
    """The least peak memory per device that any strategy on `cluster` can have: every
    parameter's model state stored once, spread evenly over all the devices (ZeRO-3 over the
    whole world, Rajbhandari et al. 2020), plus the device's reserve; no activation, no
    gathered copy, no allocator slack. The busiest device holds at least the average, so a
    floor above the usable memory proves that nothing fits, without a search.

    LoRA counts the frozen weights only (their adapters' states are left out: a floor). The
    multi-token prediction modules are left out too (`ModelSpec.n_params`)."""
    from autosearch.core.runtime import RuntimeOptions

    rt = RuntimeOptions.get(runtime)
    per_param = state_bytes_per_param(rt, trains=model.lora is None)
    return model.n_params * per_param / cluster.world_size + cluster.profile.reserved_memory_bytes


def offload_needed(
    model: "ModelSpec",
    cluster: "Cluster",
    runtime: "RuntimeOptions | str | None" = None,
    *,
    global_batch_size: int | None = None,
    config: "SpaceConfig | None" = None,
    margin_fraction: float = 0.0,
) -> bool:
    """Whether the search opens offload to host memory: where no strategy fits without it.
    The memory floor without offload (`memory_floor_bytes`) above the device proves it; else,
    given the space (`config`, resolved without offload) and the batch, its leanest settings
    (`lean_config`: ZeRO-3, full recompute, the smallest micro-batch ...) over every layout,
    none of which fits the device less the margin (long sequences: activations, not states)."""
    if memory_floor_bytes(model, cluster, runtime) > cluster.profile.memory_capacity_bytes:
        return True
    if config is None or global_batch_size is None:
        return False
    from cost_models import AnalyticCostModel

    try:
        cost_model = AnalyticCostModel(model, cluster, runtime=runtime)
        lean = least_memory(
            model,
            cluster,
            global_batch_size,
            config=config,
            cost_model=cost_model,
            margin_fraction=margin_fraction,
        )
    except SpecError:  # a model this runtime cannot train: the search says so
        return False
    return lean is not None and not lean[1].fits


# The offload dimensions (search_spaces/_config.py `OFFLOAD`): where a space opens them the
# memory floor above is not a bound (the states may live on the host).
OFFLOAD = ("offload_optimizer", "offload_params", "offload_activations")


# ---- the least memory-hungry strategy, and the smallest cluster where it fits -----------------
def lean_config(config: "SpaceConfig") -> "SpaceConfig":
    """`config` narrowed to the settings that hold the least memory, where it offers them: its
    highest ZeRO stage, its fullest recompute, its smallest micro-batch, 16-bit compute, the
    1F1B schedule (pp micro-batches in flight, where GPipe holds all of them and interleaving
    more; Narayanan et al. 2021, sec. 2.2), and async TP off (it moves time, not memory); the
    degrees and the other dimensions stay open."""
    pins: dict[str, Any] = {"zero_stage": max(config.zero_stage)}
    pins["recompute"] = max(config.recompute, key=lambda r: RECOMPUTE_LEVEL.get(r, 0))
    pins["micro_batch_size"] = min(config.micro_batch_size or (1,))
    half = tuple(a for a in config.amp if a != "fp32")
    if half:
        pins["amp"] = list(half)
    if "1f1b" in config.pipeline_schedule:
        pins["pipeline_schedule"] = "1f1b"
    if False in config.async_tp:
        pins["async_tp"] = False
    return config.narrowed(**pins)


def least_memory(
    model: "ModelSpec",
    cluster: "Cluster",
    global_batch_size: int,
    *,
    config: "SpaceConfig",
    cost_model: Any,
    margin_fraction: float,
) -> tuple[Strategy, "CostReport"] | None:
    """The strategy of `lean_config(config)` on `cluster` with the least peak memory (the
    fastest of equals), with its report; None when that space is empty."""
    return _lean_scan(model, cluster, global_batch_size, config, cost_model, margin_fraction).least


@dataclass(frozen=True)
class _Lean:
    least: tuple[Strategy, "CostReport"] | None  # the least peak memory
    fastest_fit: tuple[Strategy, "CostReport"] | None  # the fastest that fits


def _lean_scan(model, cluster, global_batch_size, config, cost_model, margin_fraction) -> _Lean:
    """Every strategy of `lean_config(config)` on `cluster`, estimated once."""
    from search_spaces import SearchSpace

    try:
        space = SearchSpace(
            model, cluster, global_batch_size=global_batch_size, config=lean_config(config)
        )
    except SpecError:  # no layout of these devices splits the batch
        return _Lean(None, None)
    least: tuple[Strategy, CostReport] | None = None
    fastest: tuple[Strategy, CostReport] | None = None
    for s in space.enumerate():
        r = cost_model.estimate(s, validate=False)
        r = r.with_margin(margin_fraction * r.memory_capacity_bytes)
        if least is None or (r.peak_memory_bytes, -r.tokens_per_s) < (
            least[1].peak_memory_bytes,
            -least[1].tokens_per_s,
        ):
            least = (s, r)
        if r.fits and (fastest is None or r.tokens_per_s > fastest[1].tokens_per_s):
            fastest = (s, r)
    return _Lean(least, fastest)


def smallest_cluster(
    model: "ModelSpec",
    cluster: "Cluster",
    global_batch_size: int,
    *,
    config: "SpaceConfig",
    runtime: "RuntimeOptions | str | None",
    margin_fraction: float,
) -> ClusterFit | None:
    """The fewest nodes like `cluster`'s (its GPU, devices per node and NVLink domain) on which
    the least memory-hungry strategy (`least_memory`) fits, with the fastest strategy of the
    lean space (`lean_config`) that fits there: `cluster` itself if one fits there, else by
    doubling the node count until one fits, then bisecting between the last node count that
    did not and the first that did (so one node fewer than the answer does not fit).

    A node count whose `memory_floor_bytes` is above the usable memory is passed without a
    search. None when it fits on no node count up to the largest cluster autosearch models, or
    when doubling the nodes no longer lowers the least peak once the floor is below the usable
    memory (what is left is activations that more devices do not split: the global batch,
    the sequence and the layers bound the degrees)."""
    from autosearch.core._io import MAX_DEVICES
    from cost_models import AnalyticCostModel

    usable = (1.0 - margin_fraction) * cluster.profile.memory_capacity_bytes

    def scan(n_nodes: int) -> tuple[ClusterFit | None, float | None]:
        """(the fastest lean strategy that fits on `n_nodes`, the least peak there); the least
        peak is None when the floor says no, inf when no layout splits the batch."""
        c = dataclasses.replace(cluster, n_nodes=n_nodes)
        if memory_floor_bytes(model, c, runtime) > usable:
            return None, None
        cm = AnalyticCostModel(model, c, runtime=runtime)
        lean = _lean_scan(model, c, global_batch_size, config, cm, margin_fraction)
        if lean.least is None:
            return None, math.inf
        fit = lean.fastest_fit
        least_peak = lean.least[1].peak_memory_bytes
        if fit is None:
            return None, least_peak
        return ClusterFit(cluster=c, strategy=fit[0], report=fit[1]), least_peak

    low = cluster.n_nodes
    fit, peak = scan(low)
    if fit is not None:
        return fit
    max_nodes = MAX_DEVICES // cluster.gpus_per_node
    high = low
    while fit is None:
        if high >= max_nodes:
            return None
        low, high = high, min(2 * high, max_nodes)
        before = peak
        fit, peak = scan(high)
        if fit is None and peak is not None:  # searched (the floor did not pass it)
            if peak == math.inf or (before is not None and peak >= before):
                return None  # no layout splits the batch, or more nodes no longer help
    while high - low > 1:  # low does not fit, high does
        mid = (low + high) // 2
        found, _ = scan(mid)
        if found is None:
            low = mid
        else:
            high, fit = mid, found
    return fit


# ---- what `autosearch tune` says when nothing fits ---------------------------------------------
def no_fit_message(
    space: Any,
    cost_model: Any,
    margin: "MemoryMargin",
    *,
    n_trials: int,
    least_hungry: tuple[Strategy, "CostReport"] | None,
) -> str:
    """Why no strategy of `space` fits, how far the least memory-hungry one is, and the
    smallest cluster on which it fits.

    "No strategy fits" is said when the memory floor proves it (`memory_floor_bytes`, no scan),
    else after a scan of every strategy of the space finds none (spaces up to `MAX_SCAN`; a
    larger one speaks of the strategies tried, as the search does). A space holding a fitting
    strategy that the trials missed gets "run more trials", naming it.
    """
    from cost_models import AnalyticCostModel

    model, cluster, gbs = space.model, space.cluster, space.global_batch_size
    analytic = isinstance(cost_model, AnalyticCostModel)
    runtime = cost_model.runtime if analytic else None
    fraction = margin.fraction
    capacity = cluster.profile.memory_capacity_bytes
    usable = (1.0 - fraction) * capacity
    floor = memory_floor_bytes(model, cluster, runtime) if analytic else 0.0
    config = getattr(space, "config", None)
    candidates = [least_hungry] if least_hungry is not None else []
    where = "tried"
    if config is not None:
        lean = least_memory(
            model, cluster, gbs, config=config, cost_model=cost_model, margin_fraction=fraction
        )
        if lean is not None and lean[1].fits:
            return _run_more(n_trials, lean[0])
        if lean is not None:
            candidates.append(lean)
            where = "found (the trials', and over every layout the space's leanest settings')"
    if floor <= usable and space.size <= MAX_SCAN:  # only the strategies themselves can say
        where = f"of all {space.size:,} in the space"
        least: tuple[Strategy, CostReport] | None = None
        for s in space.enumerate():
            r = cost_model.estimate(s, validate=False).with_margin(fraction * capacity)
            if r.fits:
                return _run_more(n_trials, s)
            if least is None or r.peak_memory_bytes < least[1].peak_memory_bytes:
                least = (s, r)
        candidates = [least] if least is not None else candidates
    lines = [
        f"no strategy fits in memory: {model.name} ({model.n_params / 1e9:.1f} B parameters) "
        f"on {cluster.name} at global batch {gbs}, with {usable / GiB:.1f} GiB usable per "
        f"device ({capacity / GiB:.1f} GiB less a {fraction:.1%} margin)."
    ]
    offloads = config is not None and any(
        len(getattr(config, name) or ()) > 1 or getattr(config, name) not in ((False,), ("none",))
        for name in OFFLOAD
    )
    if floor > usable and offloads:
        lines.append(
            f"Without offload to host memory any strategy needs at least {floor / GiB:,.1f} GiB "
            f"per device (the model states of every parameter spread over all "
            f"{cluster.world_size:,} devices); the space offloads to the host, whose memory "
            "bounds it instead."
        )
    elif floor > usable:
        lines.append(
            f"Any strategy needs at least {floor / GiB:,.1f} GiB per device: the model states of "
            f"every parameter spread over all {cluster.world_size:,} devices."
        )
    if not candidates:
        return " ".join(lines + ["No trial finished."])
    s, r = min(candidates, key=lambda c: c[1].peak_memory_bytes)
    if r.memory_excess_bytes == 0 and not r.host_fits:  # the device fits, the host does not
        lines.append(
            f"The least memory-hungry strategy {where}, {s.short()}, needs "
            f"{r.peak_memory_bytes / GiB:,.1f} GiB per device, which fits, but "
            f"{r.host_memory_bytes / GiB:,.1f} GiB of host memory per node, "
            f"{(r.host_memory_bytes - r.host_memory_capacity_bytes) / GiB:,.1f} GiB over the "
            f"{r.host_memory_capacity_bytes / GiB:,.1f} GiB the host can give."
        )
    else:
        lines.append(
            f"The least memory-hungry strategy {where}, {s.short()}, needs "
            f"{r.peak_memory_bytes / GiB:,.1f} GiB per device, "
            f"{r.memory_excess_bytes / GiB:,.1f} GiB over the usable "
            f"(x{r.peak_memory_bytes / usable:.2f})."
        )
    fit = None
    if config is not None and analytic:
        fit = smallest_cluster(
            model, cluster, gbs, config=config, runtime=runtime, margin_fraction=fraction
        )
    advice = _space_advice(config)
    if fit is None:
        return " ".join(lines + [f"Use more nodes, or GPUs with more memory{advice}."])
    fewer = dataclasses.replace(cluster, n_nodes=fit.cluster.n_nodes - 1)
    lines.append(
        f"The least memory-hungry strategy needs {fit.cluster.n_nodes} nodes (on {fewer.name} it "
        f"does not fit): on {fit.describe()}. Use {fit.cluster.n_nodes} nodes or more, or GPUs "
        f"with more memory{advice}."
    )
    return " ".join(lines)


def _run_more(n_trials: int, fits: Strategy) -> str:
    return (
        f"none of the {n_trials} trials found a strategy that fits, but the space holds one "
        f"that does ({fits.short()}, for one); run more trials (--n-trials) or the exhaustive "
        "sampler"
    )


def _space_advice(config: "SpaceConfig | None") -> str:
    """'; or widen the space (...)' for the settings that hold less memory and that the
    space leaves out (a pin or a space file); nothing when it has them all."""
    if config is None:
        return ""
    wider = []
    if 3 not in config.zero_stage:
        wider.append("zero_stage 3")
    if "full" not in config.recompute:
        wider.append("recompute full")
    if config.micro_batch_size is not None and 1 not in config.micro_batch_size:
        wider.append("micro_batch_size 1")
    if config.pp is not None:
        wider.append("larger pp")
    return f"; or widen the space ({', '.join(wider)})" if wider else ""
