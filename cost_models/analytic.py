"""The analytic cost model: compute, communication, pipeline and memory, term by term.

The mechanisms are pure functions in `cost_models/terms/` (compute, tensor parallel, context
parallel, pipeline, data parallel, memory), each declaring the Strategy fields it reads.
One `AnalyticCostModel` is built per (model, cluster, runtime); it composes the terms into a
CostReport and caches the per-layer costs, keyed by exactly the fields their terms read, so that
scoring a strategy is a few dozen float operations (the search calls it hundreds of thousands of
times).
"""

from __future__ import annotations

import functools
import operator
from typing import TYPE_CHECKING, Any, Callable, Generic, TypeVar

from autosearch.core import rules
from autosearch.core.bands import KIND_READS, error_bands, kind_of
from autosearch.core.errors import SpecError
from autosearch.core.model_spec import check_priced
from autosearch.core.report import CostReport, MemoryBreakdown, TimeBreakdown
from autosearch.core.runtime import RUNTIMES, RuntimeOptions
from cost_models._base import CostModel
from cost_models.terms import (
    KINDS,
    Context,
    LayerCosts,
    compute,
    context_parallel,
    data_parallel,
    fields_read,
    memory,
    offload,
    pipeline,
    tensor_parallel,
)
from cost_models.terms.compute import CAUSAL_FRACTION
from cost_models.terms.layers import KindCosts
from cost_models.terms.layers import kinds as layer_kinds
from cost_models.terms.layers import parts as layer_parts

if TYPE_CHECKING:  # pragma: no cover
    from autosearch.core.hardware import Cluster
    from autosearch.core.model_spec import ModelSpec
    from autosearch.core.strategy import Strategy

__all__ = ["AnalyticCostModel", "CAUSAL_FRACTION", "cache_key", "estimate"]

# One layer's costs: what compute, tensor parallel and context parallel make of it.
LAYER_READS = fields_read(compute.layer, tensor_parallel.layer_comm, context_parallel.layer_comm)
# What `autosearch.core.bands.kind_of` reads of a strategy (its band axes).
BAND_READS = KIND_READS


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """sha256 of the files the analytic model's predictions come from: the `cost_models`
    package (its terms, presets, profiles and bands) and the Engine's ZeRO table it shares."""
    import hashlib
    from pathlib import Path

    import autosearch.core.dp_modes as dp_modes

    root = Path(__file__).resolve().parent
    files = sorted(p for p in root.rglob("*") if p.suffix in (".py", ".yaml"))
    digest = hashlib.sha256()
    for path in [*files, Path(dp_modes.__file__)]:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


