"""Memory per device: the parameters of the heaviest pipeline rank before data-parallel sharding,
and the activations it holds at its peak (Korthikanti et al. 2022, `formulas.py`), by schedule.
The model states under data parallelism / ZeRO are in data_parallel.py."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from cost_models.formulas import layer_activation_bytes, microbatches_in_flight
from cost_models.terms import context_parallel
from cost_models.terms._base import ACT_BYTES, Context, reads
from cost_models.terms.compute import attention_widths, fp32_stream, recomputed_layers

if TYPE_CHECKING:  # pragma: no cover
    from autosearch.core.model_spec import ModelSpec
    from autosearch.core.strategy import Strategy


class StageParams(NamedTuple):
    """Parameters one device holds before data-parallel sharding."""

    total: float  # the heaviest pipeline stage
    per_layer: float


def mtp_head_params(model: "ModelSpec", p: int) -> int:
    """What the multi-token prediction modules add to the last stage besides their blocks
    (counted as layers, `pipeline.rank_layers`): norms and 2h -> h projections, and under
    pipeline parallelism a copy of the input embedding they share (Megatron-Core's GPTModel
    builds the embedding on the stage that runs MTP, as for tied embeddings)."""
    if not model.mtp_layers:
        return 0
    h = model.hidden_size
    copy = model.vocab_size * h if p > 1 and not model.tied_embeddings else 0
    return model.mtp_layers * (3 * h + 2 * h * h) + copy


class LayerActivations(NamedTuple):
    """Bytes one layer keeps for backward, per micro-batch, on one rank."""

    none_bytes: float  # without recompute
    kept_bytes: float  # under the strategy's recompute


@reads("tp", "pp")
def stage_params(s: "Strategy", ctx: Context, ranks: tuple[int | float, ...]) -> StageParams:
    """Parameters of the heaviest pipeline rank, split over tp."""
    model, t, p = ctx.model, s.tp, s.pp
    layer_params = model.layer_params / t
    emb_params = model.embedding_params / t
    # the last stage keeps its own copy of tied embeddings for the logits (Megatron-LM,
    # torchtitan)
    tied_copy = model.vocab_size * model.hidden_size if model.tied_embeddings and p > 1 else 0
    head_params = (model.head_params + tied_copy + mtp_head_params(model, p)) / t
    if p == 1:
        return StageParams(model.n_layers * layer_params + emb_params + head_params, layer_params)
    if len(set(ranks)) == 1:
        return StageParams(ranks[0] * layer_params + max(emb_params, head_params), layer_params)
    heaviest = max(
        Lr * layer_params + (emb_params if r == 0 else 0.0) + (head_params if r == p - 1 else 0.0)
        for r, Lr in enumerate(ranks)
    )
    return StageParams(heaviest, layer_params)


@reads(
    "tp",
    "micro_batch_size",
    "sequence_parallel",
    "amp",
    "cp",
    "fp8",
    "compile",
    "recompute",
    "zero_stage",
    "dp",
    "pp",
    "ep",
)
def layer_activations(s: "Strategy", ctx: Context) -> LayerActivations:
    """One layer's activations per micro-batch, without recompute and under the strategy's."""
    none = _layer_bytes(s, ctx, "none")
    return LayerActivations(
        none, none if s.recompute == "none" else _layer_bytes(s, ctx, s.recompute)
    )


def _layer_bytes(s: "Strategy", ctx: Context, recompute: str) -> float:
    m, rt, tp, sp = ctx.model, ctx.runtime, s.tp, s.sequence_parallel
    ab = ACT_BYTES[s.amp]
    seq = m.seq_len // s.cp  # context parallel keeps 1/cp of every sequence
    tokens = s.micro_batch_size * seq
    sp_div = tp if sp else 1
    if recompute == "selective_op":
        # torchtitan's op-level policy saves the outputs of every other matmul (wq, wv, w1,
        # w2), the attention output and log-sum-exp, and the layer input; the rest,
        # sequence-parallel all-gathers included, is recomputed (docs/runtimes.md [2.2]).
        h, f = m.hidden_size, m.ffn_hidden_size
        q, kv, _ = attention_widths(m)
        saved = (q + kv + f + h) / tp + h / sp_div + h / sp_div
        if s.compile:
            # Eager SAC stores every MUST_SAVE output whether backward reads it or not
            # (torch/utils/checkpoint.py::_CachingTorchDispatchMode); compiled, the policy
            # only bans recomputing them and the partitioner saves what backward needs,
            # which drops w2's output (it only feeds the residual add) (docs/runtimes.md
            # [2.2])
            saved -= h / tp
        return tokens * ab * saved + 4.0 * m.n_heads / tp * tokens
    q, kv, o = attention_widths(m)
    out = layer_activation_bytes(
        seq_len=seq,
        micro_batch=s.micro_batch_size,
        hidden=m.hidden_size,
        heads=m.n_heads,
        kv_hidden=kv,
        ffn_hidden=m.ffn_hidden_size,
        swiglu=m.ffn_gated,
        dropout=m.dropout,
        tp=tp,
        sequence_parallel=sp,
        recompute=recompute,
        flash_attention=rt.fused_attention(m, ctx.profile),
        act_bytes=ab,
        fused_swiglu=s.compile or rt.fused_swiglu,
        fp8_linear_inputs=s.fp8 != "none" and rt.fp8_saves_fp8_inputs,
        query_hidden=q + m.attention_gate_width,  # Q and the output gate (saved for backward)
        out_hidden=o,
    )
    if m.mla is not None and recompute != "full":
        # the two latents, normed and not (inputs of q_b and kv_b), and the shared rotary key,
        # duplicated over tp: r_q + r_kv + d_rope per token, twice
        mla = m.mla
        latent = (mla.q_lora_rank or 0) + mla.kv_lora_rank + mla.qk_rope_head_dim
        out += 2 * tokens * latent * ab / sp_div
    if sp and tp > 1 and rt.sp_saves_gathered_input and recompute != "full":
        # DTensor keeps the all-gathered (whole-sequence) input of the QKV and first MLP
        # matmuls for their weight gradients, not the shard (docs/runtimes.md [2.5]).
        out += 2 * tokens * m.hidden_size * ab * (1 - 1 / tp)
    if m.lora is not None and recompute != "full":
        out += _lora_bytes(s, ctx, tokens)
    if recompute in ("none", "selective") and not s.compile and fp32_stream(s, ctx):
        out += tokens * m.hidden_size * AUTOCAST_SAVED_BYTES[m.ffn_gated]
    out += mixed_precision_norm_bytes(s, ctx, tokens, recompute)
    return out


# What eager autocast over an fp32 residual stream saves beyond the layer formula, per token per
# hidden unit (`compute.fp32_stream`): each linear keeps its own bf16 cast of its input (q, k
# and v three of the normalized input, a gated MLP's w1 and w3 two), and the norms keep fp32
# tensors. Measured on an H200 (results/gpu/h200: the tensor peak grows by 18 bytes per token
# per hidden unit per layer more than the formula's, linear in the micro-batch, 0.53 / 1.11 /
# 2.25 / 4.54 GiB at micro-batch 1 / 2 / 4 / 8; none under full or op-level recompute); the
# census of saved tensors on a CPU gives the same 18: (8 - 2) x 2 for the norms, 2 x 2 for
# q, k, v, 2 for w1 and w3; without a gate 16.
AUTOCAST_SAVED_BYTES = {True: 18.0, False: 16.0}
# What eager RMSNorm saves over a 16-bit residual stream beyond the layer formula's 16-bit norm
# input, per token per hidden unit and layer, on a CPU: torch's rms_norm there is the composite
# (`rms_norm_composite`: upcast to fp32), and autograd keeps the fp32 input and the fp32
# normalized input, 8 bytes per element where the formula counts 2, for both norms: (8 - 2) x 2
# = 12. A census of the saved tensors of the reference transformer (torch 2.13, bf16 parameters
# as FSDP2's MixedPrecisionPolicy gathers them, under autocast or not) gives 12 exactly
# (tests/test_saved_activations.py). On CUDA torch runs the fused kernel (`_fused_rms_norm`,
# pytorch/pytorch#153666, 2025), whose backward keeps the 16-bit input and a per-row
# rstd (derivatives.yaml): what the formula counts, so nothing is added there (unmeasured on a
# GPU so far: the H200 runs in results/gpu/ are all at dp 1). nn.LayerNorm (GPT style) keeps
# its 16-bit input and per-row statistics on either device.
MIXED_PRECISION_NORM_BYTES = 12.0


def mixed_precision_norm_bytes(
    s: "Strategy", ctx: Context, tokens: float, recompute: str
) -> float:
    """Bytes one layer saves beyond the formula where a runtime that autocasts over fp32
    parameters (`autocast_fp32_params`: the Engine) runs FSDP2's mixed-precision policy (zero 2/3
    at dp > 1, `compute.fp32_stream` false): its RMSNorms keep fp32 copies of their 16-bit input
    (`MIXED_PRECISION_NORM_BYTES`), eager and without full or op-level recompute, divided over tp
    as the norm input is by sequence parallel; on a CPU only (CUDA's fused RMSNorm keeps the
    16-bit input)."""
    m = ctx.model
    if (
        ctx.profile.device_type != "cpu"
        or not ctx.runtime.autocast_fp32_params
        or s.amp not in ("bf16", "fp16")
        or s.compile
        or recompute not in ("none", "selective")
        or m.is_gpt_style
        or fp32_stream(s, ctx)
    ):
        return 0.0
    sp_div = s.tp if s.sequence_parallel else 1
    return tokens * m.hidden_size * MIXED_PRECISION_NORM_BYTES / sp_div


def _lora_bytes(s: "Strategy", ctx: Context, tokens: float) -> float:
    """What LoRA changes in one layer's saved activations: a frozen linear layer without an
    adapter needs no input for a weight gradient, so the inputs only weight gradients read are
    not kept (the QKV input unless q, k or v is adapted; the MLP input unless gate or up is;
    fc2's input unless down is; autograd saves an input only for a gradient it computes,
    TransformerEngine the same); the attention output stays (fused attention's backward reads
    it). Each adapter keeps x A (tokens x rank) for B's weight gradient."""
    m, tp = ctx.model, s.tp
    lora = m.lora
    assert lora is not None  # the caller checks
    ab = ACT_BYTES[s.amp]
    li = 1 if s.fp8 != "none" and ctx.runtime.fp8_saves_fp8_inputs else ab
    sp_div = tp if s.sequence_parallel else 1
    adapted = lora.adapted
    freed = 0.0
    if not adapted & {"q", "k", "v"}:
        freed += tokens * m.hidden_size * li / sp_div
    if not adapted & {"gate", "up"}:
        freed += tokens * m.hidden_size * li / sp_div
    if "down" not in adapted:
        freed += tokens * m.ffn_hidden_size * li / tp
    return len(lora.targets or ()) * tokens * lora.rank * ab / tp - freed


