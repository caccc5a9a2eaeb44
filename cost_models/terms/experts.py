"""Mixture-of-experts layers: what a MoE layer costs beyond a dense one, and where the experts'
parameters live.

A MoE layer is the dense layer with its MLP replaced by: the router (a T x h x E GEMM and the
top-k), the permutation of the routed tokens and its inverse, the all-to-all dispatch and
combine over the ep ranks (and an all-gather / reduce-scatter over the etp ranks), the routed
experts as grouped GEMMs at the per-expert token count, and the shared experts as a dense MLP
(Megatron-Core MoELayer with the alltoall token dispatcher and grouped GEMM; torchtitan's MoE).
Expert layers run etp x ep x edp over the ranks attention runs tp x dp x cp on (Megatron-Core's
parallel folding): ep groups take ranks `etp` apart, the expert data-parallel group ranks
`etp * ep` apart.

Conventions as compute.py: T tokens of one micro-batch on the tp group, t = tp; each rank routes
T_r = T / t tokens under sequence parallelism (T without it), sends T_r k of them (top-k) and
computes T_r k etp rows over its E / ep local experts at width f_e / etp.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

from cost_models.formulas import microbatches_in_flight
from cost_models.terms._base import (
    ACT_BYTES,
    Context,
    LayerCosts,
    all_gather_s,
    all_to_all_s,
    fields_read,
    reads,
    reduce_scatter_s,
)
from cost_models.terms.compute import (
    MLP_ACTIVATION_PASSES,
    attention_widths,
    elementwise_s,
    gemm_rate,
    layer_shape,
    recomputed_layers,
    stream_s,
)
from cost_models.terms.layers import KindCosts
from cost_models.terms.memory import StageParams, mtp_head_params
from cost_models.terms.offload import LAYERS_ON_DEVICE, host_rates

if TYPE_CHECKING:  # pragma: no cover
    from autosearch.core.hardware import GemmEfficiency
    from autosearch.core.strategy import Strategy


class ExpertLayer(NamedTuple):
    """What one MoE layer adds to a dense layer, one micro-batch on one device (seconds)."""

    fwd_s: float  # compute forward: router, permutation, experts, shared experts - dense MLP
    bwd_s: float
    comm_fwd_s: float  # exposed all-to-all (and etp) traffic of one forward, less the MLP's tp
    op_recompute_s: float  # what selective op recompute repeats beyond the dense layer's
    rows: float  # routed rows this rank computes (for memory)
    host_s: float  # the runtime's host time of one MoE layer, forward and backward
    offload_copy_s: float = 0.0  # one way's host copy of the offloaded module inputs
    modules_s: float = 0.0  # per-module recompute (`recompute_modules`) of one MoE layer
    modules_comm: float = 0.0  # forwards' worth of MoE traffic it repeats (moe: one)
    dense_modules_s: float = 0.0  # per-module recompute of one dense layer


# A GPU's grouped GEMM computes each group in tiles of 128 rows (CUTLASS's SM90 grouped kernels
# behind torch._grouped_mm, as TransformerEngine's): a group of fewer rows costs a whole tile.
# Measured on an H200 (results/gpu/h200-grouped-gemm, 102 expert shapes of six MoE models): at
# 32 and 64 rows per expert the kernel takes 2.2x and 1.5x what the dense shape model gives
# (fwd + bwd), 1.2x and 1.1x with the tile; from 256 rows on within 6% either way.
GROUPED_TILE_ROWS = 128


def grouped_gemm_s(
    gemm: "GemmEfficiency",
    groups: float,
    m: float,
    n: float,
    k: float,
    peak: float,
    key: str,
    tile_rows: float = 0.0,
) -> float:
    """`groups` GEMMs of m x n x k (one per local expert, m its tokens) as one grouped GEMM: one
    launch, each group at the profile's efficiency for its shape (small per-expert token counts
    run far below the ceiling), a group of fewer than `tile_rows` rows as one of `tile_rows`.
    benchmarks/grouped_gemm.py measures it against ``torch._grouped_mm`` on a GPU.

    Each group on the smooth shape curve (`GemmEfficiency.smooth_time_s`) even where the
    profile has tiles: the tiles of all groups in waves over the SMs (`grouped_time_s`) read
    the H200 measurement worse (results/gpu/h200-grouped-gemm: the expert MLP's MAPE 18.9%
    -> 27.8% under the torch preset, -49% to -55% at 128 rows per expert), since the
    backward's weight gradient runs with K = the rows per expert, which `backward_over_forward`
    = 2 does not see (measured 2.47-2.7)."""
    rows = max(m, tile_rows)
    return gemm.launch_s + groups * (gemm.smooth_time_s(rows, n, k, peak, key) - gemm.launch_s)


def routed_share(s: "Strategy", ctx: Context) -> float:
    """Routed rows the busiest rank computes, over its even share: `moe_load_imbalance` for
    dropless routing, capped by the capacity factor when experts drop tokens (Fedus et al.
    2022: an expert takes at most capacity_factor x its even share). Without expert
    parallelism every rank holds every expert and computes exactly its own tokens' T k rows:
    no rank waits for a busier one (1)."""
    moe = ctx.model.moe
    assert moe is not None  # only MoE models reach here
    if s.ep == 1:
        return 1.0
    share = ctx.runtime.moe_load_imbalance
    cap = moe.capacity_factor
    return share if cap is None else min(share, cap)


@reads(
    "tp",
    "etp",
    "ep",
    "micro_batch_size",
    "amp",
    "sequence_parallel",
    "cp",
    "fp8",
    "compile",
    "async_tp",
    "recompute",
    "recompute_modules",
)
def layer(s: "Strategy", ctx: Context) -> ExpertLayer:
    """One MoE layer's MLP against the dense MLP it replaces."""
    m, prof, rt = ctx.model, ctx.profile, ctx.runtime
    moe = m.moe
    assert moe is not None
    x = layer_shape(s, ctx)
    gemm = prof.gemm
    peak, key = gemm_rate(ctx, x)
    elementwise = elementwise_s(ctx, x)
    h, t, ab, T, n_up = m.hidden_size, s.tp, x.ab, x.T, x.n_up
    passes = MLP_ACTIVATION_PASSES[m.ffn_activation]
    E, k, etp, ep = moe.n_experts, moe.top_k, s.etp, s.ep
    sp = s.sequence_parallel and t > 1
    T_r = T / t if sp else T  # tokens this rank routes
    rows = T_r * k * (etp if sp else 1)  # routed rows it computes, gathered over etp
    local = E / ep  # experts on this rank
    per_expert = rows / local  # tokens of one expert's GEMM (balanced)
    f_e = moe.ffn_hidden_size / etp

    tile = GROUPED_TILE_ROWS if prof.device_type != "cpu" else 0.0

    def grouped(n: float, kk: float) -> float:
        return grouped_gemm_s(gemm, local, per_expert, n, kk, peak, key, tile)

    imbalance = routed_share(s, ctx)
    # a release's expert kernels slower than its other GEMMs there (RuntimeOptions)
    slower = dict(rt.expert_kernel_efficiency).get(prof.architecture, 1.0)
    expert_gemm = imbalance * (grouped(n_up * f_e, h) + grouped(h, f_e)) / slower
    expert_elem = imbalance * elementwise(passes * rows * f_e * ab)
    # the router in the amp dtype, softmax / sigmoid and top-k over fp32 scores (read, write
    # and the top-k read), the probabilities applied at the combine
    router = gemm.time_s(T_r, E, h, x.peak, x.precision)
    router_elem = stream_s(ctx, 3 * T_r * E * 4) + elementwise(2 * rows * h * ab)
    # permute (gather T_r tokens into rows) and un-permute (scatter-add back): read and write
    permute = stream_s(ctx, (T_r + rows) * h * ab) * 2
    shared_width = moe.n_shared_experts * moe.shared_ffn_hidden_size / t
    shared_gemm = shared_elem = 0.0
    if shared_width:
        shared_gemm = gemm.time_s(T, n_up * shared_width, h, peak, key) + gemm.time_s(
            T, h, shared_width, peak, key
        )
        shared_elem = elementwise(passes * T * shared_width * ab)
    f = m.ffn_hidden_size / t
    dense_gemm = gemm.time_s(T, n_up * f, h, peak, key) + gemm.time_s(T, h, f, peak, key)
    dense_elem = elementwise(passes * T * f * ab)
    gemms = router + expert_gemm + shared_gemm - dense_gemm
    elem = router_elem + permute + expert_elem + shared_elem - dense_elem
    bof = gemm.backward_over_forward
    fp8_fwd, fp8_bwd = _fp8_scaling_s(s, ctx, rows * imbalance, f_e, shared_width)
    fwd = gemms + elem + fp8_fwd
    bwd = bof * gemms + 2.0 * elem + fp8_bwd
    # selective op recompute (torchtitan's SAC, the Engine's) repeats the elementwise work and
    # every routed expert GEMM: its save list is the partitioner's compute-intensive ops (mm,
    # addmm, bmm, _scaled_mm, attention) and linear, with no grouped GEMM in it (torch 2.13
    # `get_default_op_list`; torchtitan activation_checkpoint.py `_get_default_save_ops` @
    # b5bcd76), so the experts' forward runs twice (counted on the Engine: 6 more
    # `_grouped_mm` calls per step of a 2-MoE-layer model, tests/test_grouped_gemm.py); the shared
    # experts repeat the gate projection of a gated MLP (a third of its GEMMs), as a dense MLP
    op_recompute = elem + fp8_fwd + expert_gemm
    op_recompute += (shared_gemm - dense_gemm) / 3 if n_up == 2 else 0.0
    comm = _comm_fwd_s(s, ctx, T, T_r, rows, shared_gemm + shared_elem)
    # the host's time of the layer: its own and one share per expert this rank holds (the
    # per-expert GEMM launches and fp8 scaling-factor kernels, RuntimeOptions.moe_expert_host_s)
    host = rt.moe_layer_host_s + rt.moe_expert_host_s * local
    offload = _copy_s(ctx, offloaded_row_bytes(s, ctx) * rows * imbalance)
    names = modules(s)
    if not names:
        return ExpertLayer(fwd, bwd, comm, op_recompute, rows, host, offload)
    # Megatron-Core's per-module recompute repeats each named module's forward in backward
    # (transformer_config.py recompute_modules): the norms before attention and the MLP, the
    # MLA up-projections (q_b, kv_b: T x r -> heads x width, over tp), the experts'
    # activation, the shared experts, the whole MoE layer (its all-to-all included), the
    # dense layers' MLP.
    norms = elementwise(2 * 2 * T_r * h * ab) if "layernorm" in names else 0.0
    up = 0.0
    if "mla_up_proj" in names and m.mla is not None:
        mla, a = m.mla, m.n_heads / t
        if mla.q_lora_rank:
            up += gemm.time_s(T, a * mla.qk_head_dim, mla.q_lora_rank, peak, key)
        nope = mla.qk_nope_head_dim + mla.v_head_dim
        up += gemm.time_s(T, a * nope, mla.kv_lora_rank, peak, key)
    moe_s = 0.0
    if "moe" in names:
        moe_s = router + router_elem + permute + expert_gemm + expert_elem
        moe_s += shared_gemm + shared_elem + max(fp8_fwd, 0.0)
    else:
        moe_s = (expert_elem if "moe_act" in names else 0.0) + (
            shared_gemm + shared_elem if "shared_experts" in names else 0.0
        )
    dense_mlp = dense_gemm + dense_elem if "mlp" in names else 0.0
    return ExpertLayer(
        fwd,
        bwd,
        comm,
        op_recompute,
        rows,
        host,
        offload,
        modules_s=norms + up + moe_s,
        modules_comm=1.0 if "moe" in names else 0.0,
        dense_modules_s=norms + up + dense_mlp,
    )


