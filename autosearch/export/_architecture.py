"""What shapes a catalog model besides its ModelSpec: the published settings an exporter must
give a framework so that it builds the same network (RoPE base and scaling, QK norm, norm
epsilon, QKV bias, ...). The cost model does not read them (they change no FLOP or byte it
prices), so `ModelSpec` does not hold them; an export does, or the framework falls back to its
own defaults and builds another model (Megatron's RoPE base is 10,000; Qwen3's is 1,000,000).

`MODEL_FIELDS` names every field an exporter answers for: the ModelSpec's own (the MoE and MLA
parts field by field) and these. Each exporter maps each to its framework's setting or refuses
it (tests/test_export_fields.py runs the table over the catalog).

Sources: the released Hugging Face config.json of each model (``rope_theta``, ``rope_scaling``,
``rms_norm_eps``, ``attention_bias``, ``use_qk_norm``, ``no_rope_layers``,
``attention_chunk_size``); tests/data/hf_configs holds those of Llama 3, Qwen 2/2.5/3, Mistral,
Mixtral, Gemma 2, Phi-3/4, DeepSeek-V2-Lite/V3, Llama 4 Maverick and gpt-oss, and the others are
cited on their entry. GPT-3 follows GPT-2 (LayerNorm epsilon 1e-5, Radford et al. 2019).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from autosearch.core.model_spec import ModelSpec


@dataclass(frozen=True, kw_only=True)
class Architecture:
    """Settings of a published model that its ModelSpec leaves out.

    Args:
        rope_base: RoPE's theta; None where the source does not say (a model off the catalog):
            the framework's default is then used and the export says so.
        rope_scaling: the long-context RoPE scaling as (key, value) pairs, ``type`` first:
            ``llama3`` (factor, low_freq_factor, high_freq_factor,
            original_max_position_embeddings), ``yarn`` (factor, original_max_position_embeddings,
            beta_fast, beta_slow, mscale, mscale_all_dim) or ``linear`` (factor); () for none.
        rotary_percent: the share of each head's channels that RoPE rotates (1.0 all).
        qk_norm: a norm on queries and keys per head: ``rmsnorm`` (weights of head_dim, Qwen3,
            Gemma 3), ``l2`` (no weights, Llama 4 Scout) or None.
        norm_eps: epsilon of every LayerNorm / RMSNorm.
        qkv_bias: biases on the query, key and value projections only (Qwen2, Qwen2.5).
        post_norms: a norm after attention and after the MLP too, four per block (Gemma 2, 3).
        nope_layer_step: every n-th layer has no RoPE (Llama 4: 4).
        attention_chunk: the other layers attend within chunks of this many tokens (Llama 4).
        attention_sinks: a learned per-head logit in the softmax's denominator (gpt-oss).
        swiglu_limit: the gated MLP's inputs clamped to +-limit (gpt-oss: 7).
        shared_expert_gate: a sigmoid gate on the shared expert's output (Qwen2-MoE).
        nope: the attention layers use no position embedding (Nemotron-H: Megatron-Bridge
            NemotronHModelProvider position_embedding_type "none"; Granite 4.0-H:
            GraniteMoeHybridConfig position_embedding_type "nope"). A ModelSpec prices rotary
            positions there (no weights; a few elementwise passes).
        known: the values come from the model's release (False: a model off the catalog).
    """

    rope_base: float | None = None
    rope_scaling: tuple[tuple[str, Any], ...] = ()
    rotary_percent: float = 1.0
    qk_norm: str | None = None
    norm_eps: float = 1e-5
    qkv_bias: bool = False
    post_norms: bool = False
    nope_layer_step: int | None = None
    attention_chunk: int | None = None
    attention_sinks: bool = False
    swiglu_limit: float | None = None
    shared_expert_gate: bool = False
    nope: bool = False
    known: bool = True

    @property
    def scaling(self) -> dict[str, Any]:
        """`rope_scaling` as a mapping ({} for none)."""
        return dict(self.rope_scaling)


# The fields every exporter answers for, in the order the tables print them: the ModelSpec's
# (name aside), its MoE and MLA parts, then the Architecture's.
SPEC_FIELDS = (
    "n_layers",
    "hidden_size",
    "n_heads",
    "n_kv_heads",
    "head_dim",
    "ffn_hidden_size",
    "ffn_activation",
    "vocab_size",
    "seq_len",
    "tied_embeddings",
    "position_embedding",
    "linear_bias",
    "dropout",
    "sliding_window",
    "sliding_window_pattern",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "moe.n_experts",
    "moe.top_k",
    "moe.ffn_hidden_size",
    "moe.n_shared_experts",
    "moe.shared_ffn_hidden_size",
    "moe.first_dense_layers",
    "moe.layer_step",
    "moe.router",
    "moe.load_balancing",
    "moe.capacity_factor",
    "mla.q_lora_rank",
    "mla.kv_lora_rank",
    "mla.qk_nope_head_dim",
    "mla.qk_rope_head_dim",
    "mla.v_head_dim",
    "lora",
    "mtp_layers",
    "layer_pattern",
    "mamba",
    "gdn",
    "attention_output_gate",
    "mamba1",
)
ARCH_FIELDS = tuple(
    f"arch.{f.name}" for f in dataclasses.fields(Architecture) if f.name != "known"
)
MODEL_FIELDS = SPEC_FIELDS + ARCH_FIELDS

_LLAMA3_SCALING = (
    ("type", "llama3"),
    ("factor", 8.0),
    ("low_freq_factor", 1.0),
    ("high_freq_factor", 4.0),
    ("original_max_position_embeddings", 8192),
)
_GPT = Architecture(norm_eps=1e-5)  # GPT-2 / GPT-3 and SC'21's Megatron GPT: LayerNorm 1e-5
_QWEN3 = Architecture(rope_base=1e6, qk_norm="rmsnorm", norm_eps=1e-6)
# autosearch's own CPU models: the reference transformer's settings
# (autosearch/models/transformer.py:
# ROPE_THETA 10,000, RMSNorm eps 1e-5; GPT style LayerNorm's default 1e-5)
_TINY = Architecture(rope_base=10000.0, norm_eps=1e-5)

ARCHITECTURES: dict[str, Architecture] = {
    **{
        name: _GPT
        for name in (
            "gpt3-125m gpt3-350m gpt3-760m gpt3-1.3b gpt3-2.7b gpt3-6.7b gpt3-13b gpt3-175b "
            "sc21-gpt-1.7b sc21-gpt-3.6b sc21-gpt-7.5b sc21-gpt-18.4b sc21-gpt-39.1b "
            "sc21-gpt-76.1b sc21-gpt-145.6b sc21-gpt-310.1b sc21-gpt-529.6b sc21-gpt-1008b"
        ).split()
    },
    # meta-llama/Llama-2-*-hf config.json: rope_theta 10000, rms_norm_eps 1e-5
    **{n: Architecture(rope_base=10000.0) for n in ("llama2-7b", "llama2-13b", "llama2-70b")},
    # Llama 3: rope_theta 500000 (tests/data/hf_configs/llama3-8b.json); 3.1 adds the "llama3"
    # rope_scaling (meta-llama/Llama-3.1-8B config.json: factor 8, 1, 4, 8192)
    "llama3-8b": Architecture(rope_base=500000.0),
    "llama3-70b": Architecture(rope_base=500000.0),
    **{
        n: Architecture(rope_base=500000.0, rope_scaling=_LLAMA3_SCALING)
        for n in ("llama3.1-8b", "llama3.1-70b", "llama3.1-405b")
    },
    # Qwen2.5: QKV biases, rope_theta 1e6, eps 1e-6 (qwen2.5-7b-instruct.json)
    "qwen2.5-7b": Architecture(rope_base=1e6, norm_eps=1e-6, qkv_bias=True),
    "qwen2.5-72b": Architecture(rope_base=1e6, norm_eps=1e-6, qkv_bias=True),
    "qwen3-8b": _QWEN3,
    "qwen3-32b": _QWEN3,
    "mistral-7b-v0.1": Architecture(rope_base=10000.0),
    # NeMo MistralNeMoConfig12B: rotary_base 1,000,000
    "mistral-nemo-12b": Architecture(rope_base=1e6),
    # Gemma 2: RMSNorm (1 + w) before and after attention and MLP, eps 1e-6, theta 10000
    "gemma2-9b": Architecture(rope_base=10000.0, norm_eps=1e-6, post_norms=True),
    "gemma2-27b": Architecture(rope_base=10000.0, norm_eps=1e-6, post_norms=True),
    # Gemma 3 27B (google/gemma-3-27b-it text config): global layers theta 1e6 with linear
    # scaling 8, local layers 10,000; QK norm; pre and post norms
    "gemma3-27b": Architecture(
        rope_base=1e6,
        rope_scaling=(("type", "linear"), ("factor", 8.0)),
        qk_norm="rmsnorm",
        norm_eps=1e-6,
        post_norms=True,
    ),
    "phi3-mini": Architecture(rope_base=10000.0),
    "phi4": Architecture(rope_base=250000.0),
    "mixtral-8x7b": Architecture(rope_base=1e6),
    # mistralai/Mixtral-8x22B-v0.1 config.json: rope_theta 1e6
    "mixtral-8x22b": Architecture(rope_base=1e6),
    "qwen2-57b-a14b": Architecture(
        rope_base=1e6, norm_eps=1e-6, qkv_bias=True, shared_expert_gate=True
    ),
    "qwen3-30b-a3b": _QWEN3,
    # Qwen/Qwen3-235B-A22B config.json: rope_theta 1e6 (the 2507 releases use 5e6)
    "qwen3-235b-a22b": _QWEN3,
    "deepseek-v2": Architecture(
        rope_base=10000.0,
        rope_scaling=(
            ("type", "yarn"),
            ("factor", 40.0),
            ("original_max_position_embeddings", 4096),
            ("beta_fast", 32.0),
            ("beta_slow", 1.0),
            ("mscale", 0.707),
            ("mscale_all_dim", 0.707),
        ),
        norm_eps=1e-6,
    ),
    "deepseek-v3": Architecture(
        rope_base=10000.0,
        rope_scaling=(
            ("type", "yarn"),
            ("factor", 40.0),
            ("original_max_position_embeddings", 4096),
            ("beta_fast", 32.0),
            ("beta_slow", 1.0),
            ("mscale", 1.0),
            ("mscale_all_dim", 1.0),
        ),
        norm_eps=1e-6,
    ),
    # meta-llama/Llama-4-Scout-17B-16E config.json: use_qk_norm true, rope_scaling llama3
    # (factor 16, low 1, high 1, 8192); both: no RoPE every 4th layer, chunks of 8192 elsewhere
    "llama4-scout": Architecture(
        rope_base=500000.0,
        rope_scaling=(
            ("type", "llama3"),
            ("factor", 16.0),
            ("low_freq_factor", 1.0),
            ("high_freq_factor", 1.0),
            ("original_max_position_embeddings", 8192),
        ),
        qk_norm="l2",
        nope_layer_step=4,
        attention_chunk=8192,
    ),
    "llama4-maverick": Architecture(rope_base=500000.0, nope_layer_step=4, attention_chunk=8192),
    "gpt-oss-120b": Architecture(
        rope_base=150000.0,
        rope_scaling=(
            ("type", "yarn"),
            ("factor", 32.0),
            ("original_max_position_embeddings", 4096),
            ("beta_fast", 32.0),
            ("beta_slow", 1.0),
        ),
        attention_sinks=True,
        swiglu_limit=7.0,
    ),
    # Hybrids. Nemotron-H / Nemotron 3 (tests/data/hf_configs: layer_norm_epsilon 1e-5; no
    # position embedding); Granite 4.0-H (ibm-granite/granite-4.0-h-small config.json:
    # rms_norm_eps 1e-5, position_embedding_type "nope")
    **{
        n: Architecture(norm_eps=1e-5, nope=True)
        for n in (
            "nemotron-h-8b",
            "nemotron-h-56b",
            "nemotron-3-nano-30b-a3b",
            "granite-4.0-h-small",
        )
    },
    # Qwen3-Next (tests/data/hf_configs/qwen3-next-80b-a3b.json: rope_theta 1e7 on a quarter of
    # each head, partial_rotary_factor 0.25; q/k RMSNorm; rms_norm_eps 1e-6; the shared expert's
    # sigmoid gate)
    "qwen3-next-80b-a3b": Architecture(
        rope_base=1e7,
        rotary_percent=0.25,
        qk_norm="rmsnorm",
        norm_eps=1e-6,
        shared_expert_gate=True,
    ),
    "tiny-gpt": _TINY,
    "tiny-llama": _TINY,
    "small-gpt": _TINY,
}


def architecture_of(model: "ModelSpec") -> Architecture:
    """The published settings of `model`: its catalog entry's when `model` is that catalog
    model (fewer layers, another sequence length or adapters allowed), else unknown ones
    (`known` False: the framework's defaults, which the export names)."""
    from autosearch.core.model_spec import model_catalog

    arch = ARCHITECTURES.get(model.name)
    ref = model_catalog().get(model.name)
    same = ref is not None and all(
        getattr(ref, f) == getattr(model, f)
        for f in ("hidden_size", "n_heads", "n_kv_heads", "head_dim", "ffn_activation")
    )
    if arch is None or not same:
        return Architecture(known=False)
    return arch


def padded_vocab(vocab_size: int, multiple: int) -> int:
    """`vocab_size` rounded up to a multiple of `multiple` (Megatron-LM
    `_vocab_size_with_padding`: make_vocab_size_divisible_by x tp)."""
    return -(-vocab_size // multiple) * multiple


def field_values(model: "ModelSpec", arch: Architecture) -> dict[str, Any]:
    """Every field of `MODEL_FIELDS` with its value in `model` and `arch` (None where a part
    is absent: the MoE fields of a dense model)."""
    out: dict[str, Any] = {}
    for name in SPEC_FIELDS:
        part, _, field = name.partition(".")
        if field:
            sub = getattr(model, part)
            out[name] = None if sub is None else getattr(sub, field)
        elif name == "layer_pattern":  # as given, or as the fields describe the layers
            out[name] = model.pattern
        else:
            out[name] = getattr(model, name)
    for name in ARCH_FIELDS:
        out[name] = getattr(arch, name.removeprefix("arch."))
    return out
