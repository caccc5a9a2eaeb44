"""Attention with masks a fused kernel does not take: sliding windows, logit soft-capping, sinks.

Causal attention with nothing else runs on ``F.scaled_dot_product_attention`` (`is_causal`),
and under context parallel on the ring (`autosearch.distributed.context_parallel`). A sliding
window, soft-capped logits (Gemma 2: ``c * tanh(scores / c)``, Gemma Team 2024, sec. 2) or
per-head sink logits (gpt-oss: a learned logit per head joins the softmax and is dropped after
it; Xiao et al. 2024, "attention sinks") need the mask, or the scores, in hand. `visible` builds
the mask from the queries' and keys' global positions, so that the same code is exact on one
process and under context parallel, where the keys of the whole sequence are all-gathered with
their positions (`ContextParallel.whole_keys`); `masked_attention` computes the attention as
transformers' eager functions do. Shared by the reference transformer and the Hugging Face
adapters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:  # pragma: no cover
    from autosearch.distributed.context_parallel import ContextParallel


def positions(
    k: torch.Tensor, v: torch.Tensor, queries: int, cp: "ContextParallel | None"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(keys, values, query positions, key positions): this process's keys and values and
    positions 0..n-1, or under context parallel the whole sequence's keys and values with the
    global positions of this rank's `queries` and of every key."""
    if cp is not None:
        return cp.whole_keys(k, v)
    q_pos = torch.arange(queries, device=k.device)
    return k, v, q_pos, torch.arange(k.shape[2], device=k.device)


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """(queries, keys): True where a query sees a key: not after it, and within `window` keys
    of it (query - key < window, as transformers' sliding-window masks) when given."""
    distance = q_pos[:, None] - k_pos[None, :]
    seen = distance >= 0
    return seen if window is None else seen & (distance < window)


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seen: torch.Tensor,
    *,
    scaling: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """softmax(scores) V over the keys a query sees; q, k, v are (batch, heads, sequence,
    head_dim), k and v with fewer heads under grouped-query attention; returns (batch, heads,
    sequence, head_dim).

    Without a cap or sinks: SDPA under the boolean mask. With `softcap`: transformers' Gemma 2
    eager path (scores capped, then masked, softmax in fp32). With `sinks` (one logit per head of
    `q`): transformers' gpt-oss eager path (the sink joins the softmax, its column dropped)."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=seen,
            dropout_p=dropout_p,
            scale=scaling,
            enable_gqa=k.shape[1] != q.shape[1],
        )
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)  # transformers' repeat_kv
    v = v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~seen, torch.finfo(scores.dtype).min)
    if sinks is None:
        # in fp32 (transformers' eager), or the inputs' dtype where that is wider
        wide = torch.promote_types(scores.dtype, torch.float32)
        weights = F.softmax(scores, dim=-1, dtype=wide).to(q.dtype)
    else:
        sink = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], -1)
        scores = torch.cat([scores, sink.to(scores.dtype)], dim=-1)
        scores = scores - scores.max(dim=-1, keepdim=True).values
        weights = F.softmax(scores, dim=-1, dtype=scores.dtype)[..., :-1]
    weights = F.dropout(weights, p=dropout_p, training=dropout_p > 0).to(v.dtype)
    return torch.matmul(weights, v)