def offloaded_row_bytes(s: "Strategy", ctx: Context) -> float:
    """Bytes per routed row that Megatron-Core's fine-grained activation offloading moves to
    the host (`RuntimeOptions.activation_offload_modules`; --offload-modules: each module's
    input goes down in forward and comes back before its backward, megatron-core
    docs/user-guide/features/fine_grained_activation_offloading.md): ``expert_fc1`` the
    experts' input as the first GEMM saves it (its float8 copy under fp8), ``moe_act`` the
    activation's input, the first GEMM's output (gate and up of a gated MLP, 16-bit)."""
    names = ctx.runtime.activation_offload_modules
    if not names:
        return 0.0
    m, rt = ctx.model, ctx.runtime
    assert m.moe is not None
    ab = ACT_BYTES[s.amp]
    li = 1 if s.fp8 != "none" and rt.fp8_saves_fp8_inputs else ab
    width = (2 if m.ffn_gated else 1) * m.moe.ffn_hidden_size / s.etp
    return ("expert_fc1" in names) * m.hidden_size * li + ("moe_act" in names) * width * ab


def _copy_s(ctx: Context, nbytes: float) -> float:
    """Seconds one way of `nbytes` takes over this GPU's host link."""
    return nbytes / host_rates(ctx)[0] if nbytes else 0.0


