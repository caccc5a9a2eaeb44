"""Blocks that differ from the base in their mixer or their MLP: Mamba-2 and Gated DeltaNet
mixers in place of attention, and blocks without a mixer or without an MLP (Nemotron-H's ``M``,
``-`` and ``*`` layers, each a Megatron layer with its own norm and residual).

Each part is priced once per strategy as what one block adds to a base block (attention with a
dense MLP, `cost_models.terms.layers`), for one micro-batch on one device: its compute, its
tensor-parallel traffic, what recompute repeats, its saved activations and its parameters.

The Mamba-2 mixer (Megatron-Core ``megatron/core/ssm/mamba_mixer.py`` ``MambaMixer``;
``mamba_ssm`` ``ops/triton/ssd_combined.py``): in_proj is column-parallel (z, x, B, C, dt split
by heads and groups over tp), the causal depthwise conv1d and the chunked SSD scan run on the
local heads, and out_proj is row-parallel, so a Mamba layer has the attention layer's pair of
collectives (Shoeybi et al. 2019's f and g; a reduce-scatter / all-gather pair under sequence
parallel). The chunked scan (Dao & Gu 2024, sec. 6: intra-chunk C B^T and its product with x,
chunk states and their outputs) runs as mamba_ssm's Triton kernels, five forward and thirteen
backward (`MambaSpec.ssd_kernels`: each kernel's FLOPs and the bytes it reads and writes, the
fp32 chunk states among them), each priced as a roofline on the profile: the longer of its
tensor-core work at the fused-attention rate (`compute.attention_efficiency`) and its bytes at
the memory bandwidth (`compute.stream_s`); with d_state 128 and chunks of 128 the states' fp32
passes make most of them memory-bound. The conv1d, the gated RMSNorm and the norm and residual
of the layer are memory-bound (`compute.elementwise_s`). Megatron's fused path
(``mamba_split_conv1d_scan_combined``, ``save_for_backward``) keeps in_proj's output (z, x, B,
C, dt) and the scan output, and recomputes the conv and the chunk states in backward; the fp32
chunk states (n_chunks x heads x head_dim x d_state per sequence) are live in the layer being
computed. Selective recompute (the attention core) repeats nothing of a Mamba layer; full
recompute repeats its forward.

A parallel block (Falcon-H1's ``FalconH1DecoderLayer``, ``P``: one pre-norm, then attention and
a Mamba-2 mixer on the same normed input, their outputs scaled and summed, one residual add) is
the attention block plus a Mamba-2 branch: the Mamba sublayer above less what the branch shares
with the attention, namely the pre-norm, the residual add (the branch sum, read two and write
one unsharded as each tp rank adds its two partial outputs, stands for it), the four launches
of a sublayer but the sum's one, and the saved input both branches' first linears read. Under
tp both branches are column- then row-parallel on the same input, so they share the attention's
f (one all-gather / all-reduce of the input in backward) and their partial outputs are summed
before its g (Shoeybi et al. 2019, sec. 3: f and g around each parallel pair of linears): no
collective added. Under cp the Mamba branch's all-to-alls come on top of the attention's ring
exchange. Falcon-H1's per-branch multipliers (``attention_in_multiplier``,
``ssm_out_multiplier`` ...) are scalars a trainer folds into the weights or fuses with the
sum; they are not priced.

A Mamba-1 mixer (Jamba's ``S``: `Mamba1Spec`; Gu & Dao 2023) splits its d_inner channels over
tp: in_proj and dt_proj column-parallel, x_proj and out_proj row-parallel (vLLM's
``MambaMixer``), so beside the attention's pair of collectives it all-reduces x_proj's
dt_rank + 2 d_state outputs per token forward and their input gradient backward: that fraction
of an h-wide pair. Its four projections are GEMMs; the selective scan is mamba_ssm's fused
kernel, which keeps the d_inner x d_state state in SRAM and moves only its inputs and outputs
through HBM (sec. 3.3.2; `Mamba1Spec.scan_bytes_per_token`), its FLOPs on CUDA cores: each
direction a roofline of those bytes at the profile's bandwidth and those FLOPs at its fp32
(non-tensor) peak, backward twice the forward's FLOPs (it recomputes the forward recurrence,
then runs the adjoint one). At d_state 16 the bytes dominate. The conv1d and Jamba's dt / B / C
norms are memory-bound kernels.

Under a runtime whose ``ssm_scan`` is ``torch_chunked`` (the `torch` preset: the Engine's
plain-PyTorch scans, autosearch/models/ssm.py) both scans are priced op by op instead
(`MambaSpec.torch_scan`, `GatedDeltaNetSpec.torch_scan`: each eager op's FLOPs and fp32
elements per token, its backward by autograd's formulas), each op a roofline at the profile's
fp32 GEMM rate or its memory bandwidth, one launch per op (a Python loop over chunks: one per
chunk); what autograd saves of the scans replaces what the fused kernels keep.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, NamedTuple

from autosearch.core._ssm import SSDKernel, TorchOp
from autosearch.core.layers import Layer
from cost_models.formulas import microbatches_in_flight
from cost_models.terms import context_parallel
from cost_models.terms._base import (
    ACT_BYTES,
    Context,
    LayerCosts,
    all_to_all_s,
    fields_read,
    reads,
)
from cost_models.terms.compute import (
    MLP_ACTIVATION_PASSES,
    _attention_core,
    _mla_gemms,
    attention_efficiency,
    attention_widths,
    elementwise_s,
    gemm_rate,
    layer_shape,
    output_gate_s,
    recomputed_layers,
    stream_s,
)
from cost_models.terms.layers import KindCosts, rank_counts

if TYPE_CHECKING:  # pragma: no cover
    from autosearch.core.strategy import Strategy

# Kernels of one sublayer's memory-bound work (its norm, residual add and the mixer's or MLP's
# own: rotary or the activation): half of the base block's eight (`compute._elementwise`).
_SUBLAYER_LAUNCHES = 4
# Bytes of an element of the plain-PyTorch scans: float32 whatever the input dtype
# (autosearch/models/ssm.py ``_at_least_fp32``).
_FP32 = 4
# Kernels of the Gated DeltaNet mixer's chunked path forward (flash-linear-attention
# chunk_gated_delta_rule: conv1d, cumsum, K K^T, WY solve, state, output, gated norm).
_GDN_LAUNCHES = 7


class Part(NamedTuple):
    """What one block with this part adds to a base block, one micro-batch on one device."""

    fwd_s: float
    bwd_s: float
    tp_pairs: float  # pairs of tensor-parallel collectives it adds (base block: two)
    recompute_s: float  # what the strategy's recompute repeats, per recomputed block
    activation_bytes: float  # saved for backward, per block
    params: float  # parameters on one tensor-parallel rank
    # exposed communication it adds to one forward beyond its tp pairs (backward the same): a
    # Mamba-2 layer's context-parallel all-to-all, less the attention's ring exchange
    comm_fwd_s: float = 0.0


_PART_READS = ("tp", "micro_batch_size", "amp", "sequence_parallel", "cp", "fp8", "compile")


class _Sublayer(NamedTuple):
    fwd_s: float
    bwd_s: float
    full_recompute_s: float
    selective_recompute_s: float
    activation_bytes: float


def _norm_and_residual_s(ctx: Context, x: Any) -> float:
    """One pre-norm (read + write) and one residual add (read 2, write 1, dropout mask) of a
    sublayer, sequence-sharded under sp (`compute._elementwise`)."""
    m, ab = ctx.model, x.ab
    sbh = x.T * m.hidden_size
    rep = 1.0 / (x.t if x.sp else 1)
    mask = sbh if m.dropout else 0.0
    elementwise = elementwise_s(ctx, x)
    return elementwise(2 * sbh * ab * rep) + elementwise((3 * sbh * ab + mask) * rep)


def _sublayer_input_bytes(s: "Strategy", ctx: Context) -> float:
    """What any sublayer keeps whole on every tp rank (sequence-sharded under sp): its norm's
    input, its first linear's input and its dropout mask (`formulas.layer_activation_bytes`:
    half of the base block's replicated bytes)."""
    m, rt = ctx.model, ctx.runtime
    ab = ACT_BYTES[s.amp]
    li = 1 if s.fp8 != "none" and rt.fp8_saves_fp8_inputs else ab
    sb = s.micro_batch_size * m.seq_len / s.cp
    mask = 1.0 if m.dropout else 0.0
    sp_div = s.tp if s.sequence_parallel else 1
    return sb * m.hidden_size * (ab + li + mask) / sp_div


