"""Compute: one layer's GEMMs, attention core, memory-bound work and float8 scaling, the embedding
and logits, the optimizer step, and what activation recompute repeats.

Conventions: T = micro_batch_size * seq_len / cp tokens per micro-batch on this rank; t = tp.
Time = FLOPs / (peak x the calibrated efficiency of the shape), or bytes / the bandwidth of where
they fit.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable, NamedTuple

from autosearch.core.dp_modes import dp_mode
from autosearch.core.errors import SpecError
from cost_models.terms._base import ACT_BYTES, Context, LayerCosts, reads

if TYPE_CHECKING:  # pragma: no cover
    from autosearch.core.attention_kernels import AttentionShapes
    from autosearch.core.model_spec import ModelSpec
    from autosearch.core.strategy import Strategy

# A causal mask lets fused attention skip half of the tiles (Dao 2023, sec. 3.1). Its backward
# costs `attention_backward_over_forward` times its forward: 2.5 by default, FlashAttention-2
# doing 5 GEMMs per tile backward vs 2 forward (Dao 2023, sec. 3.2); calibration measures it.
CAUSAL_FRACTION = 0.5
# Elementwise traffic of the MLP activation, in T x f tensors read or written (eager): gelu
# reads its input and writes its output (2); a gated MLP reads gate and up and writes the
# product (3); squared ReLU runs relu then the square, each a read and a write (4).
MLP_ACTIVATION_PASSES = {"gelu": 2, "swiglu": 3, "geglu": 3, "relu2": 4}
# Adam step, fused: read param, grad, m, v (fp32) and write param, m, v = 28 bytes per parameter
# (Kingma & Ba 2015 update; bytes as in the ZeRO paper's 16-bytes-per-parameter accounting).
ADAM_BYTES_PER_PARAM = 28


class LayerCompute(NamedTuple):
    """One transformer layer and one micro-batch on one device (seconds), plus the embedding and
    logits work of the first and last pipeline stage."""

    fwd_s: float
    bwd_s: float
    attention_fwd_s: float  # the attention core, which context-parallel traffic hides behind
    attention_bwd_s: float
    attention_recompute_s: float  # what selective recompute repeats: the attention core
    op_recompute_s: float  # what selective op recompute repeats: every other matmul, elementwise
    embedding_s: float  # forward + backward
    logits_s: float  # forward + backward, with the loss


class _Layer(NamedTuple):
    """What shapes one layer's costs: tokens on this rank and the strategy's layer options."""

    T: float  # tokens of one micro-batch on this rank
    mb: int
    t: int
    cp: int
    sp: bool
    ab: int  # bytes of an activation element
    precision: str
    peak: float
    fp8: str
    compiled: bool
    n_up: int  # matrices of the MLP's first projection (2 for SwiGLU)
    traffic: float  # elementwise traffic multiplier of the runtime (eager, fused, compiled)


@reads("tp", "micro_batch_size", "amp", "sequence_parallel", "cp", "fp8", "compile")
def layer(s: "Strategy", ctx: Context) -> LayerCompute:
    """One layer and one micro-batch: forward, backward (dgrad + wgrad per GEMM) and what each
    recompute kind repeats."""
    prof = ctx.profile
    x = layer_shape(s, ctx)
    gemm_fwd, op_recompute_gemm = _block_gemms(ctx, x)
    attn_fwd, attn_bwd, softmax_bytes = _attention_core(ctx, x)
    elem_fwd, softmax_s = _elementwise(ctx, x, softmax_bytes)
    fp8_fwd, fp8_bwd = _fp8_scaling(ctx, x)
    backward_over_forward = prof.gemm.backward_over_forward  # dgrad + wgrad per GEMM
    fwd = gemm_fwd + attn_fwd + elem_fwd + fp8_fwd
    bwd = backward_over_forward * gemm_fwd + attn_bwd + 2.0 * elem_fwd + fp8_bwd
    attn_recompute = attn_fwd + softmax_s  # selective recompute: the attention core again
    op_recompute = op_recompute_gemm + elem_fwd + fp8_fwd  # selective op recompute
    emb, logits = _embedding_and_logits(ctx, x)
    if ctx.model.lora is not None:
        # frozen weights: backward computes input gradients only (dgrad, one forward's worth
        # of each GEMM), and the adapters add their own GEMMs forward and backward
        adapter_fwd, adapter_bwd = _lora_adapters(ctx, x)
        fwd += adapter_fwd
        bwd += adapter_bwd - backward_over_forward / 2.0 * gemm_fwd
        op_recompute += adapter_fwd
    return LayerCompute(fwd, bwd, attn_fwd, attn_bwd, attn_recompute, op_recompute, emb, logits)


def _lora_adapters(ctx: Context, x: _Layer) -> tuple[float, float]:
    """(forward s, backward s) of one block's LoRA adapters (Hu et al. 2021): x A then (x A) B
    per adapted linear layer, split over tp as the base layer is (Megatron-Bridge
    ParallelLinearAdapter: 2 T r (in + out) / tp FLOPs forward), in `amp` (the adapters are
    not float8 layers), and the sum with the base layer's output (read two, write one);
    backward computes both gradients of both adapter matrices (the GEMM's dgrad + wgrad)."""
    m, gemm = ctx.model, ctx.profile.gemm
    lora, t, T = m.lora, x.t, x.T
    assert lora is not None  # the caller checks
    elementwise = elementwise_s(ctx, x)
    gemms = add = 0.0
    for i, o in lora.shapes(m):
        gemms += gemm.time_s(T, lora.rank, i / t, x.peak, x.precision)
        gemms += gemm.time_s(T, o / t, lora.rank, x.peak, x.precision)
        add += elementwise(3 * T * o / t * x.ab)
    return gemms + add, gemm.backward_over_forward * gemms + add


def layer_shape(s: "Strategy", ctx: Context) -> _Layer:
    """What shapes one layer's costs under `s` (the fields `layer` reads)."""
    m, prof, rt = ctx.model, ctx.profile, ctx.runtime
    precision, mb, cp = s.amp, s.micro_batch_size, s.cp
    try:
        peak = prof.peak_flops[precision]
    except KeyError:
        raise SpecError(
            f"hardware profile {prof.name!r} has no peak for {precision}; "
            f"use amp one of {', '.join(prof.peak_flops)}"
        ) from None
    return _Layer(
        T=mb * m.seq_len / cp,  # tokens of one micro-batch here (context parallel splits s)
        mb=mb,
        t=s.tp,
        cp=cp,
        sp=s.sequence_parallel,
        ab=ACT_BYTES[precision],
        precision=precision,
        peak=peak,
        fp8=s.fp8,
        compiled=s.compile,
        n_up=2 if m.ffn_gated else 1,  # a gated MLP's first projection: gate and up
        traffic=rt.compiled_elementwise_traffic if s.compile else rt.elementwise_traffic,
    )


def _block_gemms(ctx: Context, x: _Layer) -> tuple[float, float]:
    """The block's GEMMs forward, and what selective op recompute repeats of them.

    Megatron-LM partitioning (Shoeybi et al. 2019, sec. 3): QKV and the first MLP matrix
    split by columns, the output projection and second MLP matrix by rows. Float8 linears
    (torchao Float8Linear, TransformerEngine) run forward, dgrad and wgrad at the fp8 rate;
    the embedding, attention core and logits stay in `amp`.
    """
    m, gemm = ctx.model, ctx.profile.gemm
    h, f, kv, t, T = m.hidden_size, m.ffn_hidden_size, m.kv_hidden_size, x.t, x.T
    q = m.attention_hidden_size  # heads x head_dim (= h unless head_dim is given)
    peak, key = gemm_rate(ctx, x)
    if m.mla is None:
        # with an output gate (`ModelSpec.attention_output_gate`), Q's projection also gives
        # the gate: Hugging Face Qwen3NextAttention.q_proj is 2 x heads x head_dim wide
        qkv_width = q + m.attention_gate_width + 2 * kv
        qkv = gemm.time_s(T, qkv_width / t, h, peak, key)
        proj = gemm.time_s(T, h, q / t, peak, key)
        kv_recompute = qkv * kv / qkv_width
    else:
        qkv, proj, kv_recompute = _mla_gemms(ctx, x, peak, key)
    fc1 = gemm.time_s(T, x.n_up * f / t, h, peak, key)
    fc2 = gemm.time_s(T, h, f / t, peak, key)
    # Selective op recompute (torchtitan) recomputes every other matmul of the block:
    # wk, wo and (SwiGLU) w3 (docs/runtimes.md [2.2]).
    op_recompute = kv_recompute + proj + (fc1 / 2 if x.n_up == 2 else 0.0)
    return qkv + proj + fc1 + fc2, op_recompute


def gemm_rate(ctx: Context, x: _Layer) -> tuple[float, str]:
    """(peak FLOP/s, efficiency key) of the block's linear layers: float8 linears (torchao
    Float8Linear, TransformerEngine) run at the fp8 rate, the rest in `amp`."""
    gemm = ctx.profile.gemm
    if x.fp8 == "none":
        return x.peak, x.precision
    rowwise = x.fp8 == "rowwise" and "fp8_rowwise" in gemm.max_efficiency
    return ctx.profile.peak_flops["fp8"], "fp8_rowwise" if rowwise else "fp8"


def _mla_gemms(ctx: Context, x: _Layer, peak: float, key: str) -> tuple[float, float, float]:
    """(QKV-side s, output projection s, what op recompute repeats of the first) of multi-head
    latent attention's five projections (DeepSeek-V2 eqs. 9-19): the down projections q_a
    (h -> r_q) and kv_a (h -> r_kv + d_rope) are duplicated on every tp rank, the up
    projections q_b and kv_b split by heads (columns), the output projection by rows
    (Megatron-Core MultiLatentAttention: linear_q_down_proj / linear_kv_down_proj
    "duplicated", linear_q_up_proj / linear_kv_up_proj column-parallel)."""
    m, gemm, T, t = ctx.model, ctx.profile.gemm, x.T, x.t
    mla, h, a = m.mla, m.hidden_size, m.n_heads
    assert mla is not None  # the caller checks
    r_q, qk = mla.q_lora_rank, a * mla.qk_head_dim
    if r_q is None:
        q = gemm.time_s(T, qk / t, h, peak, key)
    else:
        q = gemm.time_s(T, r_q, h, peak, key) + gemm.time_s(T, qk / t, r_q, peak, key)
    kv_a = gemm.time_s(T, mla.kv_lora_rank + mla.qk_rope_head_dim, h, peak, key)
    kv_b = gemm.time_s(
        T, a * (mla.qk_nope_head_dim + mla.v_head_dim) / t, mla.kv_lora_rank, peak, key
    )
    proj = gemm.time_s(T, h, a * mla.v_head_dim / t, peak, key)
    return q + kv_a + kv_b, proj, kv_b


def _attention_core(ctx: Context, x: _Layer) -> tuple[float, float, float]:
    """(forward s, backward s, softmax bytes) of QK^T and softmax(.)V: 2 * 2 * s^2 * d FLOPs
    per head and sequence; with context parallel each rank holds s/cp queries against all s
    keys, load-balanced so that the causal work is even (torch's context parallel).

    Fused (the runtime's `flash_attention`, where its kernels take the model's heads on this
    architecture: `RuntimeOptions.fused_attention`): at the kernel's efficiency by shape where
    the profile has one (`attention.shapes`), else at its one flat efficiency. Unfused: the
    two batched GEMMs over every score and the softmax's passes over the s x s matrix."""
    m, prof = ctx.model, ctx.profile
    s, q, t, launch = m.seq_len, m.attention_hidden_size, x.t, prof.kernel_launch_s
    cap = m.attn_logit_softcapping
    if ctx.runtime.fused_attention(m, prof):
        shapes = None
        kernel = ctx.runtime.attention_kernel
        # the measured table is one kernel call per layer: under context parallel the ring's
        # chunked calls, their output corrections and the send / receive kernels sharing the
        # SMs are not in it, and the flat efficiency stays (it reads the Model Zoo's
        # long-context Qwen3 rows at cp 2-8 within 0-26%; the table's 0.6-0.7 reads them 14-39%
        # fast)
        if x.precision in ("bf16", "fp16") and x.cp == 1:
            shapes = prof.attention_shapes.get(kernel)
        if shapes is not None:
            return (*_attention_by_shape(ctx, x, shapes), 0.0)
        if m.mla is None:
            flops = 4.0 * x.mb * s * s * q / t * CAUSAL_FRACTION / x.cp
        else:  # scores over d_qk = d_nope + d_rope channels, values over d_v
            per_key = m.n_heads * (m.mla.qk_head_dim + m.mla.v_head_dim)
            flops = 2.0 * x.mb * s * s * per_key / t * CAUSAL_FRACTION / x.cp
        if cap is not None:  # tanh and two multiplies per score (FlashAttention-2 `softcap`)
            flops += 3.0 * x.mb * s * s * m.n_heads / t * CAUSAL_FRACTION / x.cp
        # a sliding window skips the tiles outside it (FlashAttention-2 `window_size`)
        flops *= window_fraction(m)
        fwd = launch + flops / (x.peak * attention_efficiency(ctx, x.precision))
        return fwd, prof.attention_backward_over_forward * fwd, 0.0
    rows = x.mb * m.n_heads / t * s / x.cp  # batched over sequences and local heads
    gemm = prof.gemm
    d_qk = m.head_dim if m.mla is None else m.mla.qk_head_dim
    d_v = m.head_dim if m.mla is None else m.mla.v_head_dim
    # QK^T writes every score and PV reads every probability: with a K (or N) of one head
    # they do about d FLOPs per byte of the s x s matrix, below a GPU's ridge point, so each
    # takes the longer of its math and that matrix's traffic (the roofline)
    scores = rows * s * x.ab
    stream = scores / prof.stream_bandwidth_bytes_per_s(scores)
    fwd = max(gemm.time_s(rows, s, d_qk, x.peak, x.precision), stream) + max(
        gemm.time_s(rows, d_v, s, x.peak, x.precision), stream
    )
    # Fused scale-mask-softmax (read + write) and attention dropout (read, write, mask); a
    # window is a mask here: the unfused kernels compute every score.
    mask = 1.0 if m.dropout else 0.0
    softmax_bytes = rows * s * (2 * x.ab + mask * (2 * x.ab + 1))
    if cap is not None:  # soft-capping reads and writes the scores once more
        softmax_bytes += rows * s * 2 * x.ab
    return fwd, gemm.backward_over_forward * fwd, softmax_bytes


def _attention_by_shape(ctx: Context, x: _Layer, shapes: "AttentionShapes") -> tuple[float, float]:
    """(forward s, backward s) of a fused kernel priced by its shape, averaged over the
    layers: each layer's query-key pairs (causal, within its window) at the efficiency its
    keys per query reach (`autosearch/core/attention_kernels.py`)."""
    m, prof = ctx.model, ctx.profile
    s = m.seq_len
    if m.mla is None:
        width, d_qk = 2.0 * m.attention_hidden_size, m.head_dim
    else:
        width, d_qk = m.n_heads * (m.mla.qk_head_dim + m.mla.v_head_dim), m.mla.qk_head_dim
    extra = 0.0 if m.attn_logit_softcapping is None else 3.0 * m.n_heads  # tanh, two multiplies
    fwd = bwd = 0.0
    for keys, count in _windows(m):
        pairs = causal_pairs(keys, s)
        flops = 2.0 * x.mb * pairs * (width + extra) / x.t
        eff_fwd, eff_bwd = shapes.efficiencies(pairs / s, True, d_qk)
        fwd += count * flops / (x.peak * eff_fwd)
        bwd += count * prof.attention_backward_over_forward * flops / (x.peak * eff_bwd)
    n = m.n_layers
    return prof.kernel_launch_s + fwd / n, prof.kernel_launch_s + bwd / n


@functools.cache
def _windows(model: "ModelSpec") -> tuple[tuple[int, int], ...]:
    """(keys a query may attend to, layers with that window) over the model's layers."""
    counts: dict[int, int] = {}
    for keys in model.attention_keys:
        counts[keys] = counts.get(keys, 0) + 1
    return tuple(sorted(counts.items()))


def attention_widths(model: "ModelSpec") -> tuple[int, float, int]:
    """(q, kv, o): per token, the width of the queries, of the keys and of the values (their
    mean), and of the attention output. Multi-head / grouped-query attention: heads x head_dim,
    kv heads x head_dim, heads x head_dim; MLA rebuilds keys and values per head from the
    latent: heads x d_qk, heads x (d_qk + d_v) / 2, heads x d_v (DeepSeek-V2 eqs. 9-19)."""
    mla = model.mla
    if mla is None:
        return model.attention_hidden_size, model.kv_hidden_size, model.attention_hidden_size
    a = model.n_heads
    return a * mla.qk_head_dim, a * (mla.qk_head_dim + mla.v_head_dim) / 2, a * mla.v_head_dim


@functools.cache
def window_fraction(model: "ModelSpec") -> float:
    """Causal query-key pairs per layer, averaged over the layers, relative to full causal
    attention: a query at position i attends to min(i + 1, w) keys on a sliding layer, so a
    sequence has w s - w (w - 1) / 2 pairs instead of s (s + 1) / 2 (`ModelSpec.
    attention_keys`); 1.0 without windows."""
    if not model.sliding_layers:
        return 1.0
    s = model.seq_len
    pairs = sum(causal_pairs(w, s) for w in model.attention_keys)
    return pairs / (model.n_layers * s * (s + 1) / 2)


def causal_pairs(keys: int, s: int) -> float:
    """Causal query-key pairs of a sequence of `s` tokens when a query attends to at most
    `keys` keys: w s - w (w - 1) / 2 (s (s + 1) / 2 without a window)."""
    return keys * s - keys * (keys - 1) / 2


def attention_efficiency(ctx: Context, precision: str) -> float:
    """Fraction of peak the fused attention kernel reaches (forward and backward): the
    runtime's kernel on this hardware if the profile knows it (16-bit), else the profile's
    flash efficiency (calibrated, or a datasheet-era default)."""
    prof, kernel = ctx.profile, ctx.runtime.attention_kernel
    if kernel and precision in ("bf16", "fp16") and kernel in prof.attention_kernels:
        return prof.attention_kernels[kernel]
    return prof.attention_efficiency.get(precision, 0.5)


def _elementwise(ctx: Context, x: _Layer, softmax_bytes: float) -> tuple[float, float]:
    """(forward s, softmax s) of the memory-bound work of a layer, backward taken as 2x.

    Bytes moved: two norms (read + write), two residual adds with bias-dropout (read 2,
    write 1, mask), the MLP activation (gelu: read + write sbf; SwiGLU: read 2 sbf, write
    1), rotary on q, k. Each kernel streams at the bandwidth of where its bytes fit (cache or
    memory); fused kernels (compile, TransformerEngine) move a fraction of eager traffic.
    """
    m, T, t, ab = ctx.model, x.T, x.t, x.ab
    h, f, kv = m.hidden_size, m.ffn_hidden_size, m.kv_hidden_size
    q = m.attention_hidden_size
    sbh = T * h
    dropout_mask = sbh if m.dropout else 0.0
    rep = 1.0 / (t if x.sp else 1)
    elementwise = elementwise_s(ctx, x)
    softmax_s = elementwise(softmax_bytes / t)
    if m.mla is not None:  # rotary on the d_rope channels of each query and the shared key
        rope = m.mla.qk_rope_head_dim
        rotary = elementwise(2 * T * (m.n_heads + 1) * rope * ab / t)
        # RMSNorm on the two latents (q_a_layernorm, kv_a_layernorm), duplicated over tp
        rotary += elementwise(2 * T * ((m.mla.q_lora_rank or 0) + m.mla.kv_lora_rank) * ab)
    elif m.position_embedding == "rotary":
        rotary = elementwise(2 * T * (q + kv) * ab / t)
    else:
        rotary = 0.0
    fwd = 8 * ctx.profile.kernel_launch_s + (
        2 * elementwise(2 * sbh * ab * rep)  # the two norms
        + 2 * elementwise((3 * sbh * ab + dropout_mask) * rep)  # the two residual adds
        + elementwise(MLP_ACTIVATION_PASSES[m.ffn_activation] * T * f * ab / t)
        + rotary
        + softmax_s
    )
    if m.attention_output_gate:
        fwd += output_gate_s(ctx, x)
    return fwd, softmax_s


def output_gate_s(ctx: Context, x: _Layer) -> float:
    """The attention output gate's elementwise pass, o * sigmoid(g) on the local heads: read
    the output and the gate, write the product (Hugging Face Qwen3NextAttention.forward), one
    kernel."""
    m = ctx.model
    nbytes = 3 * x.T * m.attention_gate_width * x.ab / x.t
    return ctx.profile.kernel_launch_s + elementwise_s(ctx, x)(nbytes)


def elementwise_s(ctx: Context, x: _Layer) -> Callable[[float], float]:
    """Seconds of one elementwise kernel moving `nbytes` of eager traffic under this runtime."""
    traffic = x.traffic
    return lambda nbytes: stream_s(ctx, nbytes * traffic)


def stream_s(ctx: Context, nbytes: float) -> float:
    """Seconds to stream `nbytes` through one memory-bound kernel (also its working set)."""
    return nbytes / ctx.profile.stream_bandwidth_bytes_per_s(nbytes) if nbytes > 0 else 0.0


def _fp8_scaling(ctx: Context, x: _Layer) -> tuple[float, float]:
    """(forward s, backward s) of float8 scaling: amax and cast of each linear's input
    (forward) and output gradient (backward, two layouts), and of the weights unless FSDP
    gathers them in fp8 (torchao tensorwise); rowwise scaling needs twice the cast kernels
    (docs/runtimes.md [2.4])."""
    if x.fp8 == "none":
        return 0.0, 0.0
    m, rt, T, t, ab = ctx.model, ctx.runtime, x.T, x.t, x.ab
    h, f, kv = m.hidden_size, m.ffn_hidden_size, m.kv_hidden_size
    q = m.attention_hidden_size
    launch = ctx.profile.kernel_launch_s
    elementwise = elementwise_s(ctx, x)
    # qkv and fc1 see the whole (gathered) sequence, proj and fc2 their tp shard
    inputs = 2 * T * h + T * q / t + T * f / t
    grads = T * (q + m.attention_gate_width + 2 * kv) / t + T * h + T * x.n_up * f / t + T * h
    kernels = 2.0 if x.fp8 == "rowwise" else 1.0
    fp8_gathered = rt.fp8_all_gather and x.fp8 == "tensorwise"
    weight_cast = 0.0 if fp8_gathered else m.layer_matmul_params / t * 5
    fwd = 4 * launch + kernels * elementwise(inputs * (ab + ab + 1)) + elementwise(weight_cast)
    bwd = (
        8 * launch
        + kernels * elementwise(grads * (ab + 2 * (ab + 1)) + inputs * (ab + 1))
        + elementwise(weight_cast)
    )
    return fwd, bwd


def _embedding_and_logits(ctx: Context, x: _Layer) -> tuple[float, float]:
    """(embedding s, logits s), forward + backward.

    Embedding lookup: gather + scatter-add backward (learned positions too). Logits
    (vocabulary split over tp), final norm, and the cross-entropy: read the 16-bit logits,
    write the fp32 softmax, read it back and write the gradient (eager); a fused or compiled
    loss moves less (the runtime's bytes per logit).
    """
    m, prof, rt, T, t, ab = ctx.model, ctx.profile, ctx.runtime, x.T, x.t, x.ab
    launch = prof.kernel_launch_s
    sbh = T * m.hidden_size
    learned = m.position_embedding == "learned"
    emb = 3 * stream_s(ctx, (2 + (2 if learned else 0)) * sbh * ab) + 3 * launch
    loss_bytes = rt.compiled_loss_bytes_per_logit if x.compiled else rt.loss_bytes_per_logit
    gemm = prof.gemm
    backward_over_forward = gemm.backward_over_forward
    if m.lora is not None:
        # frozen: no embedding gradient (forward lookup only), the output layer's dgrad only
        emb = stream_s(ctx, (1 + (1 if learned else 0)) * sbh * ab) + launch
        backward_over_forward /= 2.0
    logits = (
        (1.0 + backward_over_forward)
        * gemm.time_s(T, m.vocab_size / t, m.hidden_size, x.peak, x.precision)
        + stream_s(ctx, T * m.vocab_size / t * (ab + loss_bytes + 2))
        + 3 * stream_s(ctx, 2 * sbh * ab)
        + 4 * launch
    )
    if m.final_logit_softcapping is not None:  # one more read and write, forward and backward
        logits += 2 * stream_s(ctx, 2 * T * m.vocab_size / t * ab)
    return emb, logits


def fp32_stream(s: "Strategy", ctx: Context) -> bool:
    """Whether the runtime computes with fp32 parameters and an fp32 residual stream under
    16-bit autocast: `autocast_fp32_params`, unless FSDP2's mixed-precision policy gathers the
    parameters in the amp dtype (zero 2/3 at dp > 1, `autosearch/core/dp_modes.py`)."""
    if not ctx.runtime.autocast_fp32_params or s.amp not in ("bf16", "fp16"):
        return False
    mode = dp_mode(zero_stage=s.zero_stage, dp=s.dp * s.cp, tp=s.tp, pp=s.pp, ep=s.ep)
    return not (mode.mixed_precision_policy and mode.wrapper == "fsdp")


@reads(
    "zero_stage",
    "amp",
    "fp8",
    "compile",
    "micro_batch_size",
    "global_batch_size",
    "dp",
    "tp",
    "pp",
    "cp",
    "ep",
)
def autocast_casts_s(
    s: "Strategy",
    ctx: Context,
    psi: float,
    trainable: float | None = None,
    layers: tuple[float, float] = (0.0, 0.0),
) -> float:
    """What a step spends on autocast's casts where the runtime computes with fp32 parameters
    (`autocast_fp32_params`: the Engine, PyTorch AMP), beyond the layers' own work.

    Weights: every micro-batch casts the `psi` local parameters to the amp dtype (read 4
    bytes, write 2) and their gradients back to fp32 (read 2, write 4), and every micro-batch
    after the first adds them to the accumulated fp32 gradients (read 8, write 4: whole, since
    only FSDP2's zero 2/3, which this leaves out, reduces every micro-batch).
    Only the `trainable` ones have gradients (LoRA). Float8 linears cast their fp32 weights
    themselves (`_fp8_scaling`): only the gradient casts count then.

    Activations, `layers` = (dense, MoE) layers of the heaviest rank, eager only (Inductor
    fuses the cast into the kernel that writes the activation): the residual stream stays fp32,
    so each linear casts its input (T x h tokens, read 4, write 2): q, k, v and the MLP's
    first projections (two if gated) in a dense layer; the router, the experts and the shared
    experts of an Engine MoE layer read one cast of it (`autosearch.models.moe`); the output
    layer once. Backward casts each gradient back (read 2, write 4) and sums the gradients of
    the linears that read the same input in fp32 (read 8, write 4 per addition).

    None of it under FSDP2's mixed-precision policy (`fp32_stream`), whose bf16 parameters
    keep the stream in bf16: it casts the gathered shards and the gradients to its reduce
    dtype instead, unmeasured so far, and not priced for torchtitan either.

    Measured on an H200 (results/gpu/h200-qwen3-moe-4l/profile: 2.6 B parameters, 4
    micro-batches: the weight casts and the accumulation are 107 ms of a 333 ms step)."""
    m = ctx.model
    if not fp32_stream(s, ctx):
        return 0.0
    mb, grads = s.grad_accum_steps, psi if trainable is None else trainable
    weights = 0.0 if s.fp8 != "none" else 6.0 * psi
    nbytes = mb * (weights + 6.0 * grads) + (mb - 1) * 12.0 * grads
    if not s.compile:
        dense, moe = layers
        th = s.micro_batch_size * m.seq_len / s.cp * m.hidden_size
        up = 2 if m.ffn_gated else 1
        # forward casts, backward casts, backward fp32 sums of each layer kind
        per_dense = (3 + up) * 6 + (3 + up) * 6 + (2 + up - 1) * 12
        per_moe = 3 * 6 + 3 * 6 + 2 * 12 + 6 + 6
        nbytes += mb * th * (dense * per_dense + moe * per_moe + 12)
    return nbytes / ctx.profile.achieved_memory_bandwidth_bytes_per_s


@reads("zero_stage", "dp", "amp")
def optimizer_step_s(s: "Strategy", ctx: Context, psi: float) -> float:
    """The optimizer step over `psi` local parameters: memory bound over the (sharded) states."""
    prof, rt = ctx.profile, ctx.runtime
    psi_opt = psi / s.dp if s.zero_stage >= 1 else psi
    ab = ACT_BYTES[s.amp]
    opt_bytes = ADAM_BYTES_PER_PARAM + (ab if rt.low_precision_params else 0)
    return (
        psi_opt * opt_bytes / prof.achieved_memory_bandwidth_bytes_per_s
        + 10 * prof.kernel_launch_s
    )


# ---- activation recompute: what it repeats, on how many layers ---------------------------------
@reads("recompute")
def recompute_repeats(s: "Strategy", layer: LayerCosts) -> tuple[float, float]:
    """(seconds, tensor-parallel traffic in forwards' worth) one recomputed layer repeats.

    full: the whole forward, collectives included (Chen et al. 2016); selective: the attention
    core (Korthikanti et al. 2022, sec. 5); selective_op: every other matmul and the elementwise
    work, with the sequence-parallel all-gathers again (torchtitan).
    """
    return {
        "full": (layer.fwd_s, 1.0),
        "selective": (layer.attention_recompute_s, 0.0),
        "selective_op": (layer.op_recompute_s, 0.5),
        "none": (0.0, 0.0),
    }[s.recompute]


@reads("recompute", "recompute_num_layers", "virtual_stages")
def recomputed_layers(s: "Strategy", rank_layers: float) -> float:
    """Layers of one pipeline rank whose forward is recomputed (all of them, or
    `recompute_num_layers` per chunk)."""
    n = s.recompute_num_layers
    if n is None or s.recompute == "none":
        return rank_layers if s.recompute != "none" else 0.0
    return min(float(n) * s.virtual_stages, rank_layers)
