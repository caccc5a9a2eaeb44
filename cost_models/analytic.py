"""The analytic cost model: compute, communication, pipeline and memory, term by term.

One `AnalyticCostModel` is built per (model, cluster, runtime); it caches the per-layer costs that
depend only on (tp, micro-batch, precision, ...) so that scoring a strategy is a few dozen float
operations (the search calls it hundreds of thousands of times).

Conventions: T = micro_batch_size * seq_len tokens per micro-batch; t, p, d, v = tp, pp, dp,
virtual stages; m = micro-batches per step; Ls = layers per pipeline rank; all per device.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, NamedTuple

from autosearch.core.dp_modes import dp_mode
from autosearch.core.errors import SpecError
from autosearch.core.report import CostReport, MemoryBreakdown, TimeBreakdown
from autosearch.core.runtime import RuntimeOptions
from cost_models._base import CostModel
from cost_models.formulas import (
    layer_activation_bytes,
    microbatches_in_flight,
    p2p_time_s,
    ring_all_gather_time_s,
    ring_all_reduce_time_s,
    ring_reduce_scatter_time_s,
)

if TYPE_CHECKING:  # pragma: no cover
    from autosearch.core.hardware import Cluster
    from autosearch.core.model_spec import ModelSpec
    from autosearch.core.strategy import Strategy

ACT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "tf32": 4}
# A causal mask lets fused attention skip half of the tiles (Dao 2023, sec. 3.1). Its backward
# costs `attention_backward_over_forward` times its forward: 2.5 by default, FlashAttention-2
# doing 5 GEMMs per tile backward vs 2 forward (Dao 2023, sec. 3.2); calibration measures it.
CAUSAL_FRACTION = 0.5
# Adam step, fused: read param, grad, m, v (fp32) and write param, m, v = 28 bytes per parameter
# (Kingma & Ba 2015 update; bytes as in the ZeRO paper's 16-bytes-per-parameter accounting).
ADAM_BYTES_PER_PARAM = 28


class LayerCosts(NamedTuple):
    """One transformer layer and one micro-batch on one device (seconds), plus the embedding and
    logits work of the first and last pipeline stage."""

    fwd_s: float
    bwd_s: float
    attention_recompute_s: float  # what selective recompute repeats: the attention core
    tp_comm_fwd_s: float  # exposed tensor-parallel collectives of one forward
    embedding_s: float  # forward + backward
    logits_s: float  # forward + backward, with the loss
    embedding_comm_s: float
    logits_comm_s: float


class MicrobatchTime(NamedTuple):
    """One micro-batch on the slowest pipeline rank (seconds)."""

    compute_s: float
    recompute_s: float
    tp_comm_s: float
    pp_comm_s: float
    recompute_layer_s: float  # recompute of one layer (bounds what data parallelism can hide)

    @property
    def total_s(self) -> float:
        return self.compute_s + self.recompute_s + self.tp_comm_s + self.pp_comm_s


class StageParams(NamedTuple):
    """Parameters one device holds before data-parallel sharding."""

    total: float  # the heaviest pipeline stage
    per_layer: float


class DataParallelCost(NamedTuple):
    """Exposed data-parallel time and the model states' memory on one device."""

    exposed_s: float
    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float


