"""Pipeline parallel: the layers of each pipeline rank, one micro-batch on the slowest rank with
its point-to-point sends, and the bubble (Narayanan et al. 2021, sec. 2.2)."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from cost_models.formulas import bubble_microbatches, p2p_time_s
from cost_models.terms._base import ACT_BYTES, Context, LayerCosts, all_gather_s, reads
from cost_models.terms.compute import recompute_repeats, recomputed_layers

if TYPE_CHECKING:  # pragma: no cover
    from autosearch.core.model_spec import ModelSpec
    from autosearch.core.strategy import Strategy
    from cost_models.terms.layers import KindCosts


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


@reads("pp", "virtual_stages", "pipeline_split")
def rank_layers(s: "Strategy", ctx: Context) -> tuple[int | float, ...]:
    """Layers each pipeline rank holds (chunk c runs on rank c mod pp). The last rank also
    runs the multi-token prediction modules (`ModelSpec.mtp_layers`), each a layer of the
    last layer's kind (Megatron-Core puts them with the loss, on the last stage)."""
    p, L, mtp = s.pp, ctx.model.n_layers, ctx.model.mtp_layers
    if s.pipeline_split is None and L % (p * s.virtual_stages) == 0:
        ranks: tuple[int | float, ...] = (L / p,) * p
    else:
        chunks = s.layers_per_chunk(L)
        ranks = tuple(sum(chunks[r::p]) for r in range(p))
    return ranks[:-1] + (ranks[-1] + mtp,) if mtp else ranks


def heads(model: "ModelSpec") -> float:
    """Output heads of the last rank, in units of the logits' work: the model's, and for each
    multi-token prediction module its own head with its loss and its 2h -> h projection
    (2h^2 weights against the head's V h: 2h / V of a head; DeepSeek-V3 tech report, eq. 21)."""
    return 1.0 + model.mtp_layers * (1.0 + 2.0 * model.hidden_size / model.vocab_size)


@reads(
    "pp",
    "recompute",
    "recompute_num_layers",
    "virtual_stages",
    "tp",
    "dp",
    "cp",
    "micro_batch_size",
    "sequence_parallel",
    "amp",
)
def microbatch(
    s: "Strategy",
    ctx: Context,
    layer: LayerCosts,
    ranks: tuple[int | float, ...],
    kinds: "tuple[KindCosts, ...]" = (),
) -> MicrobatchTime:
    """One micro-batch on the slowest pipeline rank: its blocks, embedding or logits,
    recompute, tensor-parallel collectives and pipeline sends. Every block is priced as a base
    block (`layer`); the blocks of each other kind on a rank add what `kinds` say
    (`cost_models.terms.layers`)."""
    p = s.pp
    tp_fwd = layer.tp_comm_fwd_s
    rc_layer, rc_tp = recompute_repeats(s, layer)
    n_heads = heads(ctx.model)
    best = None
    seen = set()  # ranks alike (blocks, first, last, blocks of each kind) cost alike: once
    counts = tuple(zip(*(k.counts for k in kinds))) if kinds else ((),) * p
    for r, Lr in enumerate(ranks):
        first, last = r == 0, r == p - 1
        kind = (Lr, first, last, counts[r])
        if kind in seen:
            continue
        seen.add(kind)
        n_rc = recomputed_layers(s, Lr)
        compute = (
            Lr * (layer.fwd_s + layer.bwd_s)
            + (layer.embedding_s if first else 0.0)
            + (n_heads * layer.logits_s if last else 0.0)
        )
        if n_rc == Lr:
            tp = Lr * ((2.0 + rc_tp) * tp_fwd)
        else:
            tp = Lr * (2.0 * tp_fwd) + n_rc * rc_tp * tp_fwd
        if first:
            tp += layer.embedding_comm_s
        if last:
            tp += (1 + ctx.model.mtp_layers) * layer.logits_comm_s
        recompute = n_rc * rc_layer
        for k in kinds:
            extra = k.rank_s(k.counts[r], Lr)
            compute, recompute, tp = compute + extra[0], recompute + extra[1], tp + extra[2]
        total = compute + recompute + tp
        if best is None or total > best[0]:
            best = (total, compute, recompute, tp)
    assert best is not None
    _, stage_compute, stage_rc, stage_tp = best
    return MicrobatchTime(stage_compute, stage_rc, stage_tp, _p2p_s(s, ctx), rc_layer)


def _p2p_s(s: "Strategy", ctx: Context) -> float:
    """Pipeline point-to-point of one micro-batch: it crosses every chunk boundary forward and
    back; each tp rank sends 1/t (Narayanan et al. 2021, sec. 4.1)."""
    p, t = s.pp, s.tp
    if p <= 1:
        return 0.0
    model, rt, sp = ctx.model, ctx.runtime, s.sequence_parallel
    split = sp or rt.pp_scatter_gather
    ab = ACT_BYTES[s.amp]
    tokens = s.micro_batch_size * model.seq_len / s.cp
    nbytes = tokens * model.hidden_size * ab / (t if split else 1)
    one = p2p_time_s(nbytes, *ctx.link(p, s.dp * t * s.cp, "p2p"))
    if rt.pp_scatter_gather and not sp:
        one += all_gather_s(ctx, nbytes * t, t, 1)
    return 2.0 * s.virtual_stages * one


@reads("pp", "virtual_stages")
def bubble_s(s: "Strategy", microbatch_s: float) -> float:
    """Idle seconds of the pipeline bubble: (p-1)/v micro-batch times (Narayanan et al. 2021,
    sec. 2.2; `formulas.bubble_microbatches`)."""
    return bubble_microbatches(s.pp, s.virtual_stages) * microbatch_s