class AnalyticCostModel(CostModel):
    """Analytic step time and memory of a decoder-only transformer on a cluster.

    Example:
        >>> from autosearch import Cluster, ModelSpec, Strategy
        >>> from cost_models import AnalyticCostModel
        >>> cm = AnalyticCostModel(ModelSpec.load("llama3-8b"), Cluster.parse("h100-sxm:8x8"))
        >>> s = Strategy(dp=64, micro_batch_size=1, global_batch_size=512, zero_stage=3)
        >>> r = cm.estimate(s)
        >>> r.fits, round(r.mfu, 2) > 0.2
        (True, True)
    """

    def __init__(
        self,
        model: "ModelSpec",
        cluster: "Cluster",
        *,
        runtime: "str | RuntimeOptions | None" = None,
    ):
        check_priced(model)  # MoE, MLA, ... are refused until priced (model_spec.unpriced)
        self.runtime = RuntimeOptions.get(runtime)
        untrained = self.runtime.cannot_train(model)
        if untrained:  # a hybrid under a runtime that has no such layer
            raise SpecError(untrained, context=f"model {model.name!r}")
        self._untrained_mtp = model.mtp_layers if not self.runtime.mtp else 0
        if self._untrained_mtp:  # the runtime trains the model without its MTP modules
            model = model.scaled(mtp_layers=0)
        self.model = model
        self.cluster = cluster
        self.profile = self.runtime.on(cluster.profile)
        self._flops_per_sample = model.flops_per_token() * model.seq_len
        self._link_cache: dict[tuple, tuple[float, float]] = {}
        # the caching allocator's reserve is CUDA's: a CPU holds nothing beyond the tensors
        cuda = self.profile.device_type == "cuda"
        self._allocator_reserve = self.runtime.allocator_reserve_fraction if cuda else 0.0
        ctx = self._context = Context(
            model, self.profile, self.runtime, self._link_for, cluster.nvlink_domain
        )
        framework = self.runtime.framework
        self._layer = _Cached(LAYER_READS, self._compose_layer)
        self._ranks = _Cached(
            fields_read(pipeline.rank_layers), lambda s: pipeline.rank_layers(s, ctx)
        )
        # the heaviest rank's parameters: what the pipeline split puts on it
        self._params = _Cached(
            fields_read(memory.stage_params, pipeline.rank_layers),
            lambda s: memory.stage_params(s, ctx, self._ranks(s)),
        )
        self._activations = _Cached(
            fields_read(memory.layer_activations), lambda s: memory.layer_activations(s, ctx)
        )
        self._band = _Cached(
            BAND_READS, lambda s: error_bands().band(kind_of(s, cluster, framework))
        )
        # the kinds of block besides attention + dense MLP, (mixer, mlp) -> the term that prices
        # what each of its blocks adds (`cost_models.terms.layers`)
        rank_reads = fields_read(pipeline.rank_layers)
        self.kind_terms = {
            kind: KINDS[kind](ctx, self._ranks, _Cached, rank_reads) for kind in layer_kinds(model)
        }
        self._kinds = tuple(self.kind_terms.values())

    @property
    def version(self) -> str:
        """A digest of what the predictions depend on besides the model and the cluster's
        shape: the cost model's code and data (`source_digest`), the hardware profile as
        loaded (a recalibration changes it) and the runtime preset."""
        import hashlib
        import json

        record = [source_digest(), self.cluster.profile.to_dict(), repr(self.runtime)]
        text = json.dumps(record, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    # ---- interconnect ------------------------------------------------------------------------
    def group_link(self, group: int, stride: int) -> tuple[float, float]:
        """(latency_s, bandwidth_bytes_per_s) for a collective over `group` ranks `stride` apart.

        Ranks are laid out pp-major, then dp, then tp (tp neighbours are adjacent, as in
        Megatron-LM
        and torchtitan), so a group stays on NVLink iff group * stride <= the cluster's NVLink
        domain (one node, or a rack of them: GB200 NVL72).
        Across nodes, NCCL runs one ring per NIC: a group with k members per node moves data at
        min(intra-node bandwidth, k x per-GPU network bandwidth) (rail-optimized fabrics, one NIC
        per GPU; NCCL docs, "rings and trees").
        """
        key = (group, stride)
        hit = self._link_cache.get(key)
        if hit is not None:
            return hit
        prof, gpn = self.profile, self.cluster.nvlink_domain
        intra_bw = prof.intra_node.achieved_bandwidth_bytes_per_s
        if group * stride <= gpn:
            link = (prof.intra_node.latency_s, intra_bw)
        else:
            per_node = max(1, min(group, gpn // stride)) if stride < gpn else 1
            link = (
                prof.inter_node.latency_s,
                min(intra_bw, per_node * prof.inter_node.achieved_bandwidth_bytes_per_s),
            )
        _bounded(self._link_cache)[key] = link
        return link

    def _link_for(self, group: int, stride: int, op: str) -> tuple[float, float]:
        latency, bandwidth = self.group_link(group, stride)
        link = (
            self.profile.intra_node
            if group * stride <= self.cluster.nvlink_domain
            else self.profile.inter_node
        )
        return latency, bandwidth * link.op_factor(op)

    # ---- one strategy, term by term ------------------------------------------------------------
    def estimate(self, strategy: "Strategy", *, validate: bool = True) -> CostReport:
        if validate:
            strategy.validate(self.model, self.cluster)
            lacks = self.runtime.lacks(strategy, self.model)
            if lacks:
                raise SpecError(
                    lacks, context=f"strategy {strategy.short()} under runtime {self.runtime.name}"
                )
        s, ctx = strategy, self._context
        layer = self._layer(s)
        ranks = self._ranks(s)
        kinds = tuple([k.costs(s, layer) for k in self._kinds]) if self._kinds else ()
        micro = pipeline.microbatch(s, ctx, layer, ranks, kinds)
        m = s.grad_accum_steps
        trainable = self._trainable(s, ranks)
        heaviest = ranks.index(max(ranks))  # the pipeline rank
        # data-parallel collectives hide behind the rank's blocks as they run: each kind's
        # work too (its share of the rank's blocks)
        window = layer
        for k in kinds:
            share = k.counts[heaviest] / ranks[heaviest] if ranks[heaviest] else 0.0
            window = window._replace(
                fwd_s=window.fwd_s + share * k.fwd_s, bwd_s=window.bwd_s + share * k.bwd_s
            )
        groups = self._param_groups(s, kinds) if kinds else ((self._params(s), None),)
        added = sum([k.counts[heaviest] * k.block_params for k in kinds if k.block_params])
        if added:  # blocks whose mixer or MLP weighs other than the base's
            base_params, group = groups[0]
            total = max(0.0, base_params.total + added)
            groups = ((base_params._replace(total=total), group), *groups[1:])
        rc = micro.recompute_layer_s
        params, _ = groups[0]  # the base group: LoRA's adapters train in it
        dp = data_parallel.cost(s, ctx, params, ranks, window, rc, trainable=trainable)
        optimizer = compute.optimizer_step_s(
            s, ctx, params.total if trainable is None else trainable
        )
        for params, group in groups[1:]:  # a group of its own (the routed experts over edp)
            dp = _add(dp, data_parallel.cost(s, ctx, params, ranks, window, rc, group=group))
            # the optimizer steps over the group's shard of it (ZeRO >= 1)
            own = params.total * s.dp / group[0] if s.zero_stage >= 1 else params.total
            optimizer += compute.optimizer_step_s(s, ctx, own)
        # autocast's casts, of the heaviest rank's blocks as dense and as MoE ones, and of each
        # parameter group; they run inside each micro-batch: the bubble idles for them too
        moe_like = sum([k.counts[heaviest] for k in kinds if k.param_groups]) if kinds else 0
        casts = compute.autocast_casts_s(
            s, ctx, groups[0][0].total, trainable, (ranks[heaviest] - moe_like, moe_like)
        )
        for params, _ in groups[1:]:
            casts += compute.autocast_casts_s(s, ctx, params.total)
        bubble = pipeline.bubble_s(s, micro.total_s + casts / m)
        activations = memory.activation_peak_bytes(s, ctx, ranks, self._activations(s))
        for k in kinds:
            activations += k.activation_bytes
        host_bytes = copies_s = 0.0
        if offload.used(s):
            # the ZeRO-3 shard of each parameter group (the routed experts over their own
            # expert-data-parallel group)
            shard = sum([p.total / (g[0] if g is not None else s.dp * s.cp) for p, g in groups])
            off = offload.cost(
                s,
                ctx,
                dp,
                device_optimizer_s=optimizer,
                param_shard=shard,
                ranks=ranks,
                layer=window,
                recompute_layer_s=rc,
                activations_bytes=activations,
                layer_kept_bytes=self._activations(s).kept_bytes,
            )
            dp, optimizer, activations = off.dp, off.optimizer_s, off.activations_bytes
            host_bytes, copies_s = off.host_bytes, off.copies_exposed_s
        step, time = self._step(m, micro, bubble, dp, optimizer, casts, copies_s)
        return self._compose(s, step, time, dp, activations, host_bytes)

    def balanced_split(self, strategy: "Strategy") -> tuple[int, ...] | None:
        """The pipeline split whose slowest chunk is fastest for `strategy`, by the cost of
        each block (`rules.balanced_split`): a base block's forward, backward, recompute and
        tensor-parallel traffic, what a block of another kind adds to it (`KindCosts.rank_s`
        of one block), the embedding on the first chunk and the output heads (and MTP modules)
        on the last. None where it is the split `strategy` has already, or where pp is 1.
        Unequal blocks (DeepSeek-V3's dense first layers, Llama 4's alternating MoE) and the
        embedding and logits are what make an even split of the blocks uneven in time."""
        s, model = strategy, self.model
        chunks = s.pp * s.virtual_stages
        if s.pp == 1 or chunks > model.n_layers:
            return None
        layer = self._layer(s)
        rc_layer, rc_tp = compute.recompute_repeats(s, layer)
        recomputed = s.recompute != "none" and s.recompute_num_layers is None
        base = layer.fwd_s + layer.bwd_s + 2.0 * layer.tp_comm_fwd_s
        if recomputed:
            base += rc_layer + rc_tp * layer.tp_comm_fwd_s
        added = {
            part: sum(k.rank_s(1, 1.0)) for part, k in zip(self.kind_terms, self._kinds_of(s))
        }
        weights = [
            base + sum(added[part] for part in layer_parts(block.kind)) for block in model.layers
        ]
        first = layer.embedding_s + layer.embedding_comm_s
        heads = pipeline.heads(model) * layer.logits_s
        last = heads + (1 + model.mtp_layers) * layer.logits_comm_s
        last += model.mtp_layers * weights[-1]  # each MTP module: a block of the last's kind
        split = rules.balanced_split(weights, chunks, first=first, last=last)
        return None if split == s.layers_per_chunk(model.n_layers) else split

    def _kinds_of(self, s: "Strategy") -> tuple[KindCosts, ...]:
        layer = self._layer(s)
        return tuple([k.costs(s, layer) for k in self._kinds]) if self._kinds else ()

    def _param_groups(
        self, s: "Strategy", kinds: tuple[KindCosts, ...]
    ) -> "tuple[tuple[memory.StageParams, Any], ...]":
        """The heaviest rank's parameters by data-parallel group: all of them over dp x cp, or
        as a kind splits them (the routed experts over their expert-data-parallel group)."""
        split = [k.param_groups for k in kinds if k.param_groups is not None]
        if len(split) > 1:  # pragma: no cover - one such kind today
            raise NotImplementedError("two kinds of block with their own parameter groups")
        return split[0] if split else ((self._params(s), None),)

    def _step(
        self,
        m: int,
        micro,
        bubble: float,
        dp,
        optimizer: float,
        casts: float,
        offload_s: float = 0.0,
    ):
        """The step time and its breakdown: m micro-batches, the bubble, the exposed
        data-parallel traffic, the optimizer, autocast's parameter and gradient casts (counted
        as compute), the runtime's and device's fixed overhead, and the exposed host-device
        copies of offload."""
        other = self.runtime.step_overhead_s + self.profile.step_overhead_s
        step = m * micro.total_s + bubble + dp.exposed_s + optimizer + casts + other
        if offload_s:
            step += offload_s
        time = TimeBreakdown(
            compute_s=m * micro.compute_s + casts,
            recompute_s=m * micro.recompute_s,
            tp_comm_s=m * micro.tp_comm_s,
            pp_comm_s=m * micro.pp_comm_s,
            dp_comm_exposed_s=dp.exposed_s,
            bubble_s=bubble,
            optimizer_s=optimizer,
            other_s=other,
            offload_s=offload_s,
        )
        return step, time

    def _trainable(self, s: "Strategy", ranks: tuple[int | float, ...]) -> float | None:
        """Parameters that train on the heaviest rank before data-parallel sharding: LoRA's
        adapters of its layers, split over tp as their base layers are; None: all of them."""
        model = self.model
        if model.lora is None:
            return None
        return max(ranks) * model.lora.layer_params(model) / s.tp

    def _compose(
        self,
        s: "Strategy",
        step: float,
        time: TimeBreakdown,
        dp: data_parallel.DataParallelCost,
        activations: float,
        host_bytes: float = 0.0,
    ) -> CostReport:
        tensors = dp.params_bytes + dp.grads_bytes + dp.optimizer_bytes + activations
        mem = MemoryBreakdown(
            params_bytes=dp.params_bytes,
            grads_bytes=dp.grads_bytes,
            optimizer_bytes=dp.optimizer_bytes,
            activations_bytes=activations,
            # the device's reserve, and what the CUDA caching allocator holds beyond live tensors
            other_bytes=self.profile.reserved_memory_bytes + self._allocator_reserve * tensors,
        )
        return self._report(s, step, time, mem, host_bytes)

    def _compose_layer(self, s: "Strategy") -> LayerCosts:
        """One layer and one micro-batch: its compute, and its tensor- and context-parallel
        collectives (the latter hidden behind the attention core)."""
        ctx = self._context
        c = compute.layer(s, ctx)
        tp = tensor_parallel.layer_comm(s, ctx)
        cp = context_parallel.layer_comm(s, ctx, c.attention_fwd_s, c.attention_bwd_s)
        return LayerCosts(
            fwd_s=c.fwd_s,
            bwd_s=c.bwd_s,
            attention_recompute_s=c.attention_recompute_s,
            tp_comm_fwd_s=tp.layer_fwd_s + cp,
            embedding_s=c.embedding_s,
            logits_s=c.logits_s,
            embedding_comm_s=tp.embedding_s,
            logits_comm_s=tp.logits_s,
            op_recompute_s=c.op_recompute_s,
        )

    def _report(
        self,
        strategy: "Strategy",
        step: float,
        time: TimeBreakdown,
        memory: MemoryBreakdown,
        host_bytes: float = 0.0,
    ) -> CostReport:
        prof, model = self.profile, self.model
        peak = (
            memory.params_bytes
            + memory.grads_bytes
            + memory.optimizer_bytes
            + memory.activations_bytes
            + memory.other_bytes
        )
        capacity = prof.memory_capacity_bytes
        world = strategy.world_size
        flops = self._flops_per_sample * strategy.global_batch_size
        notes: tuple[str, ...] = ()
        if strategy.tp > self.cluster.nvlink_domain:
            notes = (
                (
                    f"tp={strategy.tp} spans nodes ({self.cluster.nvlink_domain} devices per"
                    " node): tensor-parallel traffic goes over the network"
                ),
            )
        if self._untrained_mtp:
            training = ", ".join(name for name, r in RUNTIMES.items() if r.mtp)
            notes += (
                f"runtime {self.runtime.name} does not train multi-token prediction: "
                f"{model.name}'s {self._untrained_mtp} MTP module(s) are left out (runtimes"
                f" that train them: {training})",
            )
        host: dict[str, float] = {}
        if host_bytes:  # offload: the node's GPUs share its host memory
            usable = prof.host.memory_bytes - prof.host.reserved_bytes if prof.host else 0.0
            host = {
                "host_memory_bytes": host_bytes * self.cluster.gpus_per_node,
                "host_memory_capacity_bytes": usable,
            }
        report = CostReport(
            band=self._band(strategy),
            step_time_s=step,
            tokens_per_s=strategy.global_batch_size * model.seq_len / step,
            samples_per_s=strategy.global_batch_size / step,
            model_flops_per_step=flops,
            tflops_per_gpu=flops / step / world / 1e12,
            mfu=flops / (step * world * prof.peak_flops[strategy.amp]),
            peak_memory_bytes=peak,
            memory_capacity_bytes=capacity,
            fits=peak <= capacity,
            time=time,
            memory=memory,
            notes=notes,
            **host,
        )
        return report._replace(fits=report.fits_host) if host else report


def _add(a: data_parallel.DataParallelCost, b: data_parallel.DataParallelCost):
    """Two parameter groups' data-parallel costs, field by field."""
    return data_parallel.DataParallelCost(*(x + y for x, y in zip(a, b)))


CACHE_ENTRIES = 65_536  # per cache: a search space has a few hundred layer shapes at most


def _bounded(cache: dict) -> dict:
    """`cache`, emptied first if it is full: a caller sweeping millions of distinct shapes
    (micro-batch sizes, say) stays within a bounded memory (~10 MB per cache)."""
    if len(cache) >= CACHE_ENTRIES:
        cache.clear()
    return cache


def cache_key(fields: tuple[str, ...]) -> Callable[["Strategy"], tuple]:
    """A function giving the values of `fields` of a strategy, in order: the cache key of a term
    that reads these fields (its ``READS``), so that changing any of them misses the cache."""
    get = operator.attrgetter(*fields)
    return get if len(fields) > 1 else lambda strategy: (get(strategy),)


T = TypeVar("T")


class _Cached(Generic[T]):
    """`compute(strategy)`, cached by the strategy fields it reads (`fields`)."""

    def __init__(self, fields: tuple[str, ...], compute: Callable[["Strategy"], T]):
        self.fields = fields
        self._key = cache_key(fields)
        self._compute = compute
        self._results: dict[Any, T] = {}

    def __call__(self, strategy: "Strategy") -> T:
        key = self._key(strategy)
        hit = self._results.get(key)
        if hit is None:
            hit = _bounded(self._results)[key] = self._compute(strategy)
        return hit


@functools.lru_cache(maxsize=128)
def _cached_model(
    model: "ModelSpec", cluster: "Cluster", runtime: RuntimeOptions
) -> AnalyticCostModel:
    return AnalyticCostModel(model, cluster, runtime=runtime)


def estimate(
    model: "ModelSpec | str",
    cluster: "Cluster | str",
    strategy: "Strategy | str",
    *,
    runtime: "str | RuntimeOptions | None" = None,
) -> CostReport:
    """Predict one strategy: `estimate("llama3-8b", "h100-sxm:8x8", "dp=64,zero_stage=3")`.

    The strategy may also be a dict of Strategy fields (``{"dp": 64, "zero_stage": 3}``).

    Accepts specs or the strings their `load` / `parse` take. Raises SpecError (a ValueError)
    naming every rule an invalid strategy breaks.
    """
    from autosearch.core.hardware import Cluster
    from autosearch.core.model_spec import ModelSpec
    from autosearch.core.strategy import Strategy

    model = ModelSpec.load(model)
    cluster = Cluster.parse(cluster)
    if isinstance(strategy, str):
        strategy = Strategy.parse(strategy)
    elif isinstance(strategy, dict):
        strategy = Strategy.from_dict(strategy)
    elif not isinstance(strategy, Strategy):
        raise TypeError(
            "strategy must be a Strategy, a dict of its fields or a 'dp=8,tp=8' string; "
            f"got {type(strategy).__name__}"
        )
    return _cached_model(model, cluster, RuntimeOptions.get(runtime)).estimate(strategy)
