"""Data parallel and ZeRO / FSDP: the exposed gradient and parameter collectives over the dp x cp
ranks (stride tp), and the model states each device keeps."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, NamedTuple

from autosearch.core.dp_modes import dp_mode
from cost_models.terms._base import (
    ACT_BYTES,
    Context,
    LayerCosts,
    all_gather_s,
    all_reduce_s,
    reads,
    reduce_s,
    reduce_scatter_s,
)
from cost_models.terms.memory import StageParams

if TYPE_CHECKING:  # pragma: no cover
    from autosearch.core.strategy import Strategy


def state_bytes(rt, amp_bytes: float) -> tuple[float, float, float]:
    """(weight, gradient, optimizer) bytes of one trained parameter's model state under the
    runtime `rt`, summed over the devices holding its shards:

    - mixed precision with fp32 master weights (`low_precision_params`: Megatron-LM, DeepSpeed):
      weights in the amp dtype, gradients too (or an fp32 main_grad) and 12 bytes of optimizer
      state (fp32 master + two Adam moments; Rajbhandari et al. 2020, sec. 3.1, K = 12);
    - otherwise weights and gradients of `param_bytes` each and two Adam moments (PyTorch's
      AdamW over fp32 parameters: 4 + 4 + 8 bytes).
    """
    if rt.low_precision_params:
        return amp_bytes, (4 if rt.main_grad_fp32 else amp_bytes), 12
    return rt.param_bytes, rt.param_bytes, 2 * rt.param_bytes


class DataParallelCost(NamedTuple):
    """Exposed data-parallel time and the model states' memory on one device."""

    exposed_s: float
    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float