def _attention(s: "Strategy", ctx: Context) -> _Sublayer:
    """The attention sublayer of the base block: QKV and output projections, the core,
    rotary, its norm and residual."""
    m, gemm = ctx.model, ctx.profile.gemm
    x = layer_shape(s, ctx)
    h, t, T = m.hidden_size, x.t, x.T
    peak, key = gemm_rate(ctx, x)
    if m.mla is None:
        q, kv = m.attention_hidden_size, m.kv_hidden_size
        gemms = gemm.time_s(
            T, (q + m.attention_gate_width + 2 * kv) / t, h, peak, key
        ) + gemm.time_s(T, h, q / t, peak, key)
    else:
        qkv, proj, _ = _mla_gemms(ctx, x, peak, key)
        gemms = qkv + proj
    core_fwd, core_bwd, softmax_bytes = _attention_core(ctx, x)
    elementwise = elementwise_s(ctx, x)
    softmax_s = elementwise(softmax_bytes / t)
    rotary = 0.0
    if m.mla is None and m.position_embedding == "rotary":  # MLA's rope: its own widths
        rotary = elementwise(2 * T * (m.attention_hidden_size + m.kv_hidden_size) * x.ab / t)
    elem = (
        _SUBLAYER_LAUNCHES * ctx.profile.kernel_launch_s
        + _norm_and_residual_s(ctx, x)
        + rotary
        + softmax_s
    )
    if m.attention_output_gate:
        elem += output_gate_s(ctx, x)
    fwd = gemms + core_fwd + elem
    bwd = ctx.profile.gemm.backward_over_forward * gemms + core_bwd + 2.0 * elem
    # saved: Q, K, V and the projection's input split over tp, and the core's (fused: its
    # log-sum-exp; else the scores) as `formulas.layer_activation_bytes` counts them
    ab = x.ab
    li = 1 if s.fp8 != "none" and ctx.runtime.fp8_saves_fp8_inputs else ab
    sb = x.T
    if ctx.runtime.fused_attention(m, ctx.profile):
        core = 4.0 * m.n_heads * sb
    elif s.recompute == "selective":
        core = 0.0
    else:
        mask = 1.0 if m.dropout else 0.0
        core = m.n_heads * (m.seq_len / x.cp) * sb * (ab + mask * (ab + 1))
    qw, kvw, ow = attention_widths(m)
    qw += m.attention_gate_width  # the gate's output, kept for its backward
    saved = _sublayer_input_bytes(s, ctx) + (sb * (ab * (qw + 2 * kvw) + li * ow) + core) / t
    return _Sublayer(fwd, bwd, fwd, core_fwd + softmax_s, saved)