def offload_exposed_s(ctx: Context, e: ExpertLayer, base: LayerCosts) -> float:
    """What the offloaded inputs of one MoE layer add, forward and backward: each way's copy
    beyond the layer's own compute, which the runtime hides `activation_offload_overlap` of
    (Megatron-Core copies on side streams: a layer's copies run under its compute and the
    next one's; the link keeps up as long as a layer's copy is shorter than a layer)."""
    if not e.offload_copy_s:
        return 0.0
    ov = ctx.runtime.activation_offload_overlap
    fwd, bwd = base.fwd_s + e.fwd_s, base.bwd_s + e.bwd_s
    one_way = e.offload_copy_s
    return max(0.0, one_way - ov * fwd) + max(0.0, one_way - ov * bwd)


def _fp8_scaling_s(
    s: "Strategy", ctx: Context, rows: float, f_e: float, shared_width: float
) -> tuple[float, float]:
    """(forward s, backward s) of the float8 scaling a MoE layer's MLP adds over the dense
    MLP's, which `compute._fp8_scaling` counts: the same amax and cast of each linear's input
    (forward) and output gradient (backward, two layouts), and of the weights unless they are
    gathered in fp8, for the routed experts at their `rows` (the busiest rank's) and width
    `f_e`, and for the shared experts, less the dense MLP's at T tokens and ffn / tp."""
    if s.fp8 == "none":
        return 0.0, 0.0
    m, rt, moe = ctx.model, ctx.runtime, ctx.model.moe
    assert moe is not None
    x = layer_shape(s, ctx)
    h, T, ab, n_up, f = m.hidden_size, x.T, x.ab, x.n_up, m.ffn_hidden_size / x.t
    elementwise = elementwise_s(ctx, x)

    def casts(n: float, width: float) -> tuple[float, float]:  # n rows of an MLP of `width`
        return n * (h + width), n * (n_up * width + h)  # (inputs, output gradients)

    (ei, eg), (di, dg) = casts(rows, f_e), casts(T, f)
    si, sg = casts(T, shared_width) if shared_width else (0.0, 0.0)
    inputs, grads = ei + si - di, eg + sg - dg
    kernels = 2.0 if s.fp8 == "rowwise" else 1.0
    weights = 0.0  # elements of weights cast every micro-batch (none if gathered in fp8)
    if not (rt.fp8_all_gather and s.fp8 == "tensorwise"):
        local = moe.n_experts / s.ep
        weights = m.n_ffn_matrices * h * (local * f_e + shared_width - f)
    fwd = kernels * elementwise(inputs * (ab + ab + 1)) + elementwise(weights * 5)
    bwd = kernels * elementwise(grads * (ab + 2 * (ab + 1)) + inputs * (ab + 1))
    return fwd, bwd + elementwise(weights * 5)