@reads(
    "zero_stage",
    "dp",
    "cp",
    "tp",
    "pp",
    "global_batch_size",
    "micro_batch_size",
    "amp",
    "fp8",
    "ep",
)
def cost(
    s: "Strategy",
    ctx: Context,
    params: StageParams,
    ranks: tuple[int | float, ...],
    layer: LayerCosts,
    recompute_layer_s: float,
    *,
    group: tuple[int, int] | None = None,
    trainable: float | None = None,
) -> DataParallelCost:
    """Exposed communication and model-state memory of data parallelism / ZeRO.

    `params.total` parameters live on this device before any dp sharding; FSDP and the optimizer
    shard over dp x cp. A collective hides behind compute up to its window, the forward or
    backward (with recompute) of the rank's layers (bucketed overlap, Li et al. 2020, PyTorch
    DDP; FSDP prefetch, Zhao et al. 2023), except the last bucket (`tail` of it). `group`:
    (ranks, stride) of another data-parallel group than dp x cp ranks tp apart (the routed
    experts' expert-data-parallel group, experts.expert_data_parallel). `trainable`: how many of
    the `params.total` parameters train (LoRA's adapters; None: all). Frozen parameters are
    kept in the parameter dtype only (no gradient, no optimizer state, no fp32 master), are
    sharded and gathered by ZeRO-3 / FSDP like the others (FSDP2 shards a block's frozen and
    trainable parameters together), and are never reduced or re-gathered after the step.
    """
    rt, launch_s = ctx.runtime, ctx.profile.kernel_launch_s
    zero, d, t, p, m = s.zero_stage, s.dp * s.cp, s.tp, s.pp, s.grad_accum_steps
    psi, layer_params, ab = params.total, params.per_layer, ACT_BYTES[s.amp]
    tr = psi if trainable is None else trainable
    stride = t
    if group is not None:
        d, stride = group
    Ls = max(ranks)
    overlap = rt.zero3_overlap if zero >= 3 and rt.zero3_overlap >= 0 else rt.dp_overlap
    fwd_window = Ls * layer.fwd_s * overlap
    bwd_window = Ls * (layer.bwd_s + recompute_layer_s) * overlap
    tail = 1.0 / (Ls + 1) if overlap > 0 else 1.0

    overhead = rt.collective_overhead_s + d * rt.collective_copies_per_rank * launch_s

    def exposed(comm: float, window: float) -> float:
        return max(comm - window, comm * tail)

    def per_unit(collective: Callable[..., float], nbytes: float, per_layer: float = 1.0) -> float:
        """FSDP gathers and reduces one unit at a time (each block, then the root: FSDP2
        `fully_shard` per block, FSDP1 auto-wrap, Megatron-FSDP; DeepSpeed ZeRO-3 one submodule
        at a time, `per_layer` of them), so every unit pays the ring's latency, (n-1) steps of
        it (NCCL has no tree for all-gather and reduce-scatter): at hundreds of ranks that
        latency, not bandwidth, bounds small models (Thakur et al. 2005 alpha-beta model, applied
        per collective), and the runtime's own cost per collective adds to it: a fixed part, and
        with list-based collectives one copy kernel per rank (`collective_copies_per_rank`)."""
        units = max(1.0, Ls * per_layer) + 1
        return units * (collective(ctx, nbytes / units, d, stride) + overhead)

    def reduce_grads(nbytes: float) -> float:
        """ZeRO-2/3 gradient reduction: per unit (FSDP), per bucket of `reduce_bucket_params`
        (DeepSpeed), and with `grad_reduce_per_partition` one reduce to each of the d owners per
        bucket (DeepSpeed ZeRO-2 `average_tensor`: d collectives of S/d per bucket)."""
        if not rt.reduce_bucket_params:  # per unit; under ZeRO-3 per fetched submodule
            units = rt.zero3_gathers_per_layer if zero >= 3 else 1.0
            return per_unit(reduce_scatter_s, nbytes, units)
        buckets = max(1.0, math.ceil(tr / rt.reduce_bucket_params))
        size = nbytes / buckets
        if rt.grad_reduce_per_partition and zero == 2:
            one = d * (reduce_s(ctx, size / d, d, stride) + rt.collective_overhead_s)
        else:
            one = reduce_scatter_s(ctx, size, d, stride) + rt.collective_overhead_s
        return buckets * one

    grads = tr * rt.grad_reduce_bytes
    # What FSDP / ZeRO-3 gathers: the runtime's gather dtype (the amp dtype by default);
    # float8 block weights when the runtime gathers them in fp8 (torchao tensorwise).
    gather_bytes = rt.param_gather_bytes or ab
    gathered_param_bytes = psi * gather_bytes
    if s.fp8 == "tensorwise" and rt.fp8_all_gather:
        blocks = min(psi, Ls * ctx.model.layer_params / t)  # the heaviest rank's blocks
        gathered_param_bytes = blocks * 1 + (psi - blocks) * gather_bytes
    if rt.low_precision_params:
        # ZeRO as Rajbhandari et al. 2020 define it (Megatron-LM, DeepSpeed): 16-bit params and
        # grads, fp32 master weights + Adam moments (12 bytes) in the optimizer; stage 1 shards
        # the optimizer, 2 also the gradients, 3 also the parameters.
        weight_bytes, grad_bytes, opt_bytes = state_bytes(rt, ab)
        if d == 1:
            return DataParallelCost(0.0, psi * weight_bytes, tr * grad_bytes, tr * opt_bytes)
        live = 2 * layer_params  # the block computing and the one prefetched
        if rt.zero3_max_live_params:  # DeepSpeed releases beyond its live-parameter budget
            one_fetch = layer_params / rt.zero3_gathers_per_layer
            live = min(live, max(rt.zero3_max_live_params, one_fetch))
        params_mem = psi * weight_bytes / (d if zero >= 3 else 1) + (
            live * weight_bytes if zero >= 3 else 0.0
        )
        grads_mem = tr * grad_bytes / (d if zero >= 2 else 1)
        opt_mem = tr * opt_bytes / (d if zero >= 1 else 1)
        if zero == 0:  # one all-reduce per step
            comm = exposed(all_reduce_s(ctx, grads, d, stride), bwd_window)
        elif zero <= 2:
            # reduce-scatter grads, all-gather updated 16-bit params: one all-reduce's volume
            rs = (
                reduce_grads(grads)
                if rt.reduce_bucket_params
                else reduce_scatter_s(ctx, grads, d, stride)
            )
            # (only what trains changes: frozen parameters are not gathered again)
            updated = gathered_param_bytes if trainable is None else tr * gather_bytes
            comm = exposed(rs, bwd_window) + all_gather_s(ctx, updated, d, stride)
        else:  # parameters gathered for forward and again for backward, every micro-batch
            ag = per_unit(all_gather_s, gathered_param_bytes, rt.zero3_gathers_per_layer)
            comm = m * (exposed(ag, fwd_window) + exposed(ag + reduce_grads(grads), bwd_window))
        return DataParallelCost(comm, params_mem, grads_mem, opt_mem)

    # PyTorch as the Engine applies a strategy (the table in autosearch/core/dp_modes.py):
    # fp32 parameters, gradients and Adam moments (4 + 4 + 8 bytes); 16-bit copies of the
    # parameters while computing (autocast, or FSDP2's MixedPrecisionPolicy); FSDP2 gathers in
    # the compute dtype and reduces in fp32.
    # (`param_bytes`: a runtime that trains bf16 parameters as they are keeps them, their
    # gradients and the Adam moments in bf16, 2 + 2 + 4 bytes)
    pb = rt.param_bytes
    copies = psi * ab if ab < pb else 0.0
    mode = dp_mode(zero_stage=zero, dp=d, tp=t, pp=p, ep=s.ep)
    optimizer_bytes = tr * 2 * pb / d if mode.shards_optimizer else tr * 2 * pb
    if mode.wrapper == "none":
        return DataParallelCost(0.0, psi * pb + copies, tr * pb, tr * 2 * pb)
    if not mode.shards_params:  # DDP, or replicate-only FSDP2: one all-reduce, last micro-batch
        comm = exposed(all_reduce_s(ctx, grads, d, stride), bwd_window)
        if mode.broadcasts_params_after_step:  # ZeroRedundancyOptimizer: updated fp32 params
            comm += all_gather_s(ctx, tr * pb, d, stride)
        return DataParallelCost(comm, psi * pb + copies, tr * pb, optimizer_bytes)
    # FSDP2: parameters gathered per micro-batch (or once per step under pipelining), again
    # for backward with ZeRO-3; gradients reduce-scattered per micro-batch, or accumulated
    # unsharded in fp32 and reduced once per step.
    ag = per_unit(all_gather_s, gathered_param_bytes)
    rs = per_unit(reduce_scatter_s, grads)
    two_layers_live = mode.reshard_after_forward and p == 1
    per_param = gathered_param_bytes / psi if psi else gather_bytes
    gathered = 2 * layer_params * per_param if two_layers_live else gathered_param_bytes
    params_mem = psi * pb / d + gathered
    grads_mem = tr * 4 if (m > 1 and mode.grads_accumulate_unsharded) else tr * pb / d
    n_gathers = m if mode.gathers_every_microbatch else 1
    comm = n_gathers * exposed(ag, fwd_window)
    if mode.reshard_after_forward:  # FSDP1 BACKWARD_POST: the backward gather is not hidden
        comm += m * (ag if rt.fsdp_backward_gather_exposed else exposed(ag, bwd_window))
    comm += (m if mode.reduce_every_microbatch else 1) * exposed(rs, bwd_window)
    return DataParallelCost(comm, params_mem, grads_mem, optimizer_bytes)
