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

from autosearch.core.bands import Band, error_bands, kind_of
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
    tree_all_reduce_time_s,
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
    op_recompute_s: float  # what selective op recompute repeats: every other matmul, elementwise


class _Layer(NamedTuple):
    """What shapes one layer's costs: tokens on this rank and the strategy's layer options."""

    T: float  # tokens of one micro-batch on this rank
    mb: int
    t: int
    cp: int
    sp: bool
    ab: int  # bytes of an activation element
    precision: str
    peak: float
    fp8: str
    n_up: int  # matrices of the MLP's first projection (2 for SwiGLU)
    traffic: float  # elementwise traffic multiplier of the runtime (eager, fused, compiled)


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
        self.profile = self.runtime.on(cluster.profile)
        self._flops_per_sample = model.flops_per_token() * model.seq_len
        self._layer_cache: dict[tuple, LayerCosts] = {}
        self._act_cache: dict[tuple, float] = {}
        self._band_cache: dict[tuple, Band] = {}
        self._ranks_cache: dict[tuple, tuple[int | float, ...]] = {}
        self._link_cache: dict[tuple, tuple[float, float]] = {}

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

    def _all_reduce(self, nbytes: float, group: int, stride: int) -> float:
        if group <= 1:
            return 0.0
        link = self._link_for(group, stride, "all_reduce")
        # NCCL runs the faster of ring and tree all-reduce (tree: log n latency)
        return min(
            ring_all_reduce_time_s(nbytes, group, *link),
            tree_all_reduce_time_s(nbytes, group, *link),
        )

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
    def _layer_costs(self, strategy: "Strategy") -> LayerCosts:
        """One layer and one micro-batch, cached by the strategy fields that shape it."""
        s_ = strategy
        key = (
            s_.tp,
            s_.micro_batch_size,
            s_.amp,
            s_.sequence_parallel,
            s_.cp,
            s_.fp8,
            s_.compile,
            s_.async_tp,
        )
        hit = self._layer_cache.get(key)
        if hit is None:
            hit = _bounded(self._layer_cache)[key] = self._compute_layer_costs(*key)
        return hit

    def _compute_layer_costs(
        self,
        tp: int,
        mb: int,
        precision: str,
        sp: bool,
        cp: int,
        fp8: str,
        compiled: bool,
        async_tp: bool,
    ) -> LayerCosts:
        m, prof, rt = self.model, self.profile, self.runtime
        try:
            peak = prof.peak_flops[precision]
        except KeyError:
            raise SpecError(
                f"hardware profile {prof.name!r} has no peak for {precision}; "
                f"use amp one of {', '.join(prof.peak_flops)}"
            ) from None
        x = _Layer(
            T=mb * m.seq_len / cp,  # tokens of one micro-batch here (context parallel splits s)
            mb=mb,
            t=tp,
            cp=cp,
            sp=sp,
            ab=ACT_BYTES[precision],
            precision=precision,
            peak=peak,
            fp8=fp8,
            n_up=2 if not m.is_gpt_style else 1,
            traffic=rt.compiled_elementwise_traffic if compiled else rt.elementwise_traffic,
        )
        gemm_fwd, op_recompute_gemm = self._block_gemms(x)
        attn_fwd, attn_bwd, softmax_bytes = self._attention_core(x)
        elem_fwd, softmax_s = self._elementwise(x, softmax_bytes)
        fp8_fwd, fp8_bwd = self._fp8_scaling(x)
        backward_over_forward = prof.gemm.backward_over_forward  # dgrad + wgrad per GEMM
        fwd = gemm_fwd + attn_fwd + elem_fwd + fp8_fwd
        bwd = backward_over_forward * gemm_fwd + attn_bwd + 2.0 * elem_fwd + fp8_bwd
        attn_recompute = attn_fwd + softmax_s  # selective recompute: the attention core again
        op_recompute = op_recompute_gemm + elem_fwd + fp8_fwd  # selective op recompute
        tp_ar, tp_fwd = self._layer_comm(x, attn_fwd, attn_bwd, async_tp)
        emb, logits = self._embedding_and_logits(x, compiled)
        # the vocabulary-parallel embedding all-reduce, and the g operator before the
        # vocabulary-parallel logits (Shoeybi et al. 2019, sec. 3)
        return LayerCosts(
            fwd, bwd, attn_recompute, tp_fwd, emb, logits, tp_ar, tp_ar, op_recompute
        )

    def _block_gemms(self, x: "_Layer") -> tuple[float, float]:
        """The block's GEMMs forward, and what selective op recompute repeats of them.

        Megatron-LM partitioning (Shoeybi et al. 2019, sec. 3): QKV and the first MLP matrix
        split by columns, the output projection and second MLP matrix by rows. Float8 linears
        (torchao Float8Linear, TransformerEngine) run forward, dgrad and wgrad at the fp8 rate;
        the embedding, attention core and logits stay in `amp`.
        """
        m, gemm = self.model, self.profile.gemm
        h, f, kv, t, T = m.hidden_size, m.ffn_hidden_size, m.kv_hidden_size, x.t, x.T
        peak, key = x.peak, x.precision
        if x.fp8 != "none":
            peak = self.profile.peak_flops["fp8"]
            rowwise = x.fp8 == "rowwise" and "fp8_rowwise" in gemm.max_efficiency
            key = "fp8_rowwise" if rowwise else "fp8"
        qkv = gemm.time_s(T, (h + 2 * kv) / t, h, peak, key)
        proj = gemm.time_s(T, h, h / t, peak, key)
        fc1 = gemm.time_s(T, x.n_up * f / t, h, peak, key)
        fc2 = gemm.time_s(T, h, f / t, peak, key)
        # Selective op recompute (torchtitan) recomputes every other matmul of the block:
        # wk, wo and (SwiGLU) w3 (docs/runtimes.md [2.2]).
        op_recompute = qkv * kv / (h + 2 * kv) + proj + (fc1 / 2 if x.n_up == 2 else 0.0)
        return qkv + proj + fc1 + fc2, op_recompute

    def _attention_core(self, x: "_Layer") -> tuple[float, float, float]:
        """(forward s, backward s, softmax bytes) of QK^T and softmax(.)V: 2 * 2 * s^2 * d FLOPs
        per head and sequence; with context parallel each rank holds s/cp queries against all s
        keys, load-balanced so that the causal work is even (torch's context parallel)."""
        m, prof = self.model, self.profile
        s, h, t, launch = m.seq_len, m.hidden_size, x.t, prof.kernel_launch_s
        if self.runtime.flash_attention:
            flops = 4.0 * x.mb * s * s * h / t * CAUSAL_FRACTION / x.cp
            fwd = launch + flops / (x.peak * self._attention_efficiency(x.precision))
            return fwd, prof.attention_backward_over_forward * fwd, 0.0
        rows = x.mb * m.n_heads / t * s / x.cp  # batched over sequences and local heads
        gemm = prof.gemm
        fwd = gemm.time_s(rows, s, m.head_dim, x.peak, x.precision) + gemm.time_s(
            rows, m.head_dim, s, x.peak, x.precision
        )
        # Fused scale-mask-softmax (read + write) and attention dropout (read, write, mask).
        mask = 1.0 if m.dropout else 0.0
        softmax_bytes = rows * s * (2 * x.ab + mask * (2 * x.ab + 1))
        return fwd, gemm.backward_over_forward * fwd, softmax_bytes

    def _elementwise(self, x: "_Layer", softmax_bytes: float) -> tuple[float, float]:
        """(forward s, softmax s) of the memory-bound work of a layer, backward taken as 2x.

        Bytes moved: two norms (read + write), two residual adds with bias-dropout (read 2,
        write 1, mask), the MLP activation (gelu: read + write sbf; SwiGLU: read 2 sbf, write
        1), rotary on q, k. Each kernel streams at the bandwidth of where its bytes fit (cache or
        memory); fused kernels (compile, TransformerEngine) move a fraction of eager traffic.
        """
        m, T, t, ab = self.model, x.T, x.t, x.ab
        h, f, kv = m.hidden_size, m.ffn_hidden_size, m.kv_hidden_size
        sbh = T * h
        dropout_mask = sbh if m.dropout else 0.0
        rep = 1.0 / (t if x.sp else 1)
        elementwise = self._elementwise_s(x)
        softmax_s = elementwise(softmax_bytes / t)
        rotary = (
            elementwise(2 * T * (h + kv) * ab / t) if m.position_embedding == "rotary" else 0.0
        )
        fwd = 8 * self.profile.kernel_launch_s + (
            2 * elementwise(2 * sbh * ab * rep)  # the two norms
            + 2 * elementwise((3 * sbh * ab + dropout_mask) * rep)  # the two residual adds
            + elementwise((2 if m.is_gpt_style else 3) * T * f * ab / t)  # the MLP activation
            + rotary
            + softmax_s
        )
        return fwd, softmax_s

    def _elementwise_s(self, x: "_Layer"):
        traffic, stream = x.traffic, self._stream_s
        return lambda nbytes: stream(nbytes * traffic)

    def _fp8_scaling(self, x: "_Layer") -> tuple[float, float]:
        """(forward s, backward s) of float8 scaling: amax and cast of each linear's input
        (forward) and output gradient (backward, two layouts), and of the weights unless FSDP
        gathers them in fp8 (torchao tensorwise); rowwise scaling needs twice the cast kernels
        (docs/runtimes.md [2.4])."""
        if x.fp8 == "none":
            return 0.0, 0.0
        m, rt, T, t, ab = self.model, self.runtime, x.T, x.t, x.ab
        h, f, kv = m.hidden_size, m.ffn_hidden_size, m.kv_hidden_size
        launch = self.profile.kernel_launch_s
        elementwise = self._elementwise_s(x)
        # qkv and fc1 see the whole (gathered) sequence, proj and fc2 their tp shard
        inputs = 2 * T * h + T * h / t + T * f / t
        grads = T * (h + 2 * kv) / t + T * h + T * x.n_up * f / t + T * h
        kernels = 2.0 if x.fp8 == "rowwise" else 1.0
        fp8_gathered = rt.fp8_all_gather and x.fp8 == "tensorwise"
        weight_cast = 0.0 if fp8_gathered else m.layer_matmul_params / t * 5
        fwd = 4 * launch + kernels * elementwise(inputs * (ab + ab + 1)) + elementwise(weight_cast)
        bwd = (
            8 * launch
            + kernels * elementwise(grads * (ab + 2 * (ab + 1)) + inputs * (ab + 1))
            + elementwise(weight_cast)
        )
        return fwd, bwd

    def _layer_comm(
        self, x: "_Layer", attn_fwd: float, attn_bwd: float, async_tp: bool
    ) -> tuple[float, float]:
        """(one tensor-parallel collective pair s, exposed forward communication of a layer s).

        Tensor parallel: two all-reduces of the T x h activation forward and two backward per
        layer (the f and g operators of Shoeybi et al. 2019, Fig. 4). Sequence parallel replaces
        each by a reduce-scatter + all-gather pair of the same total volume (Korthikanti et al.
        2022, sec. 4.2.2), at their own measured rates; async TP hides part of them behind the
        GEMMs. Context parallel: keys and values of the whole sequence all-gathered for forward,
        their gradients (fp32) reduced in backward, over the cp ranks (stride tp: mesh pp, dp,
        cp, tp); each hides behind the attention core of the same layer.
        """
        m, rt, t, ab = self.model, self.runtime, x.t, x.ab
        sbh = x.T * m.hidden_size
        tp_ar = self._all_reduce(sbh * ab, t, 1)
        if x.sp:
            tp_ar = self._all_gather(sbh * ab, t, 1) + self._reduce_scatter(sbh * ab, t, 1)
        overlap = rt.async_tp_overlap if async_tp else rt.tp_overlap
        tp_fwd = 2.0 * tp_ar * (1.0 - overlap)
        if x.cp > 1:
            kv_bytes = 2 * x.mb * m.seq_len * m.kv_hidden_size / t * ab
            gather = self._all_gather(kv_bytes, x.cp, t)
            reduce = self._reduce_scatter(kv_bytes * 4 / ab, x.cp, t)
            tp_fwd += max(gather - attn_fwd, gather / x.cp) + max(reduce - attn_bwd, reduce / x.cp)
        return tp_ar, tp_fwd

    def _embedding_and_logits(self, x: "_Layer", compiled: bool) -> tuple[float, float]:
        """(embedding s, logits s), forward + backward.

        Embedding lookup: gather + scatter-add backward (learned positions too). Logits
        (vocabulary split over tp), final norm, and the cross-entropy: read the 16-bit logits,
        write the fp32 softmax, read it back and write the gradient (eager); a fused or compiled
        loss moves less (the runtime's bytes per logit).
        """
        m, prof, rt, T, t, ab = self.model, self.profile, self.runtime, x.T, x.t, x.ab
        stream, launch = self._stream_s, prof.kernel_launch_s
        sbh = T * m.hidden_size
        learned = m.position_embedding == "learned"
        emb = 3 * stream((2 + (2 if learned else 0)) * sbh * ab) + 3 * launch
        loss_bytes = rt.compiled_loss_bytes_per_logit if compiled else rt.loss_bytes_per_logit
        gemm = prof.gemm
        logits = (
            (1.0 + gemm.backward_over_forward)
            * gemm.time_s(T, m.vocab_size / t, m.hidden_size, x.peak, x.precision)
            + stream(T * m.vocab_size / t * (ab + loss_bytes + 2))
            + 3 * stream(2 * sbh * ab)
            + 4 * launch
        )
        return emb, logits

    def _data_parallel(
        self,
        strategy: "Strategy",
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
        # What FSDP / ZeRO-3 gathers: the runtime's gather dtype (the amp dtype by default);
        # float8 block weights when the runtime gathers them in fp8 (torchao tensorwise).
        gather_bytes = rt.param_gather_bytes or ab
        gathered_param_bytes = psi * gather_bytes
        if strategy.fp8 == "tensorwise" and rt.fp8_all_gather:
            blocks = min(psi, self._rank_block_params(strategy))
            gathered_param_bytes = blocks * 1 + (psi - blocks) * gather_bytes
        if rt.low_precision_params:
            # ZeRO as Rajbhandari et al. 2020 define it (Megatron-LM, DeepSpeed): 16-bit params and
            # grads, fp32 master weights + Adam moments (12 bytes) in the optimizer; stage 1 shards
            # the optimizer, 2 also the gradients, 3 also the parameters.
            grad_bytes = 4 if rt.main_grad_fp32 else ab  # Megatron-Core's fp32 main_grad
            if d == 1:
                return DataParallelCost(0.0, psi * ab, psi * grad_bytes, psi * 12)
            params = psi * ab / (d if zero >= 3 else 1) + (
                2 * layer_params * ab if zero >= 3 else 0.0
            )
            grads_mem = psi * grad_bytes / (d if zero >= 2 else 1)
            opt_mem = psi * 12 / (d if zero >= 1 else 1)
            if zero == 0:  # one all-reduce per step
                comm = exposed(self._all_reduce(grads, d, t), bwd_window)
            elif (
                zero <= 2
            ):  # reduce-scatter grads, all-gather updated 16-bit params: one all-reduce's volume
                comm = exposed(self._reduce_scatter(grads, d, t), bwd_window) + self._all_gather(
                    gathered_param_bytes, d, t
                )
            else:  # parameters gathered for forward and again for backward, every micro-batch
                ag = self._per_unit(self._all_gather, gathered_param_bytes, d, t, strategy)
                comm = m * (
                    exposed(ag, fwd_window)
                    + exposed(
                        ag + self._per_unit(self._reduce_scatter, grads, d, t, strategy),
                        bwd_window,
                    )
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
        ag = self._per_unit(self._all_gather, gathered_param_bytes, d, t, strategy)
        rs = self._per_unit(self._reduce_scatter, grads, d, t, strategy)
        two_layers_live = mode.reshard_after_forward and p == 1
        per_param = gathered_param_bytes / psi if psi else gather_bytes
        gathered = 2 * layer_params * per_param if two_layers_live else gathered_param_bytes
        params = psi * 4 / d + gathered
        grads_mem = psi * 4 if (m > 1 and mode.grads_accumulate_unsharded) else psi * 4 / d
        n_gathers = m if mode.gathers_every_microbatch else 1
        comm = n_gathers * exposed(ag, fwd_window)
        if mode.reshard_after_forward:  # FSDP1 BACKWARD_POST: the backward gather is not hidden
            comm += m * (ag if rt.fsdp_backward_gather_exposed else exposed(ag, bwd_window))
        comm += (m if mode.reduce_every_microbatch else 1) * exposed(rs, bwd_window)
        return DataParallelCost(comm, params, grads_mem, optimizer_bytes)

    def _band(self, strategy: "Strategy") -> Band:
        """The error band of this kind of strategy (autosearch/core/bands.py), cached."""
        s = strategy
        key = (
            s.dp > 1,
            s.tp > 1,
            s.pp > 1,
            s.cp > 1,
            s.zero_stage == 3,
            s.recompute,
            s.fp8,
            s.amp,
        )
        hit = self._band_cache.get(key)
        if hit is None:
            kind = kind_of(s, self.cluster, self.runtime.framework)
            hit = _bounded(self._band_cache)[key] = error_bands().band(kind)
        return hit

    def _attention_efficiency(self, precision: str) -> float:
        """Fraction of peak the fused attention kernel reaches (forward and backward): the
        runtime's kernel on this hardware if the profile knows it (16-bit), else the profile's
        flash efficiency (calibrated, or a datasheet-era default)."""
        prof, kernel = self.profile, self.runtime.attention_kernel
        if kernel and precision in ("bf16", "fp16") and kernel in prof.attention_kernels:
            return prof.attention_kernels[kernel]
        return prof.attention_efficiency.get(precision, 0.5)

    def _per_unit(self, collective, nbytes: float, group: int, stride: int, strategy) -> float:
        """FSDP gathers and reduces one unit at a time (each block, then the root: FSDP2
        `fully_shard` per block, FSDP1 auto-wrap, Megatron-FSDP), so every unit pays the ring's
        latency, (n-1) alpha: at hundreds of ranks that latency, not bandwidth, bounds small
        models (Thakur et al. 2005 alpha-beta model, applied per collective)."""
        units = max(self._rank_layers(strategy)) + 1
        return units * collective(nbytes / units, group, stride)

    def _rank_block_params(self, strategy: "Strategy") -> float:
        """Transformer-block parameters on the heaviest pipeline rank (one tp shard)."""
        return max(self._rank_layers(strategy)) * self.model.layer_params / strategy.tp

    def _stream_s(self, nbytes: float) -> float:
        """Seconds to stream `nbytes` through one memory-bound kernel (also its working set)."""
        return nbytes / self.profile.stream_bandwidth_bytes_per_s(nbytes) if nbytes > 0 else 0.0

    def _activation_bytes(
        self,
        tp: int,
        mb: int,
        sp: bool,
        precision: str,
        cp: int,
        fused: bool,
        fp8: bool,
        compiled: bool,
        recompute: str,
    ) -> float:
        """Bytes one layer keeps for backward, per micro-batch, on one rank."""
        key = (tp, mb, sp, precision, cp, fused, fp8, compiled, recompute)
        hit = self._act_cache.get(key)
        if hit is None:
            hit = _bounded(self._act_cache)[key] = self._compute_activation_bytes(*key)
        return hit

    def _compute_activation_bytes(
        self,
        tp: int,
        mb: int,
        sp: bool,
        precision: str,
        cp: int,
        fused: bool,
        fp8: bool,
        compiled: bool,
        recompute: str,
    ) -> float:
        m, rt = self.model, self.runtime
        ab = ACT_BYTES[precision]
        seq = m.seq_len // cp  # context parallel keeps 1/cp of every sequence
        tokens = mb * seq
        sp_div = tp if sp else 1
        if recompute == "selective_op":
            # torchtitan's op-level policy saves the outputs of every other matmul (wq, wv, w1,
            # w2), the attention output and log-sum-exp, and the layer input; the rest,
            # sequence-parallel all-gathers included, is recomputed (docs/runtimes.md [2.2]).
            h, kv, f = m.hidden_size, m.kv_hidden_size, m.ffn_hidden_size
            saved = (h + kv + f + h) / tp + h / sp_div + h / sp_div
            if compiled:
                # Eager SAC stores every MUST_SAVE output whether backward reads it or not
                # (torch/utils/checkpoint.py::_CachingTorchDispatchMode); compiled, the policy
                # only bans recomputing them and the partitioner saves what backward needs,
                # which drops w2's output (it only feeds the residual add) (docs/runtimes.md
                # [2.2])
                saved -= h / tp
            return tokens * ab * saved + 4.0 * m.n_heads / tp * tokens
        out = layer_activation_bytes(
            seq_len=seq,
            micro_batch=mb,
            hidden=m.hidden_size,
            heads=m.n_heads,
            kv_hidden=m.kv_hidden_size,
            ffn_hidden=m.ffn_hidden_size,
            swiglu=not m.is_gpt_style,
            dropout=m.dropout,
            tp=tp,
            sequence_parallel=sp,
            recompute=recompute,
            flash_attention=rt.flash_attention,
            act_bytes=ab,
            fused_swiglu=fused,
            fp8_linear_inputs=fp8,
        )
        if sp and tp > 1 and rt.sp_saves_gathered_input and recompute != "full":
            # DTensor keeps the all-gathered (whole-sequence) input of the QKV and first MLP
            # matmuls for their weight gradients, not the shard (docs/runtimes.md [2.5]).
            out += 2 * tokens * m.hidden_size * ab * (1 - 1 / tp)
        return out

    # ---- one strategy, step by step ----------------------------------------------------------
    def estimate(self, strategy: "Strategy", *, validate: bool = True) -> CostReport:
        if validate:
            strategy.validate(self.model, self.cluster)
            lacks = self.runtime.lacks(strategy)
            if lacks:
                raise SpecError(
                    lacks, context=f"strategy {strategy.short()} under runtime {self.runtime.name}"
                )
        layer = self._layer_costs(strategy)
        ranks = self._rank_layers(strategy)
        micro = self._microbatch_time(strategy, layer, ranks)
        t_mb = micro.total_s
        p, v, m = strategy.pp, strategy.virtual_stages, strategy.grad_accum_steps
        # Bubble: (p-1)/v micro-batch times of idle (Narayanan et al. 2021, sec. 2.2).
        bubble = (p - 1) / v * t_mb if p > 1 else 0.0
        params = self._stage_params(strategy, ranks)
        rt = self.runtime
        Ls = max(ranks)
        dp = self._data_parallel(
            strategy,
            zero=strategy.zero_stage,
            d=strategy.dp * strategy.cp,  # FSDP and the optimizer shard over dp x cp
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
        activations = self._activation_peak_bytes(strategy, ranks)
        tensors = dp.params_bytes + dp.grads_bytes + dp.optimizer_bytes + activations
        memory = MemoryBreakdown(
            params_bytes=dp.params_bytes,
            grads_bytes=dp.grads_bytes,
            optimizer_bytes=dp.optimizer_bytes,
            activations_bytes=activations,
            # the device's reserve, and what the caching allocator holds beyond live tensors
            other_bytes=self.profile.reserved_memory_bytes
            + rt.allocator_reserve_fraction * tensors,
        )
        return self._report(strategy, step, time, memory)

    def _rank_layers(self, strategy: "Strategy") -> tuple[int | float, ...]:
        """Layers each pipeline rank holds (chunk c runs on rank c mod pp)."""
        key = (strategy.pp, strategy.virtual_stages, strategy.pipeline_split)
        hit = self._ranks_cache.get(key)
        if hit is None:
            p, L = strategy.pp, self.model.n_layers
            if strategy.pipeline_split is None and L % (p * strategy.virtual_stages) == 0:
                hit = (L / p,) * p
            else:
                chunks = strategy.layers_per_chunk(L)
                hit = tuple(sum(chunks[r::p]) for r in range(p))
            _bounded(self._ranks_cache)[key] = hit
        return hit

    def _recomputed_layers(self, strategy: "Strategy", rank_layers: float) -> float:
        """Layers of one pipeline rank whose forward is recomputed (all of them, or
        `recompute_num_layers` per chunk)."""
        n = strategy.recompute_num_layers
        if n is None or strategy.recompute == "none":
            return rank_layers if strategy.recompute != "none" else 0.0
        return min(float(n) * strategy.virtual_stages, rank_layers)

    def _microbatch_time(
        self, strategy: "Strategy", layer: LayerCosts, ranks: tuple[int | float, ...]
    ) -> MicrobatchTime:
        """One micro-batch on the slowest pipeline rank: its layers, embedding or logits,
        recompute, tensor-parallel collectives and pipeline sends."""
        model, rt = self.model, self.runtime
        t, p, d, v = strategy.tp, strategy.pp, strategy.dp, strategy.virtual_stages
        mb, sp, rc = strategy.micro_batch_size, strategy.sequence_parallel, strategy.recompute
        fwd, bwd, tp_fwd = layer.fwd_s, layer.bwd_s, layer.tp_comm_fwd_s
        # What one recomputed layer repeats, and its tensor-parallel traffic (in forwards' worth):
        # full: the whole forward, collectives included (Chen et al. 2016); selective: the
        # attention core (Korthikanti et al. 2022, sec. 5); selective_op: every other matmul and
        # the elementwise work, with the sequence-parallel all-gathers again (torchtitan).
        rc_layer, rc_tp = {
            "full": (fwd, 1.0),
            "selective": (layer.attention_recompute_s, 0.0),
            "selective_op": (layer.op_recompute_s, 0.5),
            "none": (0.0, 0.0),
        }[rc]
        best = None
        for r, Lr in enumerate(ranks):
            first, last = r == 0, r == p - 1
            n_rc = self._recomputed_layers(strategy, Lr)
            compute = (
                Lr * (fwd + bwd)
                + (layer.embedding_s if first else 0.0)
                + (layer.logits_s if last else 0.0)
            )
            if n_rc == Lr:
                tp = Lr * ((2.0 + rc_tp) * tp_fwd)
            else:
                tp = Lr * (2.0 * tp_fwd) + n_rc * rc_tp * tp_fwd
            if first:
                tp += layer.embedding_comm_s
            if last:
                tp += layer.logits_comm_s
            recompute = n_rc * rc_layer
            total = compute + recompute + tp
            if best is None or total > best[0]:
                best = (total, compute, recompute, tp)
        assert best is not None
        _, stage_compute, stage_rc, stage_tp = best

        # Pipeline point-to-point: each micro-batch crosses every chunk boundary forward and back.
        pp_mb = 0.0
        if p > 1:
            # each tp rank sends 1/t (Narayanan et al. 2021, sec. 4.1)
            split = sp or rt.pp_scatter_gather
            ab = ACT_BYTES[strategy.amp]
            tokens = mb * model.seq_len / strategy.cp
            nbytes = tokens * model.hidden_size * ab / (t if split else 1)
            one = p2p_time_s(nbytes, *self._link_for(p, d * t * strategy.cp, "p2p"))
            if rt.pp_scatter_gather and not sp:
                one += self._all_gather(nbytes * t, t, 1)
            pp_mb = 2.0 * v * one
        return MicrobatchTime(stage_compute, stage_rc, stage_tp, pp_mb, rc_layer)

    def _stage_params(self, strategy: "Strategy", ranks: tuple[int | float, ...]) -> StageParams:
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
        if len(set(ranks)) == 1:
            return StageParams(
                ranks[0] * layer_params + max(emb_params, head_params), layer_params
            )
        heaviest = max(
            Lr * layer_params
            + (emb_params if r == 0 else 0.0)
            + (head_params if r == p - 1 else 0.0)
            for r, Lr in enumerate(ranks)
        )
        return StageParams(heaviest, layer_params)

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

    def _activation_peak_bytes(
        self, strategy: "Strategy", ranks: tuple[int | float, ...]
    ) -> float:
        """Activations held at the peak of the most loaded pipeline rank: every micro-batch in
        flight, the stage input, the logits, and the layer being recomputed."""
        model, rt = self.model, self.runtime
        t, p, v = strategy.tp, strategy.pp, strategy.virtual_stages
        mb, sp, rc = strategy.micro_batch_size, strategy.sequence_parallel, strategy.recompute
        precision, schedule = strategy.amp, strategy.pipeline_schedule
        ab = ACT_BYTES[precision]
        fused = strategy.compile or rt.fused_swiglu
        fp8_inputs = strategy.fp8 != "none" and rt.fp8_saves_fp8_inputs
        key = (t, mb, sp, precision, strategy.cp, fused, fp8_inputs, strategy.compile)
        act_none = self._activation_bytes(*key, "none")
        act_layer = self._activation_bytes(*key, rc)

        def held(layers: float) -> float:
            """Bytes a rank keeps for `layers` layers of one micro-batch."""
            n_rc = self._recomputed_layers(strategy, layers)
            if n_rc == layers:
                return layers * act_layer
            return n_rc * act_layer + (layers - n_rc) * act_none

        tokens = mb * model.seq_len / strategy.cp
        in_flight = microbatches_in_flight(schedule, p, strategy.grad_accum_steps, v)
        first_act = in_flight * (
            held(ranks[0]) + tokens * model.hidden_size * ab / (t if sp else 1)
        )
        if schedule == "gpipe" or p == 1:
            last_in_flight = in_flight
        else:
            last_in_flight = 1.0 + (in_flight - 1.0) * (v - 1) / v
        logits = tokens * model.vocab_size / t  # of one micro-batch, on this rank
        logits_bytes = logits * self._loss_peak_bytes_per_logit(strategy)
        last_act = last_in_flight * held(ranks[-1]) + logits_bytes
        if p > 1:
            # torch.distributed.pipelining's last stage appends every micro-batch's output (the
            # logits) to `output_chunks` and keeps them until the step returns them merged
            # (pipelining/stage.py::forward_one_chunk, schedules.py::step); docs/runtimes.md [2.7]
            last_act += strategy.grad_accum_steps * logits * rt.pp_kept_output_bytes_per_logit
        transient = self._cp_attention_backward_bytes(strategy)
        if rc != "none":  # the layer being recomputed holds its full activations once
            transient += act_none - (act_layer if rc == "full" else 0.0)
        first_act += transient
        last_act += transient
        return first_act + logits_bytes if p == 1 else max(first_act, last_act)

    def _cp_attention_backward_bytes(self, strategy: "Strategy") -> float:
        """What one layer's context-parallel attention backward holds beyond the layer's
        activations (torch `_templated_ring_attention_backward` with the allgather rotater,
        docs/runtimes.md [1.5]): K and V of the whole sequence gathered in the amp dtype, one
        ring step's SDPA gradients, fp32 accumulators of dQ, dK, dV for the local shard, and the
        fp32 dK, dV buffers sent and received round the ring."""
        rt, m, cp, t = self.runtime, self.model, strategy.cp, strategy.tp
        if cp <= 1 or not rt.cp_all_gather_kv:
            return 0.0
        ab = ACT_BYTES[strategy.amp]
        kv = m.hidden_size if rt.attention_kv_expanded else m.kv_hidden_size
        local = strategy.micro_batch_size * m.seq_len / cp  # tokens of the local shard
        gathered = 2 * local * cp * kv / t * ab
        qkv = local * (m.hidden_size + 2 * kv) / t
        return gathered + qkv * ab + 4 * qkv + 2 * 4 * local * 2 * kv / t

    def _loss_peak_bytes_per_logit(self, strategy: "Strategy") -> float:
        """Bytes per logit live at the loss's peak (its backward): the runtime's figure for an
        eager or compiled loss, on the whole vocabulary or, with tp > 1 and a vocabulary-parallel
        loss, on the shards (docs/runtimes.md [2.3], [2.9]); given for 16-bit logits, fp32
        logits (amp fp32) add their 2 extra bytes."""
        rt = self.runtime
        if strategy.compile:
            full = rt.compiled_loss_bytes_per_logit
            parallel = rt.compiled_loss_parallel_bytes_per_logit
        else:
            full, parallel = rt.loss_bytes_per_logit, rt.loss_parallel_bytes_per_logit
        per_logit = parallel if strategy.tp > 1 and parallel > 0 else full
        return per_logit + ACT_BYTES[strategy.amp] - 2

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
        if strategy.tp > self.cluster.nvlink_domain:
            notes = (
                (
                    f"tp={strategy.tp} spans nodes ({self.cluster.nvlink_domain} devices per"
                    " node): tensor-parallel traffic goes over the network"
                ),
            )
        return CostReport(
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
        )


CACHE_ENTRIES = 65_536  # per cache: a search space has a few hundred layer shapes at most


def _bounded(cache: dict) -> dict:
    """`cache`, emptied first if it is full: a caller sweeping millions of distinct shapes
    (micro-batch sizes, say) stays within a bounded memory (~10 MB per cache)."""
    if len(cache) >= CACHE_ENTRIES:
        cache.clear()
    return cache


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
