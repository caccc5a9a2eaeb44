"""The layers of a model by kind: how the cost model prices a sequence of unequal layers.

A model is a sequence of blocks (`ModelSpec.layers`: a mixer and an MLP each). The base block,
attention with a dense MLP, is priced once per strategy by compute, tensor parallel and context
parallel (`LayerCosts`) and memory. A block of another kind differs from the base in its mixer,
its MLP or both; each such part (``("mlp", "moe")``, ``("mixer", "mamba")``, ``("mixer",
"none")``, ``("mlp", "none")``) is priced once per strategy as what it adds to the base block
(`KindCosts`, negative where it removes), by the term module `KINDS` names for it, and a block
adds what each of its parts adds: a Mamba layer without an MLP is the base block, plus a Mamba
mixer in place of the attention, less the MLP. The pipeline sums,
on each rank, its blocks of every kind (`pipeline.microbatch`), data parallelism hides behind the
rank's blocks of every kind, and a kind whose parameters live in their own data-parallel group
(the routed experts over edp) says so (`KindCosts.param_groups`). The cost model, the pipeline
and data parallelism know kinds only through this record, so a new kind of block (a Mamba-2 or
Gated DeltaNet mixer) is one term module and one entry in `KINDS`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, NamedTuple, Protocol

if TYPE_CHECKING:  # pragma: no cover
    from autosearch.core.model_spec import ModelSpec
    from autosearch.core.strategy import Strategy
    from cost_models.terms._base import LayerCosts
    from cost_models.terms.memory import StageParams

BASE = ("attention", "dense")


class KindCosts(NamedTuple):
    """One kind of block beyond the base, for one strategy: where its blocks are and what each
    adds to a base block, one micro-batch on one device."""

    counts: tuple[int, ...]  # blocks with this part on each pipeline rank
    fwd_s: float  # compute one block adds, forward (data parallelism hides behind it)
    bwd_s: float
    # (compute, recompute, traffic) seconds that n of its blocks add to a rank of L blocks
    rank_s: Callable[[int, float], tuple[float, float, float]]
    activation_bytes: float  # what its blocks keep beyond base blocks, at the peak
    # (the base group's parameters, then each group that reduces over its own data-parallel
    # group: (StageParams, (ranks, stride) or None for dp x cp)); None: the base's alone
    param_groups: "tuple[tuple[StageParams, tuple[int, int] | None], ...] | None" = None
    # parameters one block of it adds to the base group on one device before data-parallel
    # sharding (a Mamba mixer's less an attention's; negative for a part that removes)
    block_params: float = 0.0


class KindTerm(Protocol):
    """What prices one part (`KINDS`): built once per (model, cluster, runtime), asked for its
    `KindCosts` under each strategy with the base block's costs."""

    def costs(self, s: "Strategy", base: "LayerCosts") -> KindCosts: ...


def parts(kind: tuple[str, str]) -> tuple[tuple[str, str], ...]:
    """The parts in which a kind of block (mixer, mlp) differs from the base block."""
    mixer, mlp = kind
    return tuple(
        part
        for part, differs in ((("mixer", mixer), mixer != BASE[0]), (("mlp", mlp), mlp != BASE[1]))
        if differs
    )


def kinds(model: "ModelSpec") -> tuple[tuple[str, str], ...]:
    """The parts (`parts`) in which blocks of `model` differ from the base, in order of first
    appearance: what the cost model prices beyond the base block."""
    return tuple(dict.fromkeys(p for layer in model.layers for p in parts(layer.kind)))


def rank_counts(
    model: "ModelSpec", part: tuple[str, str], chunks: tuple[int, ...], pp: int
) -> tuple[int, ...]:
    """Blocks with `part` on each pipeline rank (chunk c of consecutive blocks runs on rank c
    mod pp); the multi-token prediction modules count on the last rank where the last block
    has it (`pipeline.rank_layers`)."""
    flags = [part in parts(layer.kind) for layer in model.layers]
    counts = [0] * pp
    start = 0
    for c, size in enumerate(chunks):
        counts[c % pp] += sum(flags[start : start + size])
        start += size
    if flags[-1]:
        counts[-1] += model.mtp_layers
    return tuple(counts)