def modules(s: "Strategy") -> tuple[str, ...]:
    """The Megatron modules `s` recomputes (`recompute_modules`); none under full recompute,
    which recomputes the whole layer (Megatron takes a module list only with selective
    granularity), and none under torchtitan's op-level recompute."""
    if s.recompute_modules == "none" or s.recompute not in ("none", "selective"):
        return ()
    return tuple(s.recompute_modules.split("+"))


def _comm_fwd_s(
    s: "Strategy", ctx: Context, T: float, T_r: float, rows: float, shared_s: float
) -> float:
    """Exposed seconds of one MoE layer's forward traffic: all-to-all dispatch and combine of
    T_r k tokens over the ep ranks (`etp` apart), the all-gather and reduce-scatter of the rows
    over the etp ranks, less the MLP's sequence-parallel pair, which the MoE layer does not run
    (the router reads the sequence shard). The busiest rank receives `moe_load_imbalance` times
    its share. The shared experts hide the all-to-all when the runtime overlaps them."""
    m, rt, ab = ctx.model, ctx.runtime, ACT_BYTES[s.amp]
    moe = m.moe
    assert moe is not None
    h, t, etp, ep = m.hidden_size, s.tp, s.etp, s.ep
    tokens = T_r * h * ab
    if rt.moe_dispatcher == "deepep":
        a2a = 2.0 * routed_share(s, ctx) * _deepep_s(ctx, tokens, ep, etp)
    else:
        a2a = 2.0 * routed_share(s, ctx) * all_to_all_s(ctx, tokens * moe.top_k, ep, etp)
    a2a *= 1.0 - rt.moe_a2a_overlap
    if etp > 1:
        a2a += all_gather_s(ctx, rows * h * ab, etp, 1) + reduce_scatter_s(
            ctx, rows * h * ab, etp, 1
        )
    if rt.moe_shared_expert_overlap and moe.n_shared_experts:
        a2a = max(a2a - shared_s, 0.0)
    if s.sequence_parallel and t > 1:  # the dense MLP's all-gather + reduce-scatter, not run
        pair = all_gather_s(ctx, T * h * ab, t, 1) + reduce_scatter_s(ctx, T * h * ab, t, 1)
        overlap = rt.async_tp_overlap if s.async_tp else rt.tp_overlap
        a2a -= pair * (1.0 - overlap)
    return a2a


