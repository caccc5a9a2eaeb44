"""What every term shares: the context it reads, how it declares the strategy fields it reads, the
per-layer record the pipeline multiplies out, and the collectives over a group of ranks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, NamedTuple, TypeVar

from cost_models.formulas import (
    all_to_all_time_s,
    nccl_reduce_time_s,
    nccl_ring_time_s,
    nccl_tree_all_reduce_time_s,
    p2p_time_s,
    ring_all_gather_time_s,
    ring_all_reduce_time_s,
    ring_reduce_scatter_time_s,
    tree_all_reduce_time_s,
)

if TYPE_CHECKING:  # pragma: no cover
    from autosearch.core.hardware import HardwareProfile
    from autosearch.core.model_spec import ModelSpec
    from autosearch.core.runtime import RuntimeOptions

ACT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "tf32": 4}

Term = TypeVar("Term", bound=Callable)


def reads(*fields: str) -> Callable[[Term], Term]:
    """Declare the Strategy fields a term reads (its ``READS``): the cost model caches a term's
    results keyed by exactly these, and tests/test_terms.py fails if the term reads another."""

    def declare(term: Term) -> Term:
        term.READS = fields  # type: ignore[attr-defined]  # a function attribute
        return term

    return declare


def fields_read(*terms: Callable) -> tuple[str, ...]:
    """The Strategy fields the `terms` read together, in order of first declaration."""
    declared = [term.READS for term in terms]  # type: ignore[attr-defined]
    return tuple(dict.fromkeys(name for names in declared for name in names))


class Context(NamedTuple):
    """What a term reads besides the strategy; fixed for one (model, cluster, runtime)."""

    model: "ModelSpec"
    profile: "HardwareProfile"  # with the runtime's changes (`RuntimeOptions.on`)
    runtime: "RuntimeOptions"
    # (group, stride, op) -> (latency_s, bandwidth_bytes_per_s) of a collective over `group`
    # ranks `stride` apart (`AnalyticCostModel.group_link` with the op's measured factor)
    link: Callable[[int, int, str], tuple[float, float]]
    # devices that talk over NVLink (a node, or a rack: GB200 NVL72): which steps of a ring
    # cross the network
    nvlink_domain: int = 8


def nodes_spanned(ctx: Context, group: int, stride: int) -> int:
    """NVLink domains (nodes, or racks) a group of `group` ranks `stride` apart spans (ranks laid
    out as in `AnalyticCostModel.group_link`)."""
    gpn = ctx.nvlink_domain
    if group * stride <= gpn:
        return 1
    per_node = max(1, min(group, gpn // stride)) if stride < gpn else 1
    return -(-group // per_node)


class LayerCosts(NamedTuple):
    """One transformer layer and one micro-batch on one device (seconds), plus the embedding and
    logits work of the first and last pipeline stage: compute, tensor and context parallel
    composed (`AnalyticCostModel` caches it)."""

    fwd_s: float
    bwd_s: float
    attention_recompute_s: float  # what selective recompute repeats: the attention core
    tp_comm_fwd_s: float  # exposed tensor- and context-parallel collectives of one forward
    embedding_s: float  # forward + backward
    logits_s: float  # forward + backward, with the loss
    embedding_comm_s: float
    logits_comm_s: float
    op_recompute_s: float  # what selective op recompute repeats: every other matmul, elementwise


# ---- collectives over `group` ranks `stride` apart (formulas.py's alpha-beta model) ------------
# On GPUs, NCCL's own model of its algorithms and protocols (formulas.nccl_ring_time_s): the
# profile's alpha is the Simple protocol's latency of one ring step on each link. On CPUs (gloo)
# the plain ring, whose alpha and beta calibration measures per collective.
def _nccl(ctx: Context, group: int, stride: int) -> tuple[int, float, float] | None:
    """(nodes, intra-node alpha, inter-node alpha) where NCCL runs the collectives, else None."""
    prof = ctx.profile
    if prof.device_type != "cuda":
        return None
    nodes = nodes_spanned(ctx, group, stride)
    return nodes, prof.intra_node.latency_s, prof.inter_node.latency_s


def all_reduce_s(ctx: Context, nbytes: float, group: int, stride: int) -> float:
    if group <= 1:
        return 0.0
    link = ctx.link(group, stride, "all_reduce")
    nccl = _nccl(ctx, group, stride)
    if nccl is not None:  # NCCL runs the faster of ring and tree (tree: log N latency)
        return min(
            nccl_ring_time_s(nbytes, group, *nccl, link[1], passes=2),
            nccl_tree_all_reduce_time_s(nbytes, group, *nccl, link[1]),
        )
    return min(
        ring_all_reduce_time_s(nbytes, group, *link),
        tree_all_reduce_time_s(nbytes, group, *link),
    )


def all_gather_s(ctx: Context, nbytes: float, group: int, stride: int) -> float:
    if group <= 1:
        return 0.0
    link = ctx.link(group, stride, "all_gather")
    nccl = _nccl(ctx, group, stride)
    if nccl is not None:
        return nccl_ring_time_s(nbytes, group, *nccl, link[1])
    return ring_all_gather_time_s(nbytes, group, *link)


def reduce_scatter_s(ctx: Context, nbytes: float, group: int, stride: int) -> float:
    if group <= 1:
        return 0.0
    link = ctx.link(group, stride, "reduce_scatter")
    nccl = _nccl(ctx, group, stride)
    if nccl is not None:
        return nccl_ring_time_s(nbytes, group, *nccl, link[1])
    return ring_reduce_scatter_time_s(nbytes, group, *link)


def reduce_s(ctx: Context, nbytes: float, group: int, stride: int) -> float:
    """A reduce of `nbytes` to one rank of the group (pipelined over a ring: one step's latency,
    the whole buffer over each link)."""
    if group <= 1:
        return 0.0
    link = ctx.link(group, stride, "reduce_scatter")
    if ctx.profile.device_type == "cuda":
        return nccl_reduce_time_s(nbytes, *link)
    return p2p_time_s(nbytes, *link)


def all_to_all_s(ctx: Context, nbytes: float, group: int, stride: int) -> float:
    """An all-to-all in which each of `group` ranks (`stride` apart) sends `nbytes` in all,
    1/group of it to each rank. Within one NVLink domain, pairwise exchange over NVLink
    (`formulas.all_to_all_time_s`). Across domains, the k members of a domain exchange their
    (k-1)/n share over NVLink while the (n-k)/n share leaves through the NICs, k members of a
    domain sharing what the dense collectives get across nodes (`AnalyticCostModel.group_link`:
    min(NVLink, k x NIC)); the two run concurrently (NCCL issues every send at once)."""
    if group <= 1:
        return 0.0
    domain = ctx.nvlink_domain
    if group * stride <= domain:
        return all_to_all_time_s(nbytes, group, *ctx.link(group, stride, "all_to_all"))
    k = max(1, min(group, domain // stride)) if stride < domain else 1
    latency, bandwidth = ctx.link(group, stride, "all_to_all")
    inter = (group - k) * latency + (group - k) / group * nbytes * k / bandwidth
    if k == 1:
        return inter
    intra = all_to_all_time_s(nbytes * k / group, k, *ctx.link(k, stride, "all_to_all"))
    return max(intra, inter)