class AnalyticCostModel(CostModel):
    """Analytic step time and memory of a decoder-only transformer on a cluster.

    Example:
        >>> from autosearch import ModelSpec, Strategy
        >>> from cost_models import AnalyticCostModel, Cluster
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
        self.model = model
        self.cluster = cluster
        self.runtime = RuntimeOptions.get(runtime)
        self.profile = cluster.profile
        self._flops_per_sample = model.flops_per_token() * model.seq_len
        self._layer_cache: dict[tuple, LayerCosts] = {}
        self._act_cache: dict[tuple, float] = {}
        self._link_cache: dict[tuple, tuple[float, float]] = {}

    # ---- interconnect ------------------------------------------------------------------------
    def group_link(self, group: int, stride: int) -> tuple[float, float]:
        """(latency_s, bandwidth_bytes_per_s) for a collective over `group` ranks `stride` apart.

        Ranks are laid out pp-major, then dp, then tp (tp neighbours are adjacent, as in
        Megatron-LM
        and torchtitan), so a group stays inside a node iff group * stride <= gpus_per_node.
        Across nodes, NCCL runs one ring per NIC: a group with k members per node moves data at
        min(intra-node bandwidth, k x per-GPU network bandwidth) (rail-optimized fabrics, one NIC
        per GPU; NCCL docs, "rings and trees").
        """
        key = (group, stride)
        hit = self._link_cache.get(key)
        if hit is not None:
            return hit
        prof, gpn = self.profile, self.cluster.gpus_per_node
        intra_bw = prof.intra_node.achieved_bandwidth_bytes_per_s
        if group * stride <= gpn:
            link = (prof.intra_node.latency_s, intra_bw)
        else:
            per_node = max(1, min(group, gpn // stride)) if stride < gpn else 1
            link = (
                prof.inter_node.latency_s,
                min(intra_bw, per_node * prof.inter_node.achieved_bandwidth_bytes_per_s),
            )
        self._link_cache[key] = link
        return link

    def _link_for(self, group: int, stride: int, op: str) -> tuple[float, float]:
        latency, bandwidth = self.group_link(group, stride)
        link = (
            self.profile.intra_node
            if group * stride <= self.cluster.gpus_per_node
            else self.profile.inter_node
        )
        return latency, bandwidth * link.op_factor(op)

    def _all_reduce(self, nbytes: float, group: int, stride: int) -> float:
        if group <= 1:
            return 0.0
        return ring_all_reduce_time_s(nbytes, group, *self._link_for(group, stride, "all_reduce"))

    def _all_gather(self, nbytes: float, group: int, stride: int) -> float:
        if group <= 1:
            return 0.0
        return ring_all_gather_time_s(nbytes, group, *self._link_for(group, stride, "all_gather"))

    def _reduce_scatter(self, nbytes: float, group: int, stride: int) -> float:
        if group <= 1:
            return 0.0
        return ring_reduce_scatter_time_s(
            nbytes, group, *self._link_for(group, stride, "reduce_scatter")
        )

    # ---- one layer, one micro-batch ------------------------------------------------------------
    def _layer_costs(self, tp: int, mb: int, precision: str, sp: bool) -> LayerCosts:
        """One layer and one micro-batch, cached by (tp, micro-batch, precision, sp)."""
        key = (tp, mb, precision, sp)
        hit = self._layer_cache.get(key)
        if hit is not None:
            return hit
        m, prof, rt = self.model, self.profile, self.runtime
        try:
            peak = prof.peak_flops[precision]
        except KeyError:
            raise SpecError(
                f"hardware profile {prof.name!r} has no peak for {precision}; "
                f"use amp one of {', '.join(prof.peak_flops)}"
            ) from None
        gemm = prof.gemm
        s, h, f, V, t = m.seq_len, m.hidden_size, m.ffn_hidden_size, m.vocab_size, tp
        T = mb * s
        ab = ACT_BYTES[precision]
        heads = m.n_heads / t
        launch = prof.kernel_launch_s

        def gemm_s(rows: float, cols: float, inner: float) -> float:
            return gemm.time_s(rows, cols, inner, peak, precision)

        # Block GEMMs, Megatron-LM partitioning (Shoeybi et al. 2019, sec. 3): QKV and the first
        # MLP
        # matrix split by columns, the output projection and second MLP matrix by rows.
        qkv = gemm_s(T, (h + 2 * m.kv_hidden_size) / t, h)
        proj = gemm_s(T, h, h / t)
        fc1 = gemm_s(T, (2 if not m.is_gpt_style else 1) * f / t, h)
        fc2 = gemm_s(T, h, f / t)
        gemm_fwd = qkv + proj + fc1 + fc2

        # Attention core: QK^T and softmax(.)V, 2 * 2 * s^2 * d FLOPs per head and sequence.
        if rt.flash_attention:
            flops = 4.0 * mb * s * s * h / t * CAUSAL_FRACTION
            attn_fwd = launch + flops / (peak * prof.attention_efficiency.get(precision, 0.5))
            attn_bwd = prof.attention_backward_over_forward * attn_fwd
            softmax_bytes = 0.0
        else:
            rows = mb * heads * s  # batched over sequences and local heads
            attn_fwd = gemm_s(rows, s, m.head_dim) + gemm_s(rows, m.head_dim, s)
            attn_bwd = gemm.backward_over_forward * attn_fwd
            # Fused scale-mask-softmax (read + write) and attention dropout (read, write, 1-byte
            # mask).
            mask = 1.0 if m.is_gpt_style else 0.0
            softmax_bytes = rows * s * (2 * ab + mask * (2 * ab + 1))
        # Memory-bound elementwise work per layer forward (bytes moved), backward taken as 2x:
        # two norms (read + write), two residual adds with bias-dropout (read 2, write 1, mask),
        # the MLP activation (gelu: read + write sbf; SwiGLU: read 2 sbf, write 1), rotary on q, k.
        # Each kernel streams at the bandwidth of where its bytes fit (cache or memory).
        sbh = T * h
        dropout_mask = sbh if m.is_gpt_style else 0.0
        rep = 1.0 / (t if sp else 1)
        stream = self._stream_s
        softmax_s = stream(softmax_bytes / t)
        elem_fwd = 8 * launch + (
            2 * stream(2 * sbh * ab * rep)  # the two norms
            + 2 * stream((3 * sbh * ab + dropout_mask) * rep)  # the two residual adds
            + stream((2 if m.is_gpt_style else 3) * T * f * ab / t)  # the MLP activation
            + (
                0.0 if m.is_gpt_style else stream(2 * T * (h + m.kv_hidden_size) * ab / t)
            )  # rotary
            + softmax_s
        )

        fwd = gemm_fwd + attn_fwd + elem_fwd
        bwd = (
            gemm.backward_over_forward * gemm_fwd + attn_bwd + 2.0 * elem_fwd
        )  # dgrad + wgrad per GEMM
        attn_recompute = attn_fwd + softmax_s  # selective recompute: the attention core again

        # Tensor parallel: two all-reduces of the T x h activation forward and two backward per
        # layer (the f and g operators of Shoeybi et al. 2019, Fig. 4). Sequence parallel replaces
        # each by a reduce-scatter + all-gather pair of the same total volume (Korthikanti et al.
        # 2022, sec. 4.2.2), so the ring time is the same.
        tp_ar = self._all_reduce(sbh * ab, t, 1)
        if sp:  # same volume, but all-gather and reduce-scatter run at their own measured rates
            tp_ar = self._all_gather(sbh * ab, t, 1) + self._reduce_scatter(sbh * ab, t, 1)
        tp_fwd = 2.0 * tp_ar * (1.0 - rt.tp_overlap)

        # Embedding lookup (gather + scatter-add backward; learned positions for GPT style) and the
        # vocabulary-parallel embedding all-reduce (Shoeybi et al. 2019, sec. 3).
        emb = 3 * stream((2 + (2 if m.is_gpt_style else 0)) * sbh * ab) + 3 * launch
        emb_comm = tp_ar
        # Logits (vocabulary split over tp), final norm, and the fused cross-entropy over fp32
        # logits: read the 16-bit logits, write fp32 softmax, read it back and write the gradient.
        logits = (
            (1.0 + gemm.backward_over_forward) * gemm_s(T, V / t, h)
            + stream(T * V / t * (ab + 12))
            + 3 * stream(2 * sbh * ab)
            + 4 * launch
        )
        logits_comm = tp_ar  # the g operator before the vocabulary-parallel logits (backward)
        out = LayerCosts(fwd, bwd, attn_recompute, tp_fwd, emb, logits, emb_comm, logits_comm)
        self._layer_cache[key] = out
        return out

    def _data_parallel(
        self,
        *,
        zero: int,
        d: int,
        t: int,
        p: int,
        m: int,
        psi: float,
        layer_params: float,
        ab: int,
        fwd_window: float,
        bwd_window: float,
        tail: float,
    ) -> DataParallelCost:
        """Exposed communication and model-state memory of data parallelism / ZeRO.

        `psi` parameters live on this device before any dp sharding. A collective hides behind
        compute up to its window (bucketed overlap, Li et al. 2020, PyTorch DDP; FSDP prefetch,
        Zhao et al. 2023), except the last bucket (`tail` of it).
        """
        rt = self.runtime

        def exposed(comm: float, window: float) -> float:
            return max(comm - window, comm * tail)

        grads = psi * rt.grad_reduce_bytes
        if rt.low_precision_params:
            # ZeRO as Rajbhandari et al. 2020 define it (Megatron-LM, DeepSpeed): 16-bit params and
            # grads, fp32 master weights + Adam moments (12 bytes) in the optimizer; stage 1 shards
            # the optimizer, 2 also the gradients, 3 also the parameters.
            if d == 1:
                return DataParallelCost(0.0, psi * ab, psi * ab, psi * 12)
            params = psi * ab / (d if zero >= 3 else 1) + (
                2 * layer_params * ab if zero >= 3 else 0.0
            )
            grads_mem = psi * ab / (d if zero >= 2 else 1)
            opt_mem = psi * 12 / (d if zero >= 1 else 1)
            if zero == 0:  # one all-reduce per step
                comm = exposed(self._all_reduce(grads, d, t), bwd_window)
            elif (
                zero <= 2
            ):  # reduce-scatter grads, all-gather updated 16-bit params: one all-reduce's volume
                comm = exposed(self._reduce_scatter(grads, d, t), bwd_window) + self._all_gather(
                    psi * ab, d, t
                )
            else:  # parameters gathered for forward and again for backward, every micro-batch
                ag = self._all_gather(psi * ab, d, t)
                comm = m * (
                    exposed(ag, fwd_window)
                    + exposed(ag + self._reduce_scatter(grads, d, t), bwd_window)
                )
            return DataParallelCost(comm, params, grads_mem, opt_mem)

        # PyTorch as the Engine applies a strategy (the table in autosearch/core/dp_modes.py):
        # fp32 parameters, gradients and Adam moments (4 + 4 + 8 bytes); 16-bit copies of the
        # parameters while computing (autocast, or FSDP2's MixedPrecisionPolicy); FSDP2 gathers in
        # the compute dtype and reduces in fp32.
        copies = psi * ab if ab < 4 else 0.0
        mode = dp_mode(zero_stage=zero, dp=d, tp=t, pp=p)
        optimizer_bytes = psi * 8 / d if mode.shards_optimizer else psi * 8
        if mode.wrapper == "none":
            return DataParallelCost(0.0, psi * 4 + copies, psi * 4, psi * 8)
        if (
            not mode.shards_params
        ):  # DDP, or replicate-only FSDP2: one all-reduce, last micro-batch
            comm = exposed(self._all_reduce(grads, d, t), bwd_window)
            if mode.broadcasts_params_after_step:  # ZeroRedundancyOptimizer: updated fp32 params
                comm += self._all_gather(psi * 4, d, t)
            return DataParallelCost(comm, psi * 4 + copies, psi * 4, optimizer_bytes)
        # FSDP2: parameters gathered per micro-batch (or once per step under pipelining), again
        # for backward with ZeRO-3; gradients reduce-scattered per micro-batch, or accumulated
        # unsharded in fp32 and reduced once per step.
        ag = self._all_gather(psi * ab, d, t)
        rs = self._reduce_scatter(grads, d, t)
        two_layers_live = mode.reshard_after_forward and p == 1
        gathered = 2 * layer_params * ab if two_layers_live else psi * ab
        params = psi * 4 / d + gathered
        grads_mem = psi * 4 if (m > 1 and mode.grads_accumulate_unsharded) else psi * 4 / d
        n_gathers = m if mode.gathers_every_microbatch else 1
        comm = n_gathers * exposed(ag, fwd_window)
        if mode.reshard_after_forward:
            comm += m * exposed(ag, bwd_window)
        comm += (m if mode.reduce_every_microbatch else 1) * exposed(rs, bwd_window)
        return DataParallelCost(comm, params, grads_mem, optimizer_bytes)

    def _stream_s(self, nbytes: float) -> float:
        """Seconds to stream `nbytes` through one memory-bound kernel (also its working set)."""
        return nbytes / self.profile.stream_bandwidth_bytes_per_s(nbytes) if nbytes > 0 else 0.0

    def _activation_bytes(
        self, tp: int, mb: int, sp: bool, recompute: str, precision: str
    ) -> float:
        key = (tp, mb, sp, recompute, precision)
        hit = self._act_cache.get(key)
        if hit is None:
            m = self.model
            hit = self._act_cache[key] = layer_activation_bytes(
                seq_len=m.seq_len,
                micro_batch=mb,
                hidden=m.hidden_size,
                heads=m.n_heads,
                kv_hidden=m.kv_hidden_size,
                ffn_hidden=m.ffn_hidden_size,
                swiglu=not m.is_gpt_style,
                dropout=m.is_gpt_style,
                tp=tp,
                sequence_parallel=sp,
                recompute=recompute,
                flash_attention=self.runtime.flash_attention,
                act_bytes=ACT_BYTES[precision],
            )
        return hit

    # ---- one strategy, step by step -------------------------------------------------------------
    def estimate(self, strategy: "Strategy", *, validate: bool = True) -> CostReport:
        if validate:
            strategy.validate(self.model, self.cluster)
        layer = self._layer_costs(
            strategy.tp, strategy.micro_batch_size, strategy.amp, strategy.sequence_parallel
        )
        micro = self._microbatch_time(strategy, layer)
        t_mb = micro.total_s
        p, v, m = strategy.pp, strategy.virtual_stages, strategy.grad_accum_steps
        # Bubble: (p-1)/v micro-batch times of idle (Narayanan et al. 2021, sec. 2.2).
        bubble = (p - 1) / v * t_mb if p > 1 else 0.0
        params = self._stage_params(strategy)
        rt = self.runtime
        Ls = self.model.n_layers / p
        dp = self._data_parallel(
            zero=strategy.zero_stage,
            d=strategy.dp,
            t=strategy.tp,
            p=p,
            m=m,
            psi=params.total,
            layer_params=params.per_layer,
            ab=ACT_BYTES[strategy.amp],
            fwd_window=Ls * layer.fwd_s * rt.dp_overlap,
            bwd_window=Ls * (layer.bwd_s + micro.recompute_layer_s) * rt.dp_overlap,
            tail=1.0 / (Ls + 1) if rt.dp_overlap > 0 else 1.0,
        )
        optimizer = self._optimizer_s(strategy, params.total)
        other = rt.step_overhead_s + self.profile.step_overhead_s
        step = m * t_mb + bubble + dp.exposed_s + optimizer + other
        time = TimeBreakdown(
            compute_s=m * micro.compute_s,
            recompute_s=m * micro.recompute_s,
            tp_comm_s=m * micro.tp_comm_s,
            pp_comm_s=m * micro.pp_comm_s,
            dp_comm_exposed_s=dp.exposed_s,
            bubble_s=bubble,
            optimizer_s=optimizer,
            other_s=other,
        )
        memory = MemoryBreakdown(
            params_bytes=dp.params_bytes,
            grads_bytes=dp.grads_bytes,
            optimizer_bytes=dp.optimizer_bytes,
            activations_bytes=self._activation_peak_bytes(strategy),
            other_bytes=self.profile.reserved_memory_bytes,
        )
        return self._report(strategy, step, time, memory)

    def _microbatch_time(self, strategy: "Strategy", layer: LayerCosts) -> MicrobatchTime:
        """One micro-batch on the slowest pipeline rank: its layers, embedding or logits,
        recompute, tensor-parallel collectives and pipeline sends."""
        model, rt = self.model, self.runtime
        t, p, d, v = strategy.tp, strategy.pp, strategy.dp, strategy.virtual_stages
        mb, sp, rc = strategy.micro_batch_size, strategy.sequence_parallel, strategy.recompute
        fwd, bwd, tp_fwd = layer.fwd_s, layer.bwd_s, layer.tp_comm_fwd_s
        emb, logits = layer.embedding_s, layer.logits_s
        emb_comm, logits_comm = layer.embedding_comm_s, layer.logits_comm_s
        Ls = model.n_layers / p
        if rc == "full":  # the whole forward again, collectives included (Chen et al. 2016)
            rc_layer, tp_layer = fwd, 3.0 * tp_fwd
        elif rc == "selective":  # only the attention core (Korthikanti et al. 2022, sec. 5)
            rc_layer, tp_layer = layer.attention_recompute_s, 2.0 * tp_fwd
        else:
            rc_layer, tp_layer = 0.0, 2.0 * tp_fwd
        first_compute = Ls * (fwd + bwd) + emb
        last_compute = Ls * (fwd + bwd) + logits
        if p == 1:
            stage_compute = Ls * (fwd + bwd) + emb + logits
            stage_tp = Ls * tp_layer + emb_comm + logits_comm
        elif first_compute + emb_comm >= last_compute + logits_comm:
            stage_compute, stage_tp = first_compute, Ls * tp_layer + emb_comm
        else:
            stage_compute, stage_tp = last_compute, Ls * tp_layer + logits_comm

        # Pipeline point-to-point: each micro-batch crosses every chunk boundary forward and back.
        pp_mb = 0.0
        if p > 1:
            # each tp rank sends 1/t (Narayanan et al. 2021, sec. 4.1)
            split = sp or rt.pp_scatter_gather
            ab = ACT_BYTES[strategy.amp]
            nbytes = mb * model.seq_len * model.hidden_size * ab / (t if split else 1)
            one = p2p_time_s(nbytes, *self._link_for(p, d * t, "p2p"))
            if rt.pp_scatter_gather and not sp:
                one += self._all_gather(nbytes * t, t, 1)
            pp_mb = 2.0 * v * one
        return MicrobatchTime(stage_compute, Ls * rc_layer, stage_tp, pp_mb, rc_layer)

    def _stage_params(self, strategy: "Strategy") -> StageParams:
        """Parameters of the heaviest pipeline rank, split over tp."""
        model, t, p = self.model, strategy.tp, strategy.pp
        layer_params = model.layer_params / t
        emb_params = model.embedding_params / t
        # the last stage keeps its own copy of tied embeddings for the logits (Megatron-LM,
        # torchtitan)
        tied_copy = model.vocab_size * model.hidden_size if model.tied_embeddings and p > 1 else 0
        head_params = (model.head_params + tied_copy) / t
        if p == 1:
            return StageParams(
                model.n_layers * layer_params + emb_params + head_params, layer_params
            )
        Ls = model.n_layers / p
        return StageParams(Ls * layer_params + max(emb_params, head_params), layer_params)

    def _optimizer_s(self, strategy: "Strategy", psi: float) -> float:
        """The optimizer step: memory bound over the local (sharded) states."""
        prof, rt = self.profile, self.runtime
        psi_opt = psi / strategy.dp if strategy.zero_stage >= 1 else psi
        ab = ACT_BYTES[strategy.amp]
        opt_bytes = ADAM_BYTES_PER_PARAM + (ab if rt.low_precision_params else 0)
        return (
            psi_opt * opt_bytes / prof.achieved_memory_bandwidth_bytes_per_s
            + 10 * prof.kernel_launch_s
        )

    def _activation_peak_bytes(self, strategy: "Strategy") -> float:
        """Activations held at the peak of the most loaded pipeline rank: every micro-batch in
        flight, the stage input, the logits, and the layer being recomputed."""
        model = self.model
        t, p, v = strategy.tp, strategy.pp, strategy.virtual_stages
        mb, sp, rc = strategy.micro_batch_size, strategy.sequence_parallel, strategy.recompute
        precision, schedule = strategy.amp, strategy.pipeline_schedule
        ab = ACT_BYTES[precision]
        Ls = model.n_layers / p
        act_layer = self._activation_bytes(t, mb, sp, rc, precision)
        tokens = mb * model.seq_len
        in_flight = microbatches_in_flight(schedule, p, strategy.grad_accum_steps, v)
        first_act = in_flight * (
            Ls * act_layer + tokens * model.hidden_size * ab / (t if sp else 1)
        )
        if schedule == "gpipe" or p == 1:
            last_in_flight = in_flight
        else:
            last_in_flight = 1.0 + (in_flight - 1.0) * (v - 1) / v
        logits_bytes = (
            tokens * model.vocab_size / t * (ab + 8)
        )  # 16-bit logits, fp32 softmax, grad
        last_act = last_in_flight * Ls * act_layer + logits_bytes
        if rc != "none":  # the layer being recomputed holds its full activations once
            transient = self._activation_bytes(t, mb, sp, "none", precision) - (
                act_layer if rc == "full" else 0.0
            )
            first_act += transient
            last_act += transient
        return first_act + logits_bytes if p == 1 else max(first_act, last_act)

    def _report(
        self, strategy: "Strategy", step: float, time: TimeBreakdown, memory: MemoryBreakdown
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
        if strategy.tp > self.cluster.gpus_per_node:
            notes = (
                (
                    f"tp={strategy.tp} spans nodes ({self.cluster.gpus_per_node} devices per"
                    " node): tensor-parallel traffic goes over the network"
                ),
            )
        return CostReport(
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
        )


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
