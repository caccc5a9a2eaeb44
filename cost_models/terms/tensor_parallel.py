"""Tensor parallel: the collectives of one layer, and of the vocabulary-parallel embedding and
logits, over the tp ranks (adjacent: stride 1)."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from cost_models.terms._base import (
    ACT_BYTES,
    Context,
    all_gather_s,
    all_reduce_s,
    reads,
    reduce_scatter_s,
)

if TYPE_CHECKING:  # pragma: no cover
    from autosearch.core.strategy import Strategy


class TensorParallelComm(NamedTuple):
    """Tensor-parallel communication of one micro-batch on one device (seconds)."""

    layer_fwd_s: float  # exposed collectives of one layer's forward
    embedding_s: float  # the vocabulary-parallel embedding's all-reduce
    logits_s: float  # the g operator before the vocabulary-parallel logits


@reads("tp", "micro_batch_size", "amp", "sequence_parallel", "cp", "async_tp")
def layer_comm(s: "Strategy", ctx: Context) -> TensorParallelComm:
    """Two all-reduces of the T x h activation forward and two backward per layer (the f and g
    operators of Shoeybi et al. 2019, Fig. 4). Sequence parallel replaces each by a
    reduce-scatter + all-gather pair of the same total volume (Korthikanti et al. 2022, sec.
    4.2.2), at their own measured rates; async TP hides part of them behind the GEMMs. The
    vocabulary-parallel embedding and logits need one such collective each (Shoeybi et al. 2019,
    sec. 3)."""
    m, rt, t, ab = ctx.model, ctx.runtime, s.tp, ACT_BYTES[s.amp]
    tokens = s.micro_batch_size * m.seq_len / s.cp  # context parallel splits the sequence
    sbh = tokens * m.hidden_size
    if s.sequence_parallel:
        pair = all_gather_s(ctx, sbh * ab, t, 1) + reduce_scatter_s(ctx, sbh * ab, t, 1)
    else:
        pair = all_reduce_s(ctx, sbh * ab, t, 1)
    overlap = rt.async_tp_overlap if s.async_tp else rt.tp_overlap
    return TensorParallelComm(2.0 * pair * (1.0 - overlap), pair, pair)