def _mlp(s: "Strategy", ctx: Context) -> _Sublayer:
    """The dense MLP sublayer of the base block: its two (gated: three) matrices, its
    activation, its norm and residual."""
    m, gemm = ctx.model, ctx.profile.gemm
    x = layer_shape(s, ctx)
    h, f, t, T = m.hidden_size, m.ffn_hidden_size, x.t, x.T
    peak, key = gemm_rate(ctx, x)
    gemms = gemm.time_s(T, x.n_up * f / t, h, peak, key) + gemm.time_s(T, h, f / t, peak, key)
    elementwise = elementwise_s(ctx, x)
    elem = (
        _SUBLAYER_LAUNCHES * ctx.profile.kernel_launch_s
        + _norm_and_residual_s(ctx, x)
        + elementwise(MLP_ACTIVATION_PASSES[m.ffn_activation] * T * f * x.ab / t)
    )
    fwd = gemms + elem
    bwd = gemm.backward_over_forward * gemms + 2.0 * elem
    ab = x.ab
    li = 1 if s.fp8 != "none" and ctx.runtime.fp8_saves_fp8_inputs else ab
    if m.ffn_gated:
        per_f = ((2 if s.compile or ctx.runtime.fused_swiglu else 3) * ab + li) * f
    else:
        per_f = (ab + li) * f
    saved = _sublayer_input_bytes(s, ctx) + T * per_f / t
    return _Sublayer(fwd, bwd, fwd, 0.0, saved)


