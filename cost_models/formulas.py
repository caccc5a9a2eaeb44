"""Pure formulas of the analytic cost model: no torch, no globals, no mutation.

Each function cites the paper or standard its formula comes from. Sizes are in bytes, times in
seconds, bandwidths in bytes per second.
"""

from __future__ import annotations

import math

# ---------------------------------------------------------------------------------------------
# Collectives: the alpha-beta (latency-bandwidth) model of ring algorithms.
# Thakur, Rabenseifner & Gropp 2005, "Optimization of Collective Communication Operations in
# MPICH", sec. 4; Patarasuk & Yuan 2009 (bandwidth-optimal ring all-reduce). `nbytes` is the size
# of the full buffer (the all-reduce input, the all-gather output, the reduce-scatter input),
# which is also how nccl-tests defines "bus bandwidth" (busbw = algbw * 2(n-1)/n for all-reduce).
# ---------------------------------------------------------------------------------------------


def ring_all_reduce_time_s(
    nbytes: float, group: int, latency_s: float, bandwidth_bytes_per_s: float
) -> float:
    """2(n-1) alpha + 2(n-1)/n * S / beta (reduce-scatter then all-gather)."""
    if group <= 1:
        return 0.0
    return 2 * (group - 1) * latency_s + 2.0 * (group - 1) / group * nbytes / bandwidth_bytes_per_s


def ring_all_gather_time_s(
    nbytes: float, group: int, latency_s: float, bandwidth_bytes_per_s: float
) -> float:
    """(n-1) alpha + (n-1)/n * S / beta; the same for reduce-scatter."""
    if group <= 1:
        return 0.0
    return (group - 1) * latency_s + (group - 1) / group * nbytes / bandwidth_bytes_per_s


ring_reduce_scatter_time_s = ring_all_gather_time_s


def tree_all_reduce_time_s(
    nbytes: float, group: int, latency_s: float, bandwidth_bytes_per_s: float
) -> float:
    """NCCL's double binary tree: 2 ceil(log2 n) alpha + 2(n-1)/n * S / beta. Its latency grows
    with log n instead of n; at large messages it moves the ring's volume (NCCL 2.4 release
    notes, "Massively Scale Your Deep Learning Training with NCCL 2.4", Sanders et al. 2009
    two-tree broadcast). NCCL picks the faster of the two per call."""
    if group <= 1:
        return 0.0
    steps = 2 * math.ceil(math.log2(group))
    return steps * latency_s + 2.0 * (group - 1) / group * nbytes / bandwidth_bytes_per_s


def all_to_all_time_s(
    nbytes: float, group: int, latency_s: float, bandwidth_bytes_per_s: float
) -> float:
    """All-to-all by pairwise exchange, each rank sending `nbytes` in all (nbytes / n to each
    rank, its own share staying): (n-1) alpha + (n-1)/n * S / beta (Thakur, Rabenseifner &
    Gropp 2005: pairwise exchange, their long-message all-to-all; NCCL's alltoall is n-1
    concurrent send/recv pairs, nccl-tests alltoall busbw = algbw * (n-1)/n)."""
    if group <= 1:
        return 0.0
    return (group - 1) * latency_s + (group - 1) / group * nbytes / bandwidth_bytes_per_s


# ---------------------------------------------------------------------------------------------
# NCCL's own model of a collective, which it uses to pick the algorithm and protocol of each call
# (NVIDIA/nccl src/graph/tuning.cc, `ncclTopoTuneModel` and `ncclTunerConstantsDefaults`, read at
# commit 5067397c, Jun 2026). Per protocol: a base latency (the kernel's setup, in seconds), a
# latency per ring step relative to the Simple protocol's on the same link (NVLink inside a node,
# the network across nodes), and the fraction of the link's bus bandwidth it carries: LL sends 8
# bytes per 16-byte line with its flag (0.5), LL128 120 of 128 bytes (0.92 in NCCL's model),
# Simple the whole buffer. A ring over n ranks on N nodes makes N-1 of its n-1 steps (2(N-1) of
# 2(n-1) for all-reduce) across the network and the rest over NVLink. NCCL runs whichever
# protocol its model finds fastest for the size; all-gather and reduce-scatter have no tree, so
# their latency grows with n.
# ---------------------------------------------------------------------------------------------
NCCL_PROTOCOLS = ("LL", "LL128", "Simple")
# baseLatencies of the ring (the tree's: 6.8, 14, 8.4 us)
NCCL_BASE_LATENCY_S = {"LL": 6.6e-6, "LL128": 14.0e-6, "Simple": 8.4e-6}
# hwLatencies of LL and LL128 over Simple's: NVLink ring 0.6, 1.9 of 3.4 us; network ring 2.7, 4.0
# of 14 us
NCCL_STEP_RATIO = {
    "intra": {"LL": 0.6 / 3.4, "LL128": 1.9 / 3.4, "Simple": 1.0},
    "inter": {"LL": 2.7 / 14.0, "LL128": 4.0 / 14.0, "Simple": 1.0},
}
NCCL_BANDWIDTH_FRACTION = {"LL": 0.5, "LL128": 0.92, "Simple": 1.0}