@reads(
    "tp",
    "pp",
    "virtual_stages",
    "micro_batch_size",
    "sequence_parallel",
    "recompute",
    "recompute_num_layers",
    "amp",
    "pipeline_schedule",
    "cp",
    "compile",
    "global_batch_size",
    "dp",
)
def activation_peak_bytes(
    s: "Strategy", ctx: Context, ranks: tuple[int | float, ...], layer: LayerActivations
) -> float:
    """Activations held at the peak of the most loaded pipeline rank: every micro-batch in
    flight, the stage input, the logits, and the layer being recomputed."""
    model, rt = ctx.model, ctx.runtime
    t, p, v = s.tp, s.pp, s.virtual_stages
    rc, schedule, ab = s.recompute, s.pipeline_schedule, ACT_BYTES[s.amp]
    act_none, act_layer = layer

    def held(layers: float) -> float:
        """Bytes a rank keeps for `layers` layers of one micro-batch."""
        n_rc = recomputed_layers(s, layers)
        if n_rc == layers:
            return layers * act_layer
        return n_rc * act_layer + (layers - n_rc) * act_none

    tokens = s.micro_batch_size * model.seq_len / s.cp
    in_flight = microbatches_in_flight(schedule, p, s.grad_accum_steps, v)
    first_act = in_flight * (
        held(ranks[0]) + tokens * model.hidden_size * ab / (t if s.sequence_parallel else 1)
    )
    if schedule == "gpipe" or p == 1:
        last_in_flight = in_flight
    else:
        last_in_flight = 1.0 + (in_flight - 1.0) * (v - 1) / v
    logits = tokens * model.vocab_size / t  # of one micro-batch, on this rank
    logits_bytes = logits * _loss_peak_bytes_per_logit(s, ctx)
    if model.mtp_layers:  # each prediction depth's logits and loss live until its backward
        logits_bytes *= 1 + model.mtp_layers
    last_act = last_in_flight * held(ranks[-1]) + logits_bytes
    if p > 1:
        # torch.distributed.pipelining's last stage appends every micro-batch's output (the
        # logits) to `output_chunks` and keeps them until the step returns them merged
        # (pipelining/stage.py::forward_one_chunk, schedules.py::step); docs/runtimes.md [2.7]
        last_act += s.grad_accum_steps * logits * rt.pp_kept_output_bytes_per_logit
    transient = context_parallel.attention_backward_bytes(s, ctx)
    if rc != "none":  # the layer being recomputed holds its full activations once
        transient += act_none - (act_layer if rc == "full" else 0.0)
    first_act += transient
    last_act += transient
    return first_act + logits_bytes if p == 1 else max(first_act, last_act)


def _loss_peak_bytes_per_logit(s: "Strategy", ctx: Context) -> float:
    """Bytes per logit live at the loss's peak (its backward): the runtime's figure for an
    eager or compiled loss, on the whole vocabulary or, with tp > 1 and a vocabulary-parallel
    loss, on the shards (docs/runtimes.md [2.3], [2.9]); given for 16-bit logits, fp32
    logits (amp fp32) add their 2 extra bytes."""
    rt = ctx.runtime
    if s.compile:
        full = rt.compiled_loss_bytes_per_logit
        parallel = rt.compiled_loss_parallel_bytes_per_logit
    else:
        full, parallel = rt.loss_bytes_per_logit, rt.loss_parallel_bytes_per_logit
    per_logit = parallel if s.tp > 1 and parallel > 0 else full
    return per_logit + ACT_BYTES[s.amp] - 2