def _mamba(s: "Strategy", ctx: Context) -> _Sublayer:
    """The Mamba-2 sublayer: in_proj and out_proj GEMMs, the chunked SSD scan, the conv1d and
    gated norm, its norm and residual (module docstring)."""
    m, prof = ctx.model, ctx.profile
    mamba = m.mamba
    assert mamba is not None  # a model with M blocks has one (ModelSpec checks)
    x = layer_shape(s, ctx)
    h, t, T, ab = m.hidden_size, x.t, x.T, x.ab
    peak, key = gemm_rate(ctx, x)
    gemm = prof.gemm
    gemms = gemm.time_s(T, mamba.in_proj_width / t, h, peak, key) + gemm.time_s(
        T, h, mamba.d_inner / t, peak, key
    )
    torch_scan = None
    if ctx.runtime.ssm_scan == "torch_chunked":
        torch_scan = mamba.torch_scan(seq_len=int(m.seq_len // x.cp), tp=t)
        scan_fwd = _torch_ops_s(ctx, x, torch_scan.forward) + 2 * prof.kernel_launch_s
        scan_bwd = _torch_ops_s(ctx, x, torch_scan.backward) + 2 * prof.kernel_launch_s
    else:
        forward, backward = mamba.ssd_kernels(ab)
        scan_fwd = _ssd_s(ctx, x, forward) + 2 * prof.kernel_launch_s  # + conv1d, gated norm
        scan_bwd = _ssd_s(ctx, x, backward) + 2 * prof.kernel_launch_s
    elementwise = elementwise_s(ctx, x)
    # conv1d over x, B, C (read + write, SiLU fused) and the gated RMSNorm (read y and z,
    # write the product) on the local heads
    own = elementwise(T * (2 * mamba.conv_dim + 3 * mamba.d_inner) * ab / t)
    elem = _SUBLAYER_LAUNCHES * prof.kernel_launch_s + _norm_and_residual_s(ctx, x) + own
    fwd = gemms + scan_fwd + elem
    bwd = gemm.backward_over_forward * gemms + scan_bwd + 2.0 * elem
    li = 1 if s.fp8 != "none" and ctx.runtime.fp8_saves_fp8_inputs else ab
    # in_proj's output (z, x, B, C, dt), the scan output before the gated norm, the norm's
    # fp32 rstd per group, out_proj's input (ssd_combined MambaSplitConv1dScanCombinedFn)
    per_token = ab * (mamba.in_proj_width + mamba.d_inner) + li * mamba.d_inner
    per_token += 4 * mamba.n_groups
    saved = _sublayer_input_bytes(s, ctx) + T * per_token / t
    if torch_scan is not None:  # and what autograd saves of the plain-PyTorch scan, fp32
        saved += T * _FP32 * torch_scan.saved_elements_per_token
    return _Sublayer(fwd, bwd, fwd, 0.0, saved)


def _mamba1(s: "Strategy", ctx: Context) -> _Sublayer:
    """The Mamba-1 sublayer (module docstring): four projections, the fused selective scan, the
    conv1d and the dt / B / C norms, its norm and residual. Saved: in_proj's output (x, z), the
    conv output, x_proj's output, delta, the scan output and out_proj's input (mamba_ssm
    ``MambaInnerFn`` keeps those; the state is recomputed)."""
    m, prof = ctx.model, ctx.profile
    spec = m.mamba1
    assert spec is not None  # a model with S blocks has one (ModelSpec checks)
    x = layer_shape(s, ctx)
    h, t, T, ab = m.hidden_size, x.t, x.T, x.ab
    d, xw = spec.d_inner, spec.x_proj_width
    peak, key = gemm_rate(ctx, x)
    gemm = prof.gemm
    gemms = (
        gemm.time_s(T, 2 * d / t, h, peak, key)  # in_proj: x and z
        + gemm.time_s(T, xw, d / t, peak, key)  # x_proj: dt, B, C
        + gemm.time_s(T, d / t, spec.dt_rank, peak, key)  # dt_proj
        + gemm.time_s(T, h, d / t, peak, key)  # out_proj
    )
    vector = prof.peak_flops["fp32"]  # the scan runs on CUDA cores
    fwd_bytes, bwd_bytes = spec.scan_bytes_per_token(ab)

    def scan_s(flops: float, nbytes: float) -> float:
        return prof.kernel_launch_s + max(T * flops / t / vector, stream_s(ctx, T * nbytes / t))

    scan_fwd = scan_s(spec.scan_flops_per_token, fwd_bytes)
    scan_bwd = scan_s(2 * spec.scan_flops_per_token, bwd_bytes)
    elementwise = elementwise_s(ctx, x)
    # conv1d over x (read + write, SiLU fused) on the local channels; the dt / B / C norms
    norms = 2 * xw * t if spec.inner_norms else 0
    own = elementwise(T * (2 * d + norms) * ab / t) + 2 * prof.kernel_launch_s
    elem = _SUBLAYER_LAUNCHES * prof.kernel_launch_s + _norm_and_residual_s(ctx, x) + own
    fwd = gemms + scan_fwd + elem
    bwd = gemm.backward_over_forward * gemms + scan_bwd + 2.0 * elem
    li = 1 if s.fp8 != "none" and ctx.runtime.fp8_saves_fp8_inputs else ab
    per_token = (ab * (2 * d + d + d + d) + li * d) / t + ab * xw
    saved = _sublayer_input_bytes(s, ctx) + T * per_token
    return _Sublayer(fwd, bwd, fwd, 0.0, saved)


def _torch_ops_s(ctx: Context, x: Any, ops: "tuple[TorchOp, ...]") -> float:
    """Seconds of a plain-PyTorch scan's eager ops on `x.T` tokens of the local heads
    (`torch_scan_s`)."""
    return torch_scan_s(ctx.profile, ops, x.T, precision=x.precision)


def torch_scan_s(
    profile: Any, ops: "tuple[TorchOp, ...]", tokens: float, *, precision: str = "fp32"
) -> float:
    """Seconds of a plain-PyTorch scan's eager ops (`MambaSpec.torch_scan`) on `tokens`
    tokens of one device's heads, each a roofline: its launches, then the longer of its FLOPs
    at the profile's GEMM rate for its shape and its fp32 elements at the profile's bandwidth
    for that working set (`compute.stream_s`). The scans run in fp32: a GEMM at the fp32 rate
    (PyTorch keeps fp32 matmuls off TF32 by default, ``torch.backends.cuda.matmul.allow_tf32``)
    unless `precision` is the 16-bit dtype of the strategy's autocast, under which a bmm casts
    its two operands (two launches; their bytes, read 4 and write 2 per element, are left in
    the fp32 count) and runs at that rate (`TorchOp.autocast`). No constant of its own."""
    gemm = profile.gemm

    def rate(p: str) -> float:
        return profile.peak_flops[p] * gemm.max_efficiency.get(p, 1.0)

    low = precision in ("bf16", "fp16")  # autocast: bmm's in 16 bits, two casts each
    total = 0.0
    for op in ops:
        lowered = low and op.gemm and op.autocast
        if lowered:
            total += 2 * profile.kernel_launch_s
        nbytes = tokens * op.elements_per_token * _FP32
        stream = nbytes / profile.stream_bandwidth_bytes_per_s(nbytes) if nbytes > 0 else 0.0
        # a small matrix runs below the large-GEMM rate: the profile's shape curve
        # (`GemmEfficiency`: 1 + half_dim (1/m + 1/n + 1/k))
        shape = 1.0 + sum(gemm.half_dim / dim for dim in op.shape if dim > 0)
        compute = tokens * op.flops_per_token / rate(precision if lowered else "fp32") * shape
        total += op.launches * profile.kernel_launch_s + max(compute, stream)
    return total


def _ssd_s(ctx: Context, x: Any, kernels: "tuple[SSDKernel, ...]") -> float:
    """Seconds of the SSD scan's kernels on the local heads (`MambaSpec.ssd_kernels`), each
    a roofline: its launch, then the longer of its tensor-core work (at the fused-attention
    rate of the profile, as FlashAttention's tiles: `compute.attention_efficiency`) and its
    bytes streamed from memory (`compute.stream_s`: the profile's bandwidth for that working
    set). No constant of its own: the rate, the bandwidth and the launch are the profile's."""
    rate = x.peak * attention_efficiency(ctx, x.precision)
    total = 0.0
    for kernel in kernels:
        flops = x.T * kernel.flops_per_token / x.t
        nbytes = x.T * kernel.bytes_per_token / x.t
        total += ctx.profile.kernel_launch_s + max(flops / rate, stream_s(ctx, nbytes))
    return total


def _gdn(s: "Strategy", ctx: Context) -> _Sublayer:
    """The Gated DeltaNet sublayer (`GatedDeltaNetSpec`; Megatron-Core ``gated_delta_net.py``:
    in_proj column-parallel by heads, out_proj row-parallel): its projections as GEMMs, the
    chunked gated delta rule (flash-linear-attention ``chunk_gated_delta_rule``,
    `GatedDeltaNetSpec.chunk_flops_per_token`) at the fused-attention rate as the Mamba-2 scan,
    the conv1d, the q / k L2 norms and the gated norm as memory-bound kernels. Saved: the
    in_proj output, the conv output, the core output and out_proj's input."""
    m, prof = ctx.model, ctx.profile
    gdn = m.gdn
    assert gdn is not None  # a model with G blocks has one (ModelSpec checks)
    x = layer_shape(s, ctx)
    h, t, T, ab = m.hidden_size, x.t, x.T, x.ab
    peak, key = gemm_rate(ctx, x)
    gemm = prof.gemm
    gemms = gemm.time_s(T, gdn.in_proj_width / t, h, peak, key) + gemm.time_s(
        T, h, gdn.value_dim / t, peak, key
    )
    if gdn.gate_rank is not None:  # Kimi Delta Attention's low-rank gate and decay
        gemms += gemm.time_s(T, gdn.gate_up_width / t, gdn.gate_rank, peak, key)
    torch_scan = None
    if ctx.runtime.ssm_scan == "torch_chunked":
        torch_scan = gdn.torch_scan(seq_len=int(m.seq_len // x.cp), tp=t)
        scan_fwd = _torch_ops_s(ctx, x, torch_scan.forward)
        scan_bwd = _torch_ops_s(ctx, x, torch_scan.backward)
    else:
        scan_fwd = _GDN_LAUNCHES * prof.kernel_launch_s + T * gdn.chunk_flops_per_token() / t / (
            x.peak * attention_efficiency(ctx, x.precision)
        )
        scan_bwd = prof.attention_backward_over_forward * scan_fwd
    elementwise = elementwise_s(ctx, x)
    own = elementwise(T * (2 * gdn.conv_dim + 4 * gdn.key_dim + 3 * gdn.value_dim) * ab / t)
    elem = _SUBLAYER_LAUNCHES * prof.kernel_launch_s + _norm_and_residual_s(ctx, x) + own
    fwd = gemms + scan_fwd + elem
    bwd = gemm.backward_over_forward * gemms + scan_bwd + 2.0 * elem
    li = 1 if s.fp8 != "none" and ctx.runtime.fp8_saves_fp8_inputs else ab
    per_token = ab * (gdn.in_proj_width + gdn.conv_dim + gdn.value_dim) + li * gdn.value_dim
    saved = _sublayer_input_bytes(s, ctx) + T * per_token / t
    if torch_scan is not None:  # and what autograd saves of the plain-PyTorch scan, fp32
        saved += T * _FP32 * torch_scan.saved_elements_per_token
    return _Sublayer(fwd, bwd, fwd, 0.0, saved)


def _recompute_of(s: "Strategy", sub: _Sublayer) -> float:
    return {
        "full": sub.full_recompute_s,
        "selective": sub.selective_recompute_s,
    }.get(s.recompute, 0.0)


def _kept(s: "Strategy", ctx: Context, sub: _Sublayer) -> float:
    """A sublayer's saved bytes under the strategy's recompute: full recompute keeps a block's
    input only, which a block keeps whatever its sublayers."""
    return 0.0 if s.recompute == "full" else sub.activation_bytes


def _params(ctx: Context, block: Layer, t: int) -> float:
    m = ctx.model
    return (m.block_params(block) - m.block_params(Layer("attention", "dense"))) / t


@reads(*_PART_READS, "recompute")
def mamba_part(s: "Strategy", ctx: Context) -> Part:
    """A Mamba-2 mixer in place of the attention sublayer: the same pair of tensor-parallel
    collectives; under cp, its all-to-alls (`mamba_cp_fwd_s`) in place of the attention's ring
    exchange (`context_parallel.layer_comm`, which the base block holds)."""
    new, old = _mamba(s, ctx), _attention(s, ctx)
    comm = 0.0
    if s.cp > 1:
        core_fwd, core_bwd, _ = _attention_core(ctx, layer_shape(s, ctx))
        ring = context_parallel.layer_comm(s, ctx, core_fwd, core_bwd)
        comm = mamba_cp_fwd_s(s, ctx) - ring
    return Part(
        new.fwd_s - old.fwd_s,
        new.bwd_s - old.bwd_s,
        0.0,
        _recompute_of(s, new) - _recompute_of(s, old),
        _kept(s, ctx, new) - _kept(s, ctx, old),
        _params(ctx, Layer("mamba", "dense"), s.tp),
        comm,
    )


def mamba_cp_fwd_s(s: "Strategy", ctx: Context) -> float:
    """Seconds of one Mamba-2 layer's context-parallel all-to-alls, forward (Megatron-Core
    ``mamba_context_parallel.py``: ``pre_conv_ssm`` sends z, x, B, C and dt from sequence
    shards to head shards, B and C repeated where a group's heads span cp ranks;
    ``post_conv_ssm`` sends the scan's output back); backward mirrors them. Each rank sends
    its local tokens at those widths over the cp group (stride tp), blocking the layer's
    stream; `_base.all_to_all_s` prices each."""
    m = ctx.model
    mamba = m.mamba
    assert mamba is not None
    t, cp, ab = s.tp, s.cp, ACT_BYTES[s.amp]
    tokens = s.micro_batch_size * m.seq_len / cp
    groups = max(mamba.n_groups // t, cp)  # B and C after the repeat (group_repeat_count)
    widths = (
        mamba.d_inner / t,  # z
        mamba.d_inner / t,  # x
        groups * mamba.d_state,  # B
        groups * mamba.d_state,  # C
        mamba.n_heads / t,  # dt
        mamba.d_inner / t,  # the output, back to sequence shards
    )
    return sum(all_to_all_s(ctx, tokens * w * ab, cp, t) for w in widths)


def _parallel_mamba(s: "Strategy", ctx: Context) -> _Sublayer:
    """The Mamba-2 branch of a parallel block (module docstring): the Mamba sublayer less the
    pre-norm, residual, launches and saved input it shares with the attention beside it, plus
    the sum of the two branches."""
    sub = _mamba(s, ctx)
    x = layer_shape(s, ctx)
    prof, h = ctx.profile, ctx.model.hidden_size
    branch_sum = elementwise_s(ctx, x)(3 * x.T * h * x.ab)  # partial outputs, before g
    shared = (
        (_SUBLAYER_LAUNCHES - 1) * prof.kernel_launch_s + _norm_and_residual_s(ctx, x) - branch_sum
    )
    fwd, bwd = sub.fwd_s - shared, sub.bwd_s - 2.0 * shared
    saved = sub.activation_bytes - _sublayer_input_bytes(s, ctx)
    return _Sublayer(fwd, bwd, fwd, 0.0, saved)


@reads(*_PART_READS, "recompute")
def parallel_mamba_part(s: "Strategy", ctx: Context) -> Part:
    """A Mamba-2 mixer beside the attention in one layer (``P``): the attention sublayer is the
    base block's, this part adds the Mamba branch; no tensor-parallel collective added (the
    branches share f and g); under cp the branch's all-to-alls (`mamba_cp_fwd_s`) on top of the
    attention's ring exchange."""
    new = _parallel_mamba(s, ctx)
    return Part(
        new.fwd_s,
        new.bwd_s,
        0.0,
        _recompute_of(s, new),
        _kept(s, ctx, new),
        _params(ctx, Layer("attention+mamba", "dense"), s.tp),
        mamba_cp_fwd_s(s, ctx) if s.cp > 1 else 0.0,
    )


@reads(*_PART_READS, "recompute")
def mamba1_part(s: "Strategy", ctx: Context) -> Part:
    """A Mamba-1 mixer in place of the attention sublayer: the attention's pair of
    collectives, and x_proj's all-reduce of dt_rank + 2 d_state per token (module docstring)."""
    new, old = _mamba1(s, ctx), _attention(s, ctx)
    spec = ctx.model.mamba1
    assert spec is not None
    extra_pair = spec.x_proj_width / ctx.model.hidden_size if s.tp > 1 else 0.0
    return Part(
        new.fwd_s - old.fwd_s,
        new.bwd_s - old.bwd_s,
        extra_pair,
        _recompute_of(s, new) - _recompute_of(s, old),
        _kept(s, ctx, new) - _kept(s, ctx, old),
        _params(ctx, Layer("mamba1", "dense"), s.tp),
    )


@reads(*_PART_READS, "recompute")
def gdn_part(s: "Strategy", ctx: Context) -> Part:
    """A Gated DeltaNet mixer in place of the attention sublayer: the same pair of
    tensor-parallel collectives, so no traffic added."""
    new, old = _gdn(s, ctx), _attention(s, ctx)
    return Part(
        new.fwd_s - old.fwd_s,
        new.bwd_s - old.bwd_s,
        0.0,
        _recompute_of(s, new) - _recompute_of(s, old),
        _kept(s, ctx, new) - _kept(s, ctx, old),
        _params(ctx, Layer("gdn", "dense"), s.tp),
    )


@reads(*_PART_READS, "recompute")
def no_mixer_part(s: "Strategy", ctx: Context) -> Part:
    """A block without a mixer (an MLP layer alone): less the attention sublayer and its
    pair of tensor-parallel collectives (half the base block's)."""
    old = _attention(s, ctx)
    return Part(
        -old.fwd_s,
        -old.bwd_s,
        -1.0,
        -_recompute_of(s, old),
        -_kept(s, ctx, old),
        _params(ctx, Layer("none", "dense"), s.tp),
    )


@reads(*_PART_READS, "recompute")
def no_mlp_part(s: "Strategy", ctx: Context) -> Part:
    """A block without an MLP (a mixer layer alone): less the dense MLP sublayer and its pair
    of tensor-parallel collectives."""
    old = _mlp(s, ctx)
    return Part(
        -old.fwd_s,
        -old.bwd_s,
        -1.0,
        -_recompute_of(s, old),
        -_kept(s, ctx, old),
        _params(ctx, Layer("attention", "none"), s.tp),
    )


@reads("pp", "virtual_stages", "pipeline_split", "recompute", "recompute_num_layers")
def rank_s(
    s: "Strategy", part: Part, tp_fwd_s: float, n: int, rank_layers: float
) -> tuple[float, float, float]:
    """(compute, recompute, traffic) seconds that `n` blocks with `part` add to a rank of
    `rank_layers` blocks, `tp_fwd_s` the exposed collectives the part adds to one forward;
    recomputed blocks have the part in the rank's proportion."""
    if not n:
        return 0.0, 0.0, 0.0
    n_rc = recomputed_layers(s, rank_layers) * n / rank_layers if rank_layers else 0.0
    rc_tp = {"full": 1.0}.get(s.recompute, 0.0)  # `compute.recompute_repeats`
    return (
        n * (part.fwd_s + part.bwd_s),
        n_rc * part.recompute_s,
        n * 2.0 * tp_fwd_s + n_rc * rc_tp * tp_fwd_s,
    )


@reads("tp", "micro_batch_size", "amp", "cp")
def chunk_state_bytes(s: "Strategy", ctx: Context) -> float:
    """The fp32 chunk states of the Mamba layer being computed: one per chunk of each
    sequence, n_heads / tp x head_dim x d_state each (ssd_combined: ``_chunk_state_fwd``)."""
    mamba = ctx.model.mamba
    assert mamba is not None
    chunks = -(-ctx.model.seq_len // (s.cp * mamba.chunk_size))
    per_chunk = mamba.n_heads / s.tp * mamba.head_dim * mamba.d_state * 4
    return s.micro_batch_size * chunks * per_chunk


class _PartBlocks:
    """The blocks of a model with one part (`cost_models.terms.layers.parts`) as one kind:
    their placement on the pipeline ranks and what each adds to a base block."""

    PART: tuple[str, str]
    TERM: Callable[..., Part]

    def __init__(
        self,
        ctx: Context,
        rank_layers: "Callable[[Strategy], tuple[int | float, ...]]",
        cached: Callable[..., Any],
        rank_reads: tuple[str, ...],
    ):
        self._ctx = ctx
        model, part = ctx.model, self.PART
        self.counts: Callable[[Strategy], tuple[int, ...]] = cached(
            ("pp", "virtual_stages", "pipeline_split"),
            lambda s: rank_counts(model, part, s.layers_per_chunk(model.n_layers), s.pp),
        )
        term = type(self).TERM
        self._part: Callable[[Strategy], Part] = cached(fields_read(term), lambda s: term(s, ctx))

    def extra_bytes(self, s: "Strategy") -> float:
        """Bytes beyond the saved activations, once (the layer in flight)."""
        return 0.0

    def costs(self, s: "Strategy", base: LayerCosts) -> KindCosts:
        part, counts = self._part(s), self.counts(s)
        # the base block's exposed collectives are two pairs (attention's, the MLP's)
        tp_fwd_s = part.tp_pairs * base.tp_comm_fwd_s / 2.0
        if part.comm_fwd_s:
            tp_fwd_s += part.comm_fwd_s
        in_flight = microbatches_in_flight(
            s.pipeline_schedule, s.pp, s.grad_accum_steps, s.virtual_stages
        )
        most = max(counts)
        kept = in_flight * most * part.activation_bytes
        return KindCosts(
            counts=counts,
            fwd_s=part.fwd_s,
            bwd_s=part.bwd_s,
            rank_s=lambda n, rank_layers: rank_s(s, part, tp_fwd_s, n, rank_layers),
            activation_bytes=kept + (self.extra_bytes(s) if most else 0.0),
            block_params=part.params,
        )


class MambaMixers(_PartBlocks):
    """Blocks whose mixer is Mamba-2 (``M``)."""

    PART = ("mixer", "mamba")
    TERM = mamba_part

    def extra_bytes(self, s: "Strategy") -> float:
        return chunk_state_bytes(s, self._ctx)


@reads("tp", "micro_batch_size", "cp")
def delta_state_bytes(s: "Strategy", ctx: Context) -> float:
    """The fp32 states of the Gated DeltaNet layer being computed, one per chunk of each
    sequence: n_v_heads / tp x head_k_dim x head_v_dim each (chunk_gated_delta_rule keeps them
    for the output pass)."""
    gdn = ctx.model.gdn
    assert gdn is not None
    chunks = -(-ctx.model.seq_len // (s.cp * gdn.chunk_size))
    per_chunk = gdn.n_v_heads / s.tp * gdn.head_k_dim * gdn.head_v_dim * 4
    return s.micro_batch_size * chunks * per_chunk


class ParallelMambaMixers(_PartBlocks):
    """Blocks whose mixer is attention and Mamba-2 in parallel (``P``)."""

    PART = ("mixer", "attention+mamba")
    TERM = parallel_mamba_part

    def extra_bytes(self, s: "Strategy") -> float:
        return chunk_state_bytes(s, self._ctx)


class Mamba1Mixers(_PartBlocks):
    """Blocks whose mixer is Mamba-1 (``S``); its state stays in SRAM, no extra bytes."""

    PART = ("mixer", "mamba1")
    TERM = mamba1_part


class GatedDeltaNetMixers(_PartBlocks):
    """Blocks whose mixer is Gated DeltaNet (``G``)."""

    PART = ("mixer", "gdn")
    TERM = gdn_part

    def extra_bytes(self, s: "Strategy") -> float:
        return delta_state_bytes(s, self._ctx)


class NoMixer(_PartBlocks):
    """Blocks without a mixer (``-`` or ``E`` alone)."""

    PART = ("mixer", "none")
    TERM = no_mixer_part


class NoMLP(_PartBlocks):
    """Blocks without an MLP (``M`` or ``*`` alone)."""

    PART = ("mlp", "none")
    TERM = no_mlp_part