def nccl_ring_time_s(
    nbytes: float,
    group: int,
    nodes: int,
    intra_latency_s: float,
    inter_latency_s: float,
    bandwidth_bytes_per_s: float,
    *,
    passes: int = 1,
) -> float:
    """A ring collective as NCCL models it, at its fastest protocol: base latency + the steps'
    latencies (intra- and inter-node) + passes (n-1)/n S / (bus bandwidth x protocol fraction).
    `passes` = 1 for all-gather and reduce-scatter, 2 for all-reduce; `intra_latency_s` and
    `inter_latency_s` are the Simple protocol's latency of one step on each link (the hardware
    profile's alpha)."""
    if group <= 1:
        return 0.0
    inter_steps = passes * (nodes - 1) if nodes > 1 else 0
    intra_steps = passes * (group - 1) - inter_steps
    volume = passes * (group - 1) / group * nbytes / bandwidth_bytes_per_s
    intra, inter = intra_steps * intra_latency_s, inter_steps * inter_latency_s
    # the three protocols written out (this runs for every collective of every estimate)
    return min(
        _LL_BASE + intra * _LL_INTRA + inter * _LL_INTER + volume / _LL_BW,
        _LL128_BASE + intra * _LL128_INTRA + inter * _LL128_INTER + volume / _LL128_BW,
        _SIMPLE_BASE + intra + inter + volume,
    )


_LL_BASE, _LL128_BASE, _SIMPLE_BASE = (NCCL_BASE_LATENCY_S[p] for p in NCCL_PROTOCOLS)
_LL_INTRA, _LL128_INTRA = NCCL_STEP_RATIO["intra"]["LL"], NCCL_STEP_RATIO["intra"]["LL128"]
_LL_INTER, _LL128_INTER = NCCL_STEP_RATIO["inter"]["LL"], NCCL_STEP_RATIO["inter"]["LL128"]
_LL_BW, _LL128_BW = NCCL_BANDWIDTH_FRACTION["LL"], NCCL_BANDWIDTH_FRACTION["LL128"]


def nccl_reduce_time_s(nbytes: float, latency_s: float, bandwidth_bytes_per_s: float) -> float:
    """NCCL's ring reduce to one rank (tuning.cc: pipelined over the ring, one step's latency on
    top of the base; the whole buffer crosses each link once), at its fastest protocol."""
    return min(
        NCCL_BASE_LATENCY_S[p]
        + latency_s * NCCL_STEP_RATIO["inter"][p]
        + nbytes / (bandwidth_bytes_per_s * NCCL_BANDWIDTH_FRACTION[p])
        for p in NCCL_PROTOCOLS
    )


def nccl_tree_all_reduce_time_s(
    nbytes: float,
    group: int,
    nodes: int,
    intra_latency_s: float,
    inter_latency_s: float,
    bandwidth_bytes_per_s: float,
) -> float:
    """NCCL's double binary tree all-reduce (Simple): a chain inside each node and a tree of
    log2(N) levels across nodes, up and down: 2((n/N - 1) alpha_intra + log2 N alpha_inter),
    moving 2 S at 0.92 of the bus bandwidth (tuning.cc: tree all-reduce busBw x 0.92, algBw =
    busBw / 2)."""
    if group <= 1:
        return 0.0
    nodes = max(nodes, 1)
    steps = (group / nodes - 1) * intra_latency_s + math.log2(nodes) * inter_latency_s
    return 8.4e-6 + 2 * steps + 2 * nbytes / (0.92 * bandwidth_bytes_per_s)


def p2p_time_s(nbytes: float, latency_s: float, bandwidth_bytes_per_s: float) -> float:
    """One point-to-point message: alpha + S / beta (Hockney 1994)."""
    return latency_s + nbytes / bandwidth_bytes_per_s


def ring_all_reduce_bytes_per_rank(nbytes: float, group: int) -> float:
    """Bytes each rank sends in a ring all-reduce: 2(n-1)/n * S (Patarasuk & Yuan 2009)."""
    return 0.0 if group <= 1 else 2.0 * (group - 1) / group * nbytes


# ---------------------------------------------------------------------------------------------
# Pipeline schedules. Narayanan et al. 2021 (SC'21), sec. 2.2: with p stages and m micro-batches
# the bubble is (p-1)/m of the ideal time for GPipe and 1F1B, and (p-1)/(v m) with v model chunks
# per rank (interleaved 1F1B).
# ---------------------------------------------------------------------------------------------


def bubble_microbatches(pp: int, virtual_stages: int = 1) -> float:
    """Pipeline bubble in micro-batch times (of one micro-batch through a rank's chunks): the
    (p-1)/v micro-batch times a rank idles as the pipeline fills and drains."""
    if pp <= 1:
        return 0.0
    return (pp - 1) / virtual_stages


def bubble_fraction(pp: int, n_microbatches: int, virtual_stages: int = 1) -> float:
    """Pipeline bubble as a fraction of the ideal (bubble-free) time of m micro-batches:
    (p-1) / (v m)."""
    return bubble_microbatches(pp, virtual_stages) / n_microbatches


