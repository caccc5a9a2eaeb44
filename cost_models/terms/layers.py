"""The layers of a model by kind: how the cost model prices a sequence of unequal layers.

A model is a sequence of blocks (`ModelSpec.layers`: a mixer and an MLP each). The base block,
attention with a dense MLP, is priced once per strategy by compute, tensor parallel and context
parallel (`LayerCosts`) and memory. Every other kind of block is priced once per strategy as what
it adds to the base (`KindCosts`), by the term module `KINDS` names for it; the pipeline sums,
on each rank, its blocks of every kind (`pipeline.microbatch`), data parallelism hides behind the
rank's blocks of every kind, and a kind whose parameters live in their own data-parallel group
(the routed experts over edp) says so (`KindCosts.param_groups`). The cost model, the pipeline
and data parallelism know kinds only through this record, so a new kind of block (a Mamba-2 or
Gated DeltaNet mixer) is one term module and one entry in `KINDS`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, NamedTuple

if TYPE_CHECKING:  # pragma: no cover
    from autosearch.core.model_spec import ModelSpec
    from cost_models.terms.memory import StageParams

BASE = ("attention", "dense")


class KindCosts(NamedTuple):
    """One kind of block beyond the base, for one strategy: where its blocks are and what each
    adds to a base block, one micro-batch on one device."""

    counts: tuple[int, ...]  # its blocks on each pipeline rank
    fwd_s: float  # compute one block adds, forward (data parallelism hides behind it)
    bwd_s: float
    # (compute, recompute, traffic) seconds that n of its blocks add to a rank of L blocks
    rank_s: Callable[[int, float], tuple[float, float, float]]
    activation_bytes: float  # what its blocks keep beyond base blocks, at the peak
    # (the base group's parameters, then each group that reduces over its own data-parallel
    # group: (StageParams, (ranks, stride) or None for dp x cp)); None: the base's alone
    param_groups: "tuple[tuple[StageParams, tuple[int, int] | None], ...] | None" = None


def kinds(model: "ModelSpec") -> tuple[tuple[str, str], ...]:
    """The kinds of block of `model` other than the base, in order of first appearance."""
    return tuple(dict.fromkeys(k for k in (layer.kind for layer in model.layers) if k != BASE))
