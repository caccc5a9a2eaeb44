"""Context parallel: the sequence split over cp ranks (stride tp: mesh pp, dp, cp, tp), attention
by exchange of keys and values (torch's context parallel; Liu et al. 2023)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cost_models.terms._base import ACT_BYTES, Context, all_gather_s, reads, reduce_scatter_s
from cost_models.terms.compute import attention_widths

if TYPE_CHECKING:  # pragma: no cover
    from autosearch.core.strategy import Strategy


@reads("cp", "tp", "micro_batch_size", "amp")
def layer_comm(
    s: "Strategy", ctx: Context, attention_fwd_s: float, attention_bwd_s: float
) -> float:
    """Exposed seconds of one layer's context-parallel traffic: keys and values of the whole
    sequence all-gathered for forward, gathered again with their gradients (fp32) reduced in
    backward, over the cp ranks; each hides behind the attention core of the same layer
    (`attention_fwd_s`, `attention_bwd_s`), all but one ring step of it. K and V travel at the
    width the attention kernel receives them: the full head count where the model expands them
    first (torchtitan's `repeat_kv` before SDPA, docs/runtimes.md [1.5]), else `n_kv_heads`."""
    cp = s.cp
    if cp <= 1:
        return 0.0
    m, rt, t, ab = ctx.model, ctx.runtime, s.tp, ACT_BYTES[s.amp]
    q_width, kv_width, _ = attention_widths(m)
    kv = q_width if rt.attention_kv_expanded else kv_width  # expanded: every head's K/V
    kv_bytes = 2 * s.micro_batch_size * m.seq_len * kv / t * ab
    gather = all_gather_s(ctx, kv_bytes, cp, t)
    reduce = reduce_scatter_s(ctx, kv_bytes * 4 / ab, cp, t)
    # backward exchanges K and V again (the rotater re-gathers them: torch
    # `_templated_ring_attention_backward`, TE's KV ring) next to the gradients' reduction
    backward = gather + reduce
    return max(gather - attention_fwd_s, gather / cp) + max(
        backward - attention_bwd_s, backward / cp
    )


@reads("cp", "tp", "micro_batch_size", "amp")
def attention_backward_bytes(s: "Strategy", ctx: Context) -> float:
    """What one layer's context-parallel attention backward holds beyond the layer's
    activations (torch `_templated_ring_attention_backward` with the allgather rotater,
    docs/runtimes.md [1.5]): K and V of the whole sequence gathered in the amp dtype, one
    ring step's SDPA gradients, fp32 accumulators of dQ, dK, dV for the local shard, and the
    fp32 dK, dV buffers sent and received round the ring."""
    rt, m, cp, t = ctx.runtime, ctx.model, s.cp, s.tp
    if cp <= 1 or not rt.cp_all_gather_kv:
        return 0.0
    ab = ACT_BYTES[s.amp]
    q, kv_width, _ = attention_widths(m)
    kv = q if rt.attention_kv_expanded and m.mla is None else kv_width
    local = s.micro_batch_size * m.seq_len / cp  # tokens of the local shard
    gathered = 2 * local * cp * kv / t * ab
    qkv = local * (q + 2 * kv) / t
    return gathered + qkv * ab + 4 * qkv + 2 * 4 * local * 2 * kv / t