def microbatches_in_flight(
    schedule: str, pp: int, n_microbatches: int, virtual_stages: int = 1
) -> float:
    """Micro-batches whose activations the first pipeline stage holds at its peak, in units of
    one micro-batch through the whole stage.

    GPipe keeps all m (Huang et al. 2019). 1F1B keeps at most p (Narayanan et al. 2021, sec.
    2.2.1).
    Interleaved 1F1B needs 1 + (p-1)/(p v) times the 1F1B amount (Korthikanti et al. 2022, sec.
    4.2.3).
    Without a pipeline, gradient accumulation frees each micro-batch before the next: 1.
    """
    if pp <= 1:
        return 1.0
    if schedule == "gpipe":
        return float(n_microbatches)
    in_flight = float(min(pp, n_microbatches))
    if schedule == "interleaved_1f1b" and virtual_stages > 1:
        in_flight *= 1.0 + (pp - 1) / (pp * virtual_stages)
    return in_flight


# ---------------------------------------------------------------------------------------------
# Activation memory per transformer layer and micro-batch.
# Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
# sec. 4 and Table 2, with 16-bit activations and 1-byte dropout masks:
#   no parallelism            s b h (34 + 5 a s / h)
#   tensor parallel           s b h (10 + 24/t + 5 a s / (h t))
#   tensor + sequence par.    s b h / t (34 + 5 a s / h)
#   selective recompute       drops the 5 a s / h term (the attention core is recomputed)
#   full recompute            2 s b h (only the layer input; / t with sequence parallel)
# The function below is the same accounting written per stored tensor, so that it also covers
# grouped-query attention, SwiGLU MLPs, models without dropout, fp32 activations, and fused
# (flash) attention, which stores no s x s matrix (Dao et al. 2022). For the GPT shape (ffn 4h,
# gelu, dropout, kv heads = heads, 16-bit) it reproduces Table 2 exactly (tests/test_formulas.py).
# ---------------------------------------------------------------------------------------------


def layer_activation_bytes(
    *,
    seq_len: int,
    micro_batch: int,
    hidden: int,
    heads: int,
    kv_hidden: float,
    ffn_hidden: int,
    swiglu: bool,
    dropout: bool,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    flash_attention: bool = False,
    act_bytes: int = 2,
    fused_swiglu: bool = False,
    fp8_linear_inputs: bool = False,
    query_hidden: int | None = None,
    out_hidden: int | None = None,
) -> float:
    """Bytes one layer keeps for backward, per micro-batch, on one tensor-parallel rank.

    `fused_swiglu`: a fused SwiGLU (TransformerEngine, torch.compile) keeps its input (gate and
    up) and its product, 3 x sbf instead of eager autograd's 4. `fp8_linear_inputs`: float8
    linears keep the float8 copy of their input for the weight gradient (TransformerEngine), 1
    byte instead of `act_bytes`. `query_hidden`: the width of Q (heads x head_dim, or MLA's
    heads x d_qk), `out_hidden` the attention output's (MLA: heads x d_v); both default to
    `hidden`.
    """
    sb = seq_len * micro_batch
    a = act_bytes
    sp_div = tp if sequence_parallel else 1
    if recompute == "full":
        return sb * hidden * a / sp_div  # the layer input only (2sbh at 16 bit)
    mask = 1.0 if dropout else 0.0
    # Kept whole on every tp rank unless sequence parallel shards them along the sequence:
    # two norm inputs, the QKV input, the MLP input (4 x 2sbh + ... = 8sbh at 16 bit) and two
    # dropout masks (2sbh): the "10" of Table 2.
    li = 1 if fp8_linear_inputs else a  # bytes of a saved linear input
    replicated = sb * (2 * hidden * a + 2 * hidden * li + 2 * hidden * mask)
    # Split over tp by the column/row partitioning: Q, K, V, the projection input, and the MLP
    # intermediates: gelu keeps its input and output (2 x sbf); SwiGLU keeps the gate, the up
    # projection, silu(gate) and the product (4 x sbf). The "24/t" of Table 2.
    if swiglu:  # gate and up (+ silu(gate) in eager), and the product: fc2's input
        mlp = ((2 if fused_swiglu else 3) * a + li) * ffn_hidden
    else:  # gelu's input, and its output: fc2's input
        mlp = (a + li) * ffn_hidden
    q = hidden if query_hidden is None else query_hidden
    o = hidden if out_hidden is None else out_hidden
    sharded = sb * (a * (q + 2 * kv_hidden) + li * o + mlp)
    # The attention core: softmax output (2as^2b), and with dropout its mask and output (+3as^2b):
    # the "5as/h" of Table 2. Fused attention keeps only the log-sum-exp (fp32, a s b).
    if flash_attention:
        core = 4.0 * heads * sb
    elif recompute == "selective":
        core = 0.0
    else:
        core = heads * seq_len * sb * (a + mask * (a + 1))
    return replicated / sp_div + (sharded + core) / tp