def _deepep_s(ctx: Context, tokens_bytes: float, ep: int, stride: int) -> float:
    """DeepEP's dispatch (or combine) of `tokens_bytes` of tokens from each of `ep` ranks: each
    token crosses the network once per other node holding one of its top-k experts, then is
    forwarded over NVLink to each expert's rank (DeepEP README, "normal kernels": RDMA to the
    node, NVLink within it). With experts spread evenly over N nodes and routed uniformly
    (balanced routing), a token reaches (N-1) (1 - C(E - E/N, k) / C(E, k)) other nodes; the
    NVLink side moves every routed copy, as an all-to-all within the node would."""
    moe = ctx.model.moe
    assert moe is not None
    domain, E, k = ctx.nvlink_domain, moe.n_experts, moe.top_k
    per_domain = max(1, min(ep, domain // stride)) if stride < domain else 1
    nodes = ep // per_domain
    intra = all_to_all_s(ctx, tokens_bytes * k, per_domain, stride)
    if nodes <= 1:
        return intra
    away = 1.0  # probability that none of a token's k experts is on a given node
    for i in range(k):
        away *= max(0.0, (E - E / nodes - i) / (E - i))
    remote = (nodes - 1) * (1.0 - away)
    latency, bandwidth = ctx.link(ep, stride, "all_to_all")
    inter = (nodes - 1) * latency + tokens_bytes * remote * per_domain / bandwidth
    return max(intra, inter)


@reads("recompute")
def recompute_repeats(s: "Strategy", e: ExpertLayer) -> tuple[float, float]:
    """(seconds, forwards' worth of MoE traffic) a recomputed MoE layer repeats beyond a dense
    one: full recompute runs the MoE forward again, all-to-all included; selective recompute
    the attention core only (nothing more); selective op recompute the op share."""
    return {
        "full": (e.fwd_s, 1.0),
        "selective": (0.0, 0.0),
        "selective_op": (e.op_recompute_s, 0.0),
        "none": (0.0, 0.0),
    }[s.recompute]


@reads("pp", "virtual_stages", "pipeline_split")
def rank_moe_layers(s: "Strategy", ctx: Context) -> tuple[int, ...]:
    """MoE layers of each pipeline rank (`ModelSpec.moe_layers`; chunk c of consecutive layers
    runs on rank c mod pp); the multi-token prediction modules count on the last rank where
    the last layer is a MoE layer (`pipeline.rank_layers`)."""
    flags, p = ctx.model.moe_layers, s.pp
    counts = [0] * p
    start = 0
    for c, size in enumerate(s.layers_per_chunk(ctx.model.n_layers)):
        counts[c % p] += sum(flags[start : start + size])
        start += size
    if flags[-1]:
        counts[-1] += ctx.model.mtp_layers
    return tuple(counts)


def routed_params(ctx: Context) -> int:
    """Weights of one MoE layer's routed experts (E x matrices x h x f_e)."""
    m = ctx.model
    moe = m.moe
    assert moe is not None
    return moe.n_experts * m.n_ffn_matrices * m.hidden_size * moe.ffn_hidden_size


@reads("tp", "pp", "ep", "etp")
def stage_params(
    s: "Strategy", ctx: Context, ranks: tuple[int | float, ...], moe_ranks: tuple[int, ...]
) -> tuple[StageParams, StageParams]:
    """(the rest, the routed experts) of the heaviest pipeline rank before data-parallel
    sharding: the rest split over tp (a MoE layer's attention, norms, router and shared
    experts, its dense layers, embeddings), the routed experts over etp x ep."""
    m, t, p = ctx.model, s.tp, s.pp
    dense = m.layer_params / t
    moe_rest = (m.moe_layer_params - routed_params(ctx)) / t
    expert = routed_params(ctx) / (s.etp * s.ep)
    emb = m.embedding_params / t
    tied = m.vocab_size * m.hidden_size if m.tied_embeddings and p > 1 else 0
    head = (m.head_params + tied + mtp_head_params(m, p)) / t
    best = None
    for r, (Lr, n) in enumerate(zip(ranks, moe_ranks)):
        rest = (Lr - n) * dense + n * moe_rest
        rest += (emb if r == 0 else 0.0) + (head if r == p - 1 else 0.0)
        if p == 1:
            rest = (Lr - n) * dense + n * moe_rest + emb + head
        if best is None or rest + n * expert > best[0] + best[1]:
            best = (rest, n * expert)
    assert best is not None
    return StageParams(best[0], dense), StageParams(best[1], expert)


@reads(
    "tp",
    "etp",
    "ep",
    "micro_batch_size",
    "sequence_parallel",
    "amp",
    "cp",
    "recompute",
    "pp",
    "virtual_stages",
    "pipeline_schedule",
    "global_batch_size",
    "dp",
    "recompute_modules",
    "pipeline_split",
    "fp8",
    "compile",
)
def activation_bytes(
    s: "Strategy", ctx: Context, e: ExpertLayer, moe_ranks: tuple[int, ...]
) -> float:
    """Activations the MoE layers of the most loaded rank keep beyond dense layers, at the
    peak: per layer and micro-batch the router's fp32 scores and probabilities, the routed
    rows into and out of the experts and the experts' intermediates (the dense MLP's
    accounting at the rows and width f_e / etp), the shared experts', less the dense MLP's;
    plus the dispatch send buffer of the layer in flight (the receive buffer is the experts'
    input, counted above; Megatron-Core's alltoall dispatcher). Full recompute keeps only the
    layer input, as a dense layer."""
    m, rt = ctx.model, ctx.runtime
    moe = m.moe
    assert moe is not None
    ab, t, T = ACT_BYTES[s.amp], s.tp, s.micro_batch_size * m.seq_len / s.cp
    li = 1 if s.fp8 != "none" and rt.fp8_saves_fp8_inputs else ab
    buffers = e.rows * m.hidden_size * ab * routed_share(s, ctx)
    if s.recompute == "full":
        return buffers
    fused = s.compile or rt.fused_swiglu

    def mlp(width: float) -> float:  # bytes per token-row of an MLP of `width` (formulas.py)
        if m.ffn_gated:
            return ((2 if fused else 3) * ab + li) * width
        return (ab + li) * width

    sp = s.sequence_parallel and t > 1
    T_r = T / t if sp else T
    router = T_r * moe.n_experts * 4 * 2
    # the experts' input (saved by the first GEMM) and, where the probabilities multiply the
    # experts' output at the combine, that output (`moe_probs_in_activation`)
    out_ab = 0 if rt.moe_probs_in_activation else ab
    routed = (
        e.rows
        * routed_share(s, ctx)
        * (m.hidden_size * (li + out_ab) + mlp(moe.ffn_hidden_size / s.etp))
    )
    shared = T * mlp(moe.n_shared_experts * moe.shared_ffn_hidden_size / t)
    dense_mlp = T * mlp(m.ffn_hidden_size / t)
    names = modules(s)
    # Megatron-Core's per-module recompute (`modules`): moe keeps only the MoE layer's input,
    # shared_experts the shared experts' input, moe_act drops the experts' activation output
    # (the second expert GEMM's input); the layer being recomputed holds its part once.
    whole = router + routed + shared
    if "moe" in names:
        kept = 0.0
    else:
        act = e.rows * routed_share(s, ctx) * li * moe.ffn_hidden_size / s.etp
        kept = whole - ("shared_experts" in names) * shared - ("moe_act" in names) * act
    per_layer = kept - dense_mlp
    in_flight = microbatches_in_flight(
        s.pipeline_schedule, s.pp, s.grad_accum_steps, s.virtual_stages
    )
    out = in_flight * max(moe_ranks) * per_layer + buffers
    # fine-grained activation offloading: the offloaded inputs leave the device but for the
    # layers computing and in flight (`offload.LAYERS_ON_DEVICE`)
    offloaded = e.rows * routed_share(s, ctx) * offloaded_row_bytes(s, ctx)
    if offloaded:
        n = max(moe_ranks)
        out -= (in_flight * n - min(n, LAYERS_ON_DEVICE)) * offloaded
    if names:
        out -= in_flight * _module_savings(s, ctx, names, moe_ranks, T, dense_mlp)
        out += whole - kept
    return out


def _module_savings(
    s: "Strategy",
    ctx: Context,
    names: tuple[str, ...],
    moe_ranks: tuple[int, ...],
    T: float,
    dense_mlp: float,
) -> float:
    """Bytes of one micro-batch that per-module recompute drops on every layer of the rank
    with the most MoE layers, beyond the MoE side (`activation_bytes`): the norms' outputs
    (layernorm: before attention and before the MLP, sequence-sharded under sp), the MLA
    up-projected queries, keys and values (mla_up_proj; `compute.attention_widths`), the dense
    layers' MLP (mlp)."""
    m, t, ab = ctx.model, s.tp, ACT_BYTES[s.amp]
    sp_div = t if s.sequence_parallel and t > 1 else 1
    r = max(range(s.pp), key=lambda i: moe_ranks[i])
    chunks = s.layers_per_chunk(m.n_layers)
    layers = sum(size for c, size in enumerate(chunks) if c % s.pp == r)
    layers += m.mtp_layers if r == s.pp - 1 else 0  # `pipeline.rank_layers`
    per_layer = 0.0
    if "layernorm" in names:
        per_layer += 2 * T * m.hidden_size * ab / sp_div
    if "mla_up_proj" in names and m.mla is not None:
        q, kv, _ = attention_widths(m)
        per_layer += T * (q + 2 * kv) * ab / t
    dense = ("mlp" in names) * (layers - moe_ranks[r]) * dense_mlp
    return layers * per_layer + dense


def expert_data_parallel(s: "Strategy") -> tuple[int, int]:
    """(edp, stride) of the group the routed experts' gradients and states are reduced and
    sharded over: tp x dp x cp / (etp x ep) ranks, `etp * ep` apart."""
    return s.tp * s.dp * s.cp // (s.etp * s.ep), s.etp * s.ep


def rank_s(
    s: "Strategy", e: ExpertLayer, n_moe: int, rank_layers: float, *, offload_s: float = 0.0
) -> tuple[float, float, float]:
    """(compute, recompute, traffic) seconds the `n_moe` MoE layers of a rank add to its
    blocks priced as dense ones; recomputed layers are MoE layers in the rank's proportion.
    Megatron's per-module recompute (`recompute_modules`) repeats its modules on every layer of
    the rank. `offload_s`: what one layer's fine-grained activation offload leaves exposed
    (`offload_exposed_s`).

    Each MoE layer adds the runtime's host time (`moe_layer_host_s` and `moe_expert_host_s` per
    local expert) to its GPU work, not under it: Megatron-Core's dispatcher waits on the GPU
    for the tokens per expert in every MoE layer's forward (token_dispatcher.py,
    MoEAlltoAllTokenDispatcher.preprocess: with ep > 1 the sync point "before_ep_alltoall",
    `_maybe_dtoh_and_synchronize` -> `d2h_event.synchronize()`, megatron-core 0.16), so the
    GPU's queue is empty when the host starts the dispatch, the permutation and the per-expert
    grouped GEMMs (TE's GroupedLinear quantizes and launches each expert's GEMMs from the host)
    and runs each kernel as the host reaches it; the host cannot run ahead of the GPU past the
    next layer's sync (Megatron-LM docs/discussions/deepseek-v3-gb200-optimization section 2:
    "large gaps between kernels"; section 4: the sync is what keeps full-model CUDA graphs
    out). A run that captures the whole iteration in one graph has none
    (`RuntimeOptions.as_run(full_iteration_cuda_graph=True)`)."""
    modules_s = n_moe * e.modules_s + (rank_layers - n_moe) * e.dense_modules_s
    if not n_moe:
        return 0.0, modules_s, 0.0
    rc_s, rc_comm = recompute_repeats(s, e)
    n_rc = recomputed_layers(s, rank_layers) * n_moe / rank_layers
    return (
        n_moe * (e.fwd_s + e.bwd_s + e.host_s + offload_s),
        n_rc * rc_s + modules_s,
        n_moe * (2.0 + e.modules_comm) * e.comm_fwd_s + n_rc * rc_comm * e.comm_fwd_s,
    )


class MoELayers:
    """The MoE blocks of a model as one kind of block (`cost_models.terms.layers`): their
    placement on the pipeline ranks, what one adds to a dense block, and the routed experts'
    parameters in their own expert-data-parallel group. `cached(fields, compute)` caches a term
    by the strategy fields it reads (the cost model's cache)."""

    def __init__(
        self,
        ctx: Context,
        rank_layers: "Callable[[Strategy], tuple[int | float, ...]]",
        cached: Callable[..., Any],
        rank_reads: tuple[str, ...],
    ):
        self._ctx = ctx
        self.counts: Callable[[Strategy], tuple[int, ...]] = cached(
            fields_read(rank_moe_layers), lambda s: rank_moe_layers(s, ctx)
        )
        self.expert_layer: Callable[[Strategy], ExpertLayer] = cached(
            fields_read(layer), lambda s: layer(s, ctx)
        )
        self._params: Callable[[Strategy], tuple[StageParams, StageParams]] = cached(
            fields_read(stage_params) + rank_reads,
            lambda s: stage_params(s, ctx, rank_layers(s), self.counts(s)),
        )

    def costs(self, s: "Strategy", base: LayerCosts) -> KindCosts:
        e, counts = self.expert_layer(s), self.counts(s)
        rest, routed = self._params(s)
        return KindCosts(
            counts=counts,
            fwd_s=e.fwd_s,
            bwd_s=e.bwd_s,
            rank_s=functools.partial(
                rank_s, s, e, offload_s=offload_exposed_s(self._ctx, e, base)
            ),
            activation_bytes=activation_bytes(s, self._ctx, e, counts),
            param_groups=((rest, None), (routed, expert_data_parallel(s))),
        )
