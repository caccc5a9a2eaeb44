"""Read a Hugging Face ``config.json`` into a ModelSpec (torch-free; transformers not needed).

The families read, with the ModelSpec fields they give (tests/data/hf_configs holds a published
config of each, with its source):

=====================================  =======================================================
model_type                             what it gives
=====================================  =======================================================
llama, mistral, qwen2, qwen3, phi3     ``swiglu``; ``head_dim`` (Mistral-Nemo, Qwen3);
                                       Mistral's and Phi-3's ``sliding_window`` on every layer.
                                       Phi-3's fused qkv_proj and gate_up_proj have the shapes
                                       of the separate matrices.
gemma, gemma2, gemma3 (text_config),   ``geglu`` (``hidden_activation`` gelu_pytorch_tanh, a
gemma3_text                            gated MLP), tied embeddings, ``head_dim``; Gemma 2
                                       alternates sliding and global layers, Gemma 3 has
                                       ``sliding_window_pattern`` (or ``layer_types``); Gemma 2's
                                       attention and final logit soft-capping
nemotron                               ``relu2`` (squared ReLU, two matrices); ``head_dim`` or
                                       ``kv_channels``
mixtral, qwen2_moe, qwen3_moe,         ``moe`` (`MoESpec`): experts, top-k, expert width,
deepseek_v2, deepseek_v3, llama4       shared experts, leading dense layers, the layer step,
(text_config), llama4_text, gpt_oss    the router; DeepSeek's ``mla`` (`MLASpec`) and
                                       ``mtp_layers`` (``num_nextn_predict_layers``)
gpt2, gpt_neox                         ``gelu`` (GPT style)
nemotron_h                             ``layer_pattern`` from ``layers_block_type`` (or
                                       ``hybrid_override_pattern``: one Hugging Face layer per
                                       symbol), ``mamba`` (`MambaSpec`), ``relu2`` MLPs and the
                                       MoE MLPs of Nemotron 3 (``moe``, sigmoid router, one
                                       shared expert of ``moe_shared_expert_intermediate_size``)
granitemoehybrid                       IBM Granite 4.0-H: ``layer_types`` (Mamba-2 or attention,
                                       each with a SwiGLU MLP: the shared MLP, and with experts
                                       a ``moe`` whose shared expert it is), ``mamba``
qwen3_next, qwen3_5 / qwen3_5_moe      Qwen3-Next, Qwen3.5: ``layer_types`` (or every
(text_config), qwen3_5_text,           ``full_attention_interval``-th layer) Gated DeltaNet
qwen3_5_moe_text                       (``gdn``, `GatedDeltaNetSpec`) or gated attention
                                       (``attention_output_gate``); SwiGLU MLPs, and ``moe``
                                       with one shared expert (Qwen3-Next: ``decoder_sparse_step``
                                       and ``mlp_only_layers`` place them; Qwen3.5-MoE: every
                                       layer)
falcon_h1                              Falcon-H1: every layer attention and Mamba-2 in parallel
                                       (``P-``: ``attention+mamba``, `layers`), a SwiGLU MLP;
                                       ``mamba`` with d_inner ``mamba_d_ssm`` (or
                                       ``mamba_expand`` x hidden) and the gated norm where
                                       ``mamba_rms_norm``
jamba                                  Jamba: every ``attn_layer_period``-th layer attention
                                       (from ``attn_layer_offset``), the others Mamba-1
                                       (``mamba1``, `Mamba1Spec`: ``S``), every
                                       ``expert_layer_period``-th MLP a MoE (softmax top-k, no
                                       shared expert), the others SwiGLU
kimi_linear                            Kimi Linear: ``layer_types`` (or the checkpoint's
                                       ``linear_attn_config``) Kimi Delta Attention (``gdn``
                                       with ``gate_rank``) or MLA (``mla``); the first
                                       ``first_k_dense_replace`` MLPs SwiGLU, the others MoE
                                       (sigmoid router, expert bias, a shared expert)
=====================================  =======================================================

Jamba's attention has no positional encoding; a ModelSpec's attention is rotary,
which adds no parameter (the cost model prices its elementwise pass, an upper bound).
Falcon-H1's muP multipliers (``*_multiplier``, ``mlp_multipliers``, ``ssm_multipliers``) scale
activations and change no shape: not read.

What a ModelSpec leaves out, and so neither counts nor prices: Qwen2's q/k/v biases (3h + 2
kv_h per layer, under 0.1% of Qwen2-7B), Qwen3's and Gemma 3's q/k norms and Gemma 2/3's extra
post-attention and post-MLP norms (h or head_dim weights each), Nemotron's LayerNorm biases,
gpt-oss's attention and expert biases and attention sinks (0.03% of gpt-oss-120b), the
shared-expert gate of Qwen2-MoE, Qwen3-Next and Qwen3.5-MoE (h weights per MoE layer), the q/k
norms of Qwen3-Next and Qwen3.5 (2 head_dim per attention layer; with the gates 0.0001% of
Qwen3-Next-80B-A3B), Llama 4's chunked attention (``attention_chunk_size``: counted as full
attention, an upper bound) and GPT-NeoX's rotary positions (the GPT style counts learned
positions, seq_len * h parameters, 0.2% of Pythia-1B at 2,048 tokens).

Keys a config leaves out take the default that transformers' config class of the family gives
them, as transformers reads the file: a published config.json often gives only what differs from
those defaults (Gemma 3 27B's ``text_config`` has no ``vocab_size``: Gemma3TextConfig's
262,208; a Mistral config without ``num_key_value_heads`` has 8 key/value heads, not one per
head). The defaults, the keys each class declares and its aliases (``attribute_map``) are read
from hf_config_keys.yaml, which tools/hf_config_keys.py writes from transformers: importing a
transformers config class imports torch (transformers.configuration_utils imports
modeling_rope_utils, which imports torch when it is installed), and the cost model's side of
autosearch never imports torch, so this module never imports transformers and reads the same
with or without it. What a class derives in its ``__post_init__`` (``num_key_value_heads`` and
``head_dim`` from the heads when null, Gemma 3's layer pattern) is derived here as it is there;
tests/test_hf_config.py checks the result against transformers' own config objects and models.

Keys a family does not know. Each key of the config (and of a multimodal config's
``text_config``) that its family does not know is ignored with an `UnknownConfigKeyWarning`
naming the closest known key, where one is close (``num_key_value_head``: did you mean
``num_key_value_heads``?). A key this reader needs that the config leaves out while giving a
near miss of it (``num_hiden_layers``) is an error saying so, not the default. A family knows the
keys its transformers config class declares, the keys this reader reads (`READ_KEYS`) and the
keys published configs carry that transformers 5 reads without declaring them
(`UNDECLARED_KEYS`); keys starting with ``_`` (a writer's own state) are not checked.
"""

from __future__ import annotations

import difflib
import functools
import json
import math
import os
import warnings
from collections.abc import Mapping
from importlib import resources
from typing import Any

import yaml

from autosearch.core._io import name_from, read_regular_file
from autosearch.core.errors import SpecError

# The Llama-shaped families the Engine's Hugging Face plans know
# (`autosearch.models.hf.causal_lm`).
LLAMA_LIKE = ("llama", "mistral", "qwen2")
SWIGLU_DENSE = LLAMA_LIKE + ("qwen3", "phi3")
GEMMA_LIKE = ("gemma", "gemma2", "gemma3_text")
MOE_FAMILIES = (
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "deepseek_v2",
    "deepseek_v3",
    "llama4_text",
    "gpt_oss",
)
GPT_LIKE = ("gpt2", "gpt_neox")
# layer patterns of Mamba-2, attention and MLP layers
HYBRID_FAMILIES = ("nemotron_h", "granitemoehybrid", "falcon_h1", "jamba", "kimi_linear")
# Gated DeltaNet and gated attention layers, every full_attention_interval-th layer attention
# (transformers Qwen3NextConfig; Qwen3.5's text models: Qwen3_5TextConfig, Qwen3_5MoeTextConfig)
QWEN_NEXT_FAMILIES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
SUPPORTED = (
    SWIGLU_DENSE
    + GEMMA_LIKE
    + ("nemotron",)
    + MOE_FAMILIES
    + GPT_LIKE
    + HYBRID_FAMILIES
    + QWEN_NEXT_FAMILIES
)
# Hybrid families transformers has and a ModelSpec cannot describe yet, with why: refused by
# name rather than read as something else.
UNREAD_HYBRIDS: dict[str, str] = {}
# Hugging Face's names of Nemotron-H's layers -> Megatron's hybrid symbols
# (transformers NemotronHConfig._list_to_pattern)
NEMOTRON_H_SYMBOLS = {"mamba": "M", "linear_attention": "M", "attention": "*",
                      "full_attention": "*", "mlp": "-", "moe": "E"}  # fmt: skip
NEMOTRON_H_DEFAULT_LAYERS = ("linear_attention", "moe", "full_attention", "mlp")
NESTED = {  # multimodal: the text model
    "llama4": "llama4_text",
    "gemma3": "gemma3_text",
    "qwen3_5": "qwen3_5_text",
    "qwen3_5_moe": "qwen3_5_moe_text",
}
# Keys by which a config announces experts (Mixtral, Qwen2-MoE / Qwen3-MoE, DeepSeek-V2/V3, DBRX).
MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
GELU_NAMES = ("gelu", "gelu_new", "gelu_fast", "gelu_pytorch_tanh", "gelu_python")
# A training length above this is rarely meant: warn when it comes from max_position_embeddings.
LONG_SEQ_LEN = 32768
# Every key this reader reads, in some family (a family's own keys are in hf_config_keys.yaml).
READ_KEYS = frozenset(
    {
        "model_type", "_name_or_path", "text_config", "vocab_size", "tie_word_embeddings",
        "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
        "intermediate_size", "intermediate_size_mlp", "head_dim", "kv_channels",
        "max_position_embeddings", "n_positions", "n_ctx", "n_layer", "n_embd", "n_head",
        "n_inner", "activation_function", "hidden_act", "hidden_activation",
        "attn_logit_softcapping", "final_logit_softcapping", "sliding_window",
        "use_sliding_window", "layer_types", "sliding_window_pattern", "num_experts_per_tok",
        "experts_per_token", "decoder_sparse_step", "shared_expert_intermediate_size",
        "mlp_only_layers", "interleave_moe_layer_step", "moe_layers", "moe_layer_freq",
        "moe_intermediate_size", "n_shared_experts", "first_k_dense_replace", "scoring_func",
        "topk_method", "num_nextn_predict_layers", "q_lora_rank", "kv_lora_rank",
        "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", *MOE_KEYS,
        "hybrid_override_pattern", "layers_block_type", "attention_head_dim",
        "mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "conv_kernel",
        "chunk_size", "use_conv_bias", "use_bias", "mlp_hidden_act", "moe_latent_size",
        "moe_shared_expert_intermediate_size", "mamba_n_heads", "mamba_d_head",
        "mamba_d_state", "mamba_n_groups", "mamba_d_conv", "mamba_expand", "mamba_chunk_size",
        "mamba_conv_bias", "mamba_proj_bias", "shared_intermediate_size",
        "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
        "linear_value_head_dim", "linear_conv_kernel_dim", "full_attention_interval",
        "mamba_d_ssm", "mamba_rms_norm", "projectors_bias", "mlp_bias", "mamba_dt_rank",
        "attn_layer_period", "attn_layer_offset", "expert_layer_period", "expert_layer_offset",
        "linear_head_dim", "linear_num_heads", "mlp_layer_types", "num_experts_per_token",
        "num_shared_experts", "model_max_length",
    }
)  # fmt: skip
# Keys of published configs that transformers 5 reads (or the Hub writes) without declaring them
# as fields of a config class, so hf_config_keys.yaml does not list them.
UNDECLARED_KEYS = frozenset(
    {
        # read by PreTrainedConfig itself (__post_init__, from_dict) or written with the model
        "name_or_path", "torch_dtype", "num_labels", "output_attentions",
        "attn_implementation", "auto_map", "quantization_config", "cache_implementation",
        "task_specific_params",
        # PreTrainedConfig's token ids in transformers 4 (in 5, declared family by family)
        "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
        # transformers 4's rotary keys, which transformers 5 folds into rope_parameters
        "rope_theta", "rope_scaling", "partial_rotary_factor", "rotary_pct", "rotary_emb_base",
        "rope_local_base_freq",
        # keys of the checkpoints' own code (DeepSeek-V3's configuration_deepseek.py), or
        # that their configs carry undeclared: gpt-oss, Llama 4, phi-4 (Phi3Config has no
        # attention_bias field), Qwen3-MoE (Qwen3MoeConfig none for max_window_layers);
        # tests/data/hf_configs holds each
        "ep_size", "initial_context_length", "for_llm_compressor", "attention_bias",
        # KimiLinearConfig.__post_init__ reads these from its kwargs (the checkpoint's keys)
        "linear_attn_config",
        "max_window_layers",
    }
)  # fmt: skip


class LongSequenceWarning(UserWarning):
    """The training sequence length came from a config's maximum positions and is long."""


class UnknownConfigKeyWarning(UserWarning):
    """A key of a Hugging Face config that its family does not know (often a typo): ignored."""


def read_config(source: "str | os.PathLike | Mapping[str, Any] | Any") -> dict[str, Any]:
    """The config as a dict: from a ``config.json`` path, a folder holding one, a mapping, or a
    transformers ``PretrainedConfig`` (anything with ``to_dict()``)."""
    if isinstance(source, Mapping):
        return dict(source)
    if hasattr(source, "to_dict") and callable(source.to_dict):
        return dict(source.to_dict())
    if not isinstance(source, (str, os.PathLike)):
        raise SpecError(
            f"a Hugging Face config must be a config.json path, a dict or a PretrainedConfig; "
            f"got {type(source).__name__}"
        )
    path = os.fspath(source)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.exists(path):
        raise SpecError(
            f"Hugging Face config {path!r} does not exist; pass the model's config.json "
            "or the folder that holds it"
        )
    raw = read_regular_file(path, what="Hugging Face config")
    try:
        data = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except UnicodeDecodeError as exc:
        raise SpecError(f"cannot read Hugging Face config {path!r}: {exc}") from None
    except _DuplicateKey as exc:
        raise SpecError(
            f"Hugging Face config {path!r} gives the key {exc} twice in one object; JSON "
            "readers disagree on which value wins: give it once"
        ) from None
    except json.JSONDecodeError as exc:
        raise SpecError(
            f"Hugging Face config {path!r} is not valid JSON (line {exc.lineno}, column "
            f"{exc.colno}: {exc.msg})"
        ) from None
    except RecursionError:  # thousands of nested [ or {: a config nests a few levels
        raise SpecError(
            f"Hugging Face config {path!r} is nested too deeply for a config (thousands of "
            "levels of [ or {); check that the path names the model's config.json"
        ) from None
    if not isinstance(data, dict):
        raise SpecError(
            f"Hugging Face config {path!r} must hold a JSON object, got {type(data).__name__}"
        )
    return data


class _DuplicateKey(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(repr(key))
        out[key] = value
    return out


def _flag(cfg: Mapping[str, Any], key: str, default: bool, label: str) -> bool:
    """A boolean of the config: JSON true or false (the string "false" is not false)."""
    value = cfg.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise SpecError(
            f"Hugging Face config of {label!r}: {key} must be true or false, got {value!r}"
            + (" (a string; write it without quotes)" if isinstance(value, str) else "")
        )
    return value


def _count(cfg: Mapping[str, Any], key: str, label: str) -> int | None:
    """A count of the config (heads, head size): absent or null is None, else an integer >= 1
    (0 is not "the default": transformers reads num_key_value_heads=0 as no key/value heads)."""
    value = cfg.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecError(
            f"Hugging Face config of {label!r}: {key} must be an integer >= 1, got {value!r}"
        )
    return value


def spec_fields(source, *, name: str | None = None, seq_len: int | None = None) -> dict[str, Any]:
    """The ModelSpec fields of a Hugging Face causal LM config (`ModelSpec.from_hf_config`
    builds the spec; this module never imports it, so the two do not import each other).

    Args:
        source: ``config.json`` path (or its folder), a dict, or a transformers PretrainedConfig.
        name: the spec's name; default the config's ``_name_or_path``, else the file's folder
            (or its name when that is not ``config.json``), else its model_type.
        seq_len: training sequence length; default the config's maximum positions
            (``max_position_embeddings`` / ``n_positions``), which is often longer than one
            trains: above 32,768 tokens a `LongSequenceWarning` says how to set it.

    Keys the config leaves out take the defaults of the family's transformers config class;
    each key the family does not know is ignored with an `UnknownConfigKeyWarning` (module
    docstring).

    Raises:
        SpecError: an unsupported family (named, with the supported ones), a layout a ModelSpec
            cannot describe (named), a key it needs that the config misspells (did you mean), or
            one without a default that the config leaves out.

    Example:
        >>> fields = spec_fields({"model_type": "llama", "num_hidden_layers": 2,
        ...     "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128,
        ...     "vocab_size": 100, "max_position_embeddings": 32})
        >>> fields["ffn_activation"], fields["n_kv_heads"]
        ('swiglu', 4)
    """
    raw = read_config(source)
    cfg = _text_model(raw)
    model_type = cfg.get("model_type")
    label = _label(cfg, source, name)
    experts = [k for k in MOE_KEYS if cfg.get(k)]
    if model_type in UNREAD_HYBRIDS:
        raise SpecError(
            f"Hugging Face model_type {model_type!r} ({label!r}) is not read: "
            f"{UNREAD_HYBRIDS[model_type]}. The hybrids read are {', '.join(HYBRID_FAMILIES)} "
            f"(Mamba-2) and {', '.join(QWEN_NEXT_FAMILIES)} (Gated DeltaNet)"
        )
    if model_type not in SUPPORTED:
        what = "mixture-of-experts family" if experts or "moe" in str(model_type) else "family"
        raise SpecError(
            f"Hugging Face model_type {model_type!r} ({label!r}) is not a supported {what}; "
            f"supported: {', '.join(SUPPORTED)}. Write a ModelSpec YAML (n_layers, hidden_size, "
            "n_heads, vocab_size, seq_len; moe and mla as nested mappings) for other models"
        )
    # a dense family with experts would be read as dense, its experts dropped
    if experts and model_type not in MOE_FAMILIES + HYBRID_FAMILIES + QWEN_NEXT_FAMILIES:
        given = ", ".join(f"{k} = {cfg[k]!r}" for k in experts)
        raise SpecError(
            f"Hugging Face config of {label!r}: model_type {model_type!r} is a dense family, "
            f"but the config gives experts ({given}); give the model_type of its "
            f"mixture-of-experts family ({', '.join(sorted(MOE_FAMILIES))}), or drop the "
            "expert keys for the dense model"
        )
    config = _Config(cfg, model_type, label, near_misses=_check_keys(raw, cfg, label))
    fields = _read(config, model_type, label)
    if seq_len is None:
        # model_max_length: kimi_linear's field for max_position_embeddings (its alias)
        seq_len = config.need(
            "max_position_embeddings", "n_positions", "n_ctx", "model_max_length"
        )
        if isinstance(seq_len, int) and seq_len > LONG_SEQ_LEN:
            warnings.warn(
                f"{label!r}: the training sequence length is the config's maximum positions, "
                f"{seq_len:,} tokens, above {LONG_SEQ_LEN:,}; runs usually train shorter. Give "
                "the length you train at: --seq-len N on the command line, seq_len: N in a "
                "--config file, or ModelSpec.load(path, seq_len=N)",
                LongSequenceWarning,
                stacklevel=3,
            )
    return {"name": str(label), **fields, "seq_len": seq_len}


def _text_model(raw: dict[str, Any]) -> dict[str, Any]:
    """The config of the text model: `raw` itself, or a multimodal config's ``text_config``
    with its model_type (and the outer config's name)."""
    model_type = raw.get("model_type")
    if model_type not in NESTED or not isinstance(raw.get("text_config"), Mapping):
        return raw
    cfg = {"model_type": NESTED[model_type], **raw["text_config"]}
    cfg.setdefault("_name_or_path", raw.get("_name_or_path"))
    return cfg


class _Config:
    """A config's keys as transformers reads them: the keys given (an alias under the name of
    the field it stands for) over the defaults of the family's config class
    (hf_config_keys.yaml), in `merged`."""

    def __init__(
        self, given: Mapping[str, Any], model_type: str, label: str, *, near_misses: dict[str, str]
    ):
        family = _declared()[1].get(model_type, {})
        aliases = family.get("aliases", {})
        self.given = {aliases.get(key, key): value for key, value in given.items()}
        self.defaults: dict[str, Any] = family.get("defaults", {})
        self.merged = {**self.defaults, **self.given}
        self.what = f"Hugging Face config of {label!r} (model_type {model_type!r})"
        self.near_misses = near_misses

    def need(self, *keys: str) -> Any:
        """The first of `keys` the config gives, else its default; an error naming the key
        given in its place where one looks like a typo of it (not its default then)."""
        for key in keys:
            if self.given.get(key) is not None:
                return self.given[key]
        typo = next((key for key in keys if key in self.near_misses), None)
        if typo is not None:
            raise SpecError(
                f"{self.what} lacks {typo!r} but gives {self.near_misses[typo]!r}: did you "
                f"mean {typo!r}? Correct the key's name"
            )
        for key in keys:
            if self.defaults.get(key) is not None:
                return self.defaults[key]
        raise SpecError(f"{self.what} lacks {keys[0]!r}")


def _read(config: _Config, model_type: str, label: str) -> dict[str, Any]:
    """The ModelSpec fields of `config`, less name and seq_len."""
    cfg, need = config.merged, config.need
    if model_type in GPT_LIKE:
        return _gpt_fields(cfg, model_type, need, label)
    if model_type == "nemotron_h":
        return _nemotron_h_fields(cfg, need, label)
    if model_type == "granitemoehybrid":
        return _granite_hybrid_fields(cfg, need, label)
    if model_type == "falcon_h1":
        return _falcon_h1_fields(cfg, need, label)
    if model_type == "jamba":
        return _jamba_fields(cfg, need, label)
    if model_type == "kimi_linear":
        return _kimi_linear_fields(cfg, need, label)
    if model_type in QWEN_NEXT_FAMILIES:
        return _qwen_next_fields(cfg, model_type, need, label)
    fields = dict(
        n_layers=need("num_hidden_layers"),
        hidden_size=need("hidden_size"),
        n_heads=need("num_attention_heads"),
        n_kv_heads=_count(cfg, "num_key_value_heads", label) or need("num_attention_heads"),
        ffn_hidden_size=need("intermediate_size"),
        ffn_activation=_activation(cfg, model_type, label),
        vocab_size=need("vocab_size"),
        tied_embeddings=_flag(cfg, "tie_word_embeddings", model_type in GEMMA_LIKE, label),
    )
    if model_type == "llama4_text":
        fields["ffn_hidden_size"] = need("intermediate_size_mlp")  # the dense layers' MLP
    head_dim = _count(cfg, "head_dim", label) or _count(cfg, "kv_channels", label)
    if head_dim is not None and model_type not in ("deepseek_v2", "deepseek_v3"):
        fields["head_dim"] = head_dim
    fields.update(_attention_variants(cfg, model_type, fields["n_layers"], label))
    if model_type in MOE_FAMILIES:
        fields.update(_moe_fields(cfg, model_type, fields["n_layers"], need, label))
    return fields


@functools.cache
def _declared() -> tuple[frozenset[str], dict[str, dict[str, Any]]]:
    """What transformers declares (hf_config_keys.yaml): the keys of every family, and each
    family's defaults, aliases and derived keys."""
    text = resources.files("autosearch.core").joinpath("hf_config_keys.yaml")
    data = yaml.safe_load(text.read_text(encoding="utf-8"))
    return frozenset(data["common"]), data["families"]


def known_keys(model_type: str) -> frozenset[str]:
    """The config keys a family knows: those transformers declares for it, those this reader
    reads and those published configs carry undeclared (module docstring)."""
    common, families = _declared()
    family = families.get(model_type, {})
    own = {*family.get("defaults", ()), *family.get("aliases", ()), *family.get("derived", ())}
    return common | READ_KEYS | UNDECLARED_KEYS | own


def _check_keys(raw: dict[str, Any], cfg: dict[str, Any], label: str) -> dict[str, str]:
    """Warn (`UnknownConfigKeyWarning`) on each key its family does not know; return
    ``{known key: key given}`` for those close to a known key (the likely typos)."""
    scopes = [("", cfg, cfg["model_type"])]
    if cfg is not raw:  # a multimodal config: its own keys, then its text_config's
        scopes = [("", raw, raw["model_type"]), ("text_config.", raw["text_config"], scopes[0][2])]
    near_misses: dict[str, str] = {}
    for prefix, keys, model_type in scopes:
        known = known_keys(model_type)
        for key in keys:
            if key in known or key.startswith("_"):  # "_...": the writer's own state
                continue
            close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.8)
            hint = f"did you mean {close[0]!r}?" if close else "no known key is close to it"
            warnings.warn(
                f"Hugging Face config of {label!r}: {prefix}{key} is not a key of model_type "
                f"{model_type!r} and is ignored; {hint}",
                UnknownConfigKeyWarning,
                stacklevel=4,
            )
            if close:
                near_misses[close[0]] = f"{prefix}{key}"
    return near_misses


def _label(cfg: Mapping[str, Any], source: Any, name: str | None) -> str:
    """The name: given, else the config's path, its file or folder, or model_type made a plain
    name (a path may hold spaces or worse; ModelSpec refuses a name it cannot write safely)."""
    if name:
        return name
    path_name = cfg.get("_name_or_path")
    label = name_from(path_name, "") if isinstance(path_name, str) else ""
    if not label and isinstance(source, (str, os.PathLike)):
        path = os.path.abspath(os.fspath(source))
        stem = os.path.splitext(os.path.basename(path))[0]
        if os.path.isdir(path):
            stem = os.path.basename(path)
        elif stem == "config":
            stem = os.path.basename(os.path.dirname(path))
        label = name_from(stem, "")
    model_type = cfg.get("model_type")
    label = label or (name_from(model_type, "") if isinstance(model_type, str) else "")
    return label or "hf-model"


def _gpt_fields(cfg: Mapping[str, Any], model_type: str, need, label: str) -> dict[str, Any]:
    if model_type == "gpt2":
        act = cfg.get("activation_function", "gelu_new")
        hidden = need("n_embd", "hidden_size")
        fields = dict(
            n_layers=need("n_layer", "num_hidden_layers"),
            hidden_size=hidden,
            n_heads=need("n_head", "num_attention_heads"),
            ffn_hidden_size=cfg.get("n_inner") or 4 * hidden,
            ffn_activation="gelu",
            vocab_size=need("vocab_size"),
            tied_embeddings=_flag(cfg, "tie_word_embeddings", True, label),
        )
    else:  # gpt_neox
        act = cfg.get("hidden_act", "gelu")
        fields = dict(
            n_layers=need("num_hidden_layers"),
            hidden_size=need("hidden_size"),
            n_heads=need("num_attention_heads"),
            ffn_hidden_size=need("intermediate_size"),
            ffn_activation="gelu",
            vocab_size=need("vocab_size"),
            tied_embeddings=_flag(cfg, "tie_word_embeddings", False, label),
        )
    if act not in GELU_NAMES:
        raise SpecError(
            f"{label!r}: activation {act!r} is not a GELU; only GELU MLPs are modelled for "
            f"{model_type}"
        )
    head_dim = _count(cfg, "head_dim", label)
    if head_dim is not None and head_dim * fields["n_heads"] != fields["hidden_size"]:
        raise SpecError(
            f"{label!r}: head_dim {head_dim} x {fields['n_heads']} heads != hidden_size "
            f"{fields['hidden_size']}; a GPT-style ModelSpec has head size = hidden_size / heads"
        )
    return fields


def _activation(cfg: Mapping[str, Any], model_type: str, label: str) -> str:
    """The MLP: gated SiLU (SwiGLU), gated tanh GELU (GeGLU, Gemma) or squared ReLU (Nemotron)."""
    expected: tuple[str, ...]
    if model_type in GEMMA_LIKE:
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        expected, style = GELU_NAMES, "geglu"
    elif model_type == "nemotron":
        act, expected, style = cfg.get("hidden_act", "relu2"), ("relu2",), "relu2"
    else:
        act, expected, style = cfg.get("hidden_act", "silu"), ("silu", "swish"), "swiglu"
    if act not in expected:
        raise SpecError(
            f"{label!r}: hidden_act {act!r} is not the {style} MLP of {model_type} "
            f"({' or '.join(expected)}); only that is modelled"
        )
    return style


def _attention_variants(
    cfg: Mapping[str, Any], model_type: str, n_layers: int, label: str
) -> dict[str, Any]:
    """Sliding windows (which layers) and logit soft-capping."""
    out: dict[str, Any] = {}
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key) is not None:
            out[key] = cfg[key]
    window = cfg.get("sliding_window")
    if model_type.startswith("qwen"):  # Qwen2/3: a window only with use_sliding_window
        if _flag(cfg, "use_sliding_window", False, label):
            raise SpecError(
                f"{label!r}: use_sliding_window puts a window on the layers from "
                f"max_window_layers on, which a ModelSpec does not describe; set it false (the "
                "released Qwen2/Qwen3 models train without it) or write a ModelSpec YAML"
            )
        return out
    if window is None or model_type == "llama4_text":
        return out
    _count(cfg, "sliding_window", label)
    types = cfg.get("layer_types")
    pattern: int | None
    if isinstance(types, list) and types:
        sliding = [t == "sliding_attention" for t in types]
        if not any(sliding):
            return out
        pattern = _pattern(sliding, label)
    elif model_type == "gemma2":
        pattern = 2  # even layers slide (transformers Gemma2DecoderLayer)
    elif model_type == "gemma3_text":
        pattern = _count(cfg, "sliding_window_pattern", label) or 6
    elif model_type == "gpt_oss":
        pattern = 2
    else:  # Mistral, Mixtral, Phi-3: every layer
        pattern = None
    out.update(sliding_window=window, sliding_window_pattern=pattern)
    return out


def _pattern(sliding: list[bool], label: str) -> int | None:
    """The ModelSpec pattern of a config's ``layer_types``: None (all slide) or p (every p-th
    layer global)."""
    if all(sliding):
        return None
    first_global = sliding.index(False) + 1
    if first_global >= 2 and all(
        s == ((i + 1) % first_global != 0) for i, s in enumerate(sliding)
    ):
        return first_global
    raise SpecError(
        f"{label!r}: layer_types {['sliding' if s else 'full' for s in sliding]} is not "
        "every-p-th-layer-global, which is what a ModelSpec describes; write a ModelSpec YAML"
    )


def _moe_fields(
    cfg: Mapping[str, Any], model_type: str, n_layers: int, need, label: str
) -> dict[str, Any]:
    """`MoESpec` (and DeepSeek's `MLASpec`) fields, as mappings ModelSpec checks."""
    top_k = need("num_experts_per_tok", "experts_per_token")
    moe: dict[str, Any] = {"top_k": top_k, "router": "softmax", "load_balancing": "aux_loss"}
    out: dict[str, Any] = {"moe": moe}
    if model_type in ("mixtral", "gpt_oss"):
        moe.update(n_experts=need("num_local_experts"), ffn_hidden_size=need("intermediate_size"))
    elif model_type in ("qwen2_moe", "qwen3_moe"):
        moe.update(
            n_experts=need("num_experts", "num_local_experts"),
            ffn_hidden_size=need("moe_intermediate_size"),
            layer_step=_count(cfg, "decoder_sparse_step", label) or 1,
        )
        shared = _count(cfg, "shared_expert_intermediate_size", label)
        if shared:
            moe.update(n_shared_experts=1, shared_ffn_hidden_size=shared)
        if cfg.get("mlp_only_layers"):
            raise SpecError(
                f"{label!r}: mlp_only_layers {cfg['mlp_only_layers']} makes chosen layers dense, "
                "which a ModelSpec does not describe (it has leading dense layers and a step); "
                "write a ModelSpec YAML"
            )
    elif model_type == "llama4_text":
        step = _count(cfg, "interleave_moe_layer_step", label) or 1
        moe.update(
            n_experts=need("num_local_experts"),
            ffn_hidden_size=need("intermediate_size"),
            n_shared_experts=1,  # Llama4TextMoe: one shared expert as wide as a routed one
            layer_step=step,
            router="sigmoid",
        )
        listed = cfg.get("moe_layers")
        if listed is not None and list(listed) != [
            i for i in range(n_layers) if (i + 1) % step == 0
        ]:
            raise SpecError(
                f"{label!r}: moe_layers {listed} is not every {step}-th layer "
                "(interleave_moe_layer_step), which is what a ModelSpec describes"
            )
    else:  # deepseek_v2, deepseek_v3
        freq = _count(cfg, "moe_layer_freq", label) or 1
        if freq != 1:
            raise SpecError(
                f"{label!r}: moe_layer_freq {freq} (experts on every {freq}-th layer counted "
                "from 0) is not modelled; the released DeepSeek models use 1"
            )
        moe.update(
            n_experts=need("n_routed_experts"),
            ffn_hidden_size=need("moe_intermediate_size"),
            n_shared_experts=cfg.get("n_shared_experts") or 0,
            first_dense_layers=cfg.get("first_k_dense_replace") or 0,
            router=cfg.get("scoring_func") or "softmax",
            load_balancing="aux_loss_free" if cfg.get("topk_method") == "noaux_tc" else "aux_loss",
        )
        # the multi-token prediction modules the checkpoint holds (DeepSeek-V3: 1)
        out["mtp_layers"] = cfg.get("num_nextn_predict_layers") or 0
        out["mla"] = dict(
            q_lora_rank=cfg.get("q_lora_rank"),
            kv_lora_rank=need("kv_lora_rank"),
            qk_nope_head_dim=need("qk_nope_head_dim"),
            qk_rope_head_dim=need("qk_rope_head_dim"),
            v_head_dim=need("v_head_dim"),
        )
    return out


def _nemotron_h_fields(cfg: Mapping[str, Any], need, label: str) -> dict[str, Any]:
    """Nemotron-H and Nemotron 3 (transformers ``NemotronHConfig``; Megatron-Bridge
    ``nemotron_h_provider.py``): one Hugging Face layer per symbol of Megatron's hybrid pattern,
    Mamba-2 mixers, squared-ReLU MLPs and, in Nemotron 3, MoE MLPs."""
    from autosearch.core.layers import parse_pattern

    listed = cfg.get("layers_block_type")
    if isinstance(listed, (list, tuple)) and listed:
        unknown = sorted({str(k) for k in listed} - set(NEMOTRON_H_SYMBOLS))
        if unknown:
            raise SpecError(
                f"{label!r}: layers_block_type names {', '.join(unknown)}, not one of "
                f"{', '.join(NEMOTRON_H_SYMBOLS)}"
            )
        pattern = "".join(NEMOTRON_H_SYMBOLS[k] for k in listed)
    elif cfg.get("hybrid_override_pattern") is not None:
        pattern = cfg["hybrid_override_pattern"]
    else:  # NemotronHConfig.__post_init__'s default layers
        pattern = "".join(NEMOTRON_H_SYMBOLS[k] for k in NEMOTRON_H_DEFAULT_LAYERS)
    blocks = parse_pattern(pattern)
    act = cfg.get("mlp_hidden_act") or "relu2"
    if act != "relu2":
        raise SpecError(
            f"{label!r}: mlp_hidden_act {act!r} is not the relu2 MLP of nemotron_h; only that "
            "is modelled"
        )
    if cfg.get("moe_latent_size"):
        raise SpecError(
            f"{label!r}: moe_latent_size {cfg['moe_latent_size']} (experts in a latent space, "
            "Nemotron 3 Super) is not modelled; write a ModelSpec YAML"
        )
    for key in ("attention_bias", "mlp_bias", "use_bias"):
        if cfg.get(key):
            raise SpecError(f"{label!r}: {key} true is not modelled (the released models: false)")
    fields: dict[str, Any] = dict(
        n_layers=len(blocks),
        hidden_size=need("hidden_size"),
        n_heads=need("num_attention_heads"),
        n_kv_heads=_count(cfg, "num_key_value_heads", label) or need("num_attention_heads"),
        ffn_hidden_size=need("intermediate_size"),
        ffn_activation="relu2",
        vocab_size=need("vocab_size"),
        tied_embeddings=_flag(cfg, "tie_word_embeddings", False, label),
        head_dim=_count(cfg, "attention_head_dim", label) or need("head_dim"),
        layer_pattern=pattern,
        mamba=dict(
            n_heads=need("mamba_num_heads"),
            head_dim=need("mamba_head_dim"),
            d_state=need("ssm_state_size"),
            n_groups=need("n_groups"),
            conv_kernel=need("conv_kernel"),
            chunk_size=need("chunk_size"),
            conv_bias=_flag(cfg, "use_conv_bias", True, label),
        ),
    )
    if "E" in pattern:
        fields["moe"] = dict(
            n_experts=need("n_routed_experts"),
            top_k=need("num_experts_per_tok"),
            ffn_hidden_size=need("moe_intermediate_size"),
            n_shared_experts=1,  # NemotronHMoE.shared_experts: one MLP
            shared_ffn_hidden_size=need("moe_shared_expert_intermediate_size"),
            router="sigmoid",  # NemotronHTopkRouter; Megatron-Bridge: expert bias
            load_balancing="aux_loss_free",
        )
    return fields


def _granite_hybrid_fields(cfg: Mapping[str, Any], need, label: str) -> dict[str, Any]:
    """IBM Granite 4.0-H (transformers ``GraniteMoeHybridConfig``): every layer a Mamba-2 or an
    attention mixer (``layer_types``: ``mamba`` / ``linear_attention`` or ``attention`` /
    ``full_attention``) with a SwiGLU shared MLP of ``shared_intermediate_size`` and, where
    ``num_local_experts`` > 0, routed experts of ``intermediate_size`` beside it (a MoE MLP
    with one shared expert); d_inner = ``mamba_expand`` x hidden, split in ``mamba_n_heads``."""
    n_layers = need("num_hidden_layers")
    listed = cfg.get("layer_types") or ["linear_attention"] * n_layers
    mixers = {"mamba": "M", "linear_attention": "M", "attention": "*", "full_attention": "*"}
    unknown = sorted({str(k) for k in listed} - set(mixers))
    if unknown:
        raise SpecError(
            f"{label!r}: layer_types names {', '.join(unknown)}, not one of {', '.join(mixers)}"
        )
    for key in ("attention_bias", "mamba_proj_bias"):
        if cfg.get(key):
            raise SpecError(f"{label!r}: {key} true is not modelled (the released models: false)")
    act = cfg.get("hidden_act") or "silu"
    if act not in ("silu", "swish"):
        raise SpecError(f"{label!r}: hidden_act {act!r} is not granitemoehybrid's SwiGLU")
    hidden, heads = need("hidden_size"), need("mamba_n_heads")
    d_head = cfg.get("mamba_d_head")
    if d_head in (None, "auto"):  # GraniteMoeHybridConfig.__post_init__
        d_head = need("mamba_expand") * hidden // heads
    experts = cfg.get("num_local_experts") or 0
    mlp = "E" if experts else "-"
    shared = need("shared_intermediate_size")
    fields: dict[str, Any] = dict(
        n_layers=len(listed),
        hidden_size=hidden,
        n_heads=need("num_attention_heads"),
        n_kv_heads=_count(cfg, "num_key_value_heads", label) or need("num_attention_heads"),
        ffn_hidden_size=shared,
        ffn_activation="swiglu",
        vocab_size=need("vocab_size"),
        tied_embeddings=_flag(cfg, "tie_word_embeddings", False, label),
        layer_pattern="".join(mixers[k] + mlp for k in listed),
        mamba=dict(
            n_heads=heads,
            head_dim=d_head,
            d_state=need("mamba_d_state"),
            n_groups=need("mamba_n_groups"),
            conv_kernel=need("mamba_d_conv"),
            chunk_size=need("mamba_chunk_size"),
            conv_bias=_flag(cfg, "mamba_conv_bias", True, label),
        ),
    )
    if experts:
        fields["moe"] = dict(
            n_experts=experts,
            top_k=need("num_experts_per_tok"),
            ffn_hidden_size=need("intermediate_size"),
            n_shared_experts=1,  # the shared MLP beside the experts
            shared_ffn_hidden_size=shared,
            router="softmax",  # GraniteMoeHybridTopKRouter: softmax over the top-k logits
        )
    return fields


def _falcon_h1_fields(cfg: Mapping[str, Any], need, label: str) -> dict[str, Any]:
    """Falcon-H1 (transformers ``FalconH1Config``, ``FalconH1DecoderLayer``): every layer one
    RMSNorm, then ``FalconH1Attention`` and ``FalconH1Mixer`` (Mamba-2) on the same input, their
    outputs summed, then a SwiGLU MLP (``P-`` in the layer pattern). The mixer's d_inner is
    ``mamba_d_ssm``, or ``mamba_expand`` x hidden where that is null, in ``mamba_n_heads``
    heads of ``mamba_d_head`` ("auto": d_inner / heads, ``FalconH1Config.__post_init__``); its
    gated RMSNorm exists where ``mamba_rms_norm``; ``mamba_proj_bias`` biases in_proj and
    ``projectors_bias`` out_proj. The attention's head size is the config's ``head_dim`` where
    given, else hidden / heads (``FalconH1Attention``)."""
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            raise SpecError(f"{label!r}: {key} true is not modelled (the released: false)")
    in_bias, out_bias = bool(cfg.get("mamba_proj_bias")), bool(cfg.get("projectors_bias"))
    if in_bias != out_bias:
        raise SpecError(
            f"{label!r}: mamba_proj_bias {in_bias} and projectors_bias {out_bias} differ; a "
            "Mamba-2 mixer here has biases on both its projections or on neither (the "
            "released Falcon-H1: neither)"
        )
    act = cfg.get("hidden_act") or "silu"
    if act not in ("silu", "swish"):
        raise SpecError(f"{label!r}: hidden_act {act!r} is not falcon_h1's SwiGLU")
    n_layers, hidden = need("num_hidden_layers"), need("hidden_size")
    d_inner = cfg.get("mamba_d_ssm") or need("mamba_expand") * hidden
    heads = need("mamba_n_heads")
    d_head = cfg.get("mamba_d_head")
    if d_head in (None, "auto"):
        d_head = d_inner // heads
    if d_head * heads != d_inner:  # FalconH1Config.validate_architecture
        raise SpecError(
            f"{label!r}: mamba_n_heads {heads} x mamba_d_head {d_head} = {heads * d_head} is "
            f"not the Mamba-2 width mamba_d_ssm {d_inner}; give heads and a head size whose "
            "product is the width"
        )
    fields: dict[str, Any] = dict(
        n_layers=n_layers,
        hidden_size=hidden,
        n_heads=need("num_attention_heads"),
        n_kv_heads=_count(cfg, "num_key_value_heads", label) or need("num_attention_heads"),
        ffn_hidden_size=need("intermediate_size"),
        ffn_activation="swiglu",
        vocab_size=need("vocab_size"),
        tied_embeddings=_flag(cfg, "tie_word_embeddings", False, label),
        layer_pattern="P-" * n_layers,
        mamba=dict(
            n_heads=heads,
            head_dim=d_head,
            d_state=need("mamba_d_state"),
            n_groups=need("mamba_n_groups"),
            conv_kernel=need("mamba_d_conv"),
            chunk_size=need("mamba_chunk_size"),
            conv_bias=_flag(cfg, "mamba_conv_bias", True, label),
            proj_bias=in_bias,
            gated_norm=_flag(cfg, "mamba_rms_norm", False, label),
        ),
    )
    head_dim = _count(cfg, "head_dim", label)
    if head_dim is not None:
        fields["head_dim"] = head_dim
    return fields


def _jamba_fields(cfg: Mapping[str, Any], need, label: str) -> dict[str, Any]:
    """Jamba (transformers ``JambaConfig``): layer i is attention where i % attn_layer_period
    == attn_layer_offset, else a Mamba-1 mixer (``JambaMambaMixer``: d_inner = mamba_expand x
    hidden, dt_rank "auto" = ceil(hidden / 16), RMSNorms on dt, B and C); its MLP is a MoE of
    ``num_experts`` SwiGLU experts of ``intermediate_size`` (``JambaSparseMoeBlock``: softmax
    top-k, no shared expert) where i % expert_layer_period == expert_layer_offset, else a
    SwiGLU MLP of the same width (``layers_block_type``, ``layers_num_experts``)."""
    act = cfg.get("hidden_act") or "silu"
    if act not in ("silu", "swish"):
        raise SpecError(f"{label!r}: hidden_act {act!r} is not jamba's SwiGLU")
    n_layers, hidden = need("num_hidden_layers"), need("hidden_size")
    periods = {
        key: need(key)
        for key in (
            "attn_layer_period",
            "attn_layer_offset",
            "expert_layer_period",
            "expert_layer_offset",
        )
    }
    for kind in ("attn", "expert"):
        period, offset = periods[f"{kind}_layer_period"], periods[f"{kind}_layer_offset"]
        if not (isinstance(period, int) and isinstance(offset, int) and 0 <= offset < period):
            raise SpecError(
                f"{label!r}: {kind}_layer_offset {offset!r} must be an integer below "
                f"{kind}_layer_period {period!r} (JambaConfig.validate_architecture)"
            )
    experts = need("num_experts")
    mixers = [
        "*" if i % periods["attn_layer_period"] == periods["attn_layer_offset"] else "S"
        for i in range(n_layers)
    ]
    mlps = [
        "E"
        if experts > 1 and i % periods["expert_layer_period"] == periods["expert_layer_offset"]
        else "-"
        for i in range(n_layers)
    ]
    dt_rank = need("mamba_dt_rank")
    if dt_rank == "auto":  # JambaConfig.__post_init__
        dt_rank = math.ceil(hidden / 16)
    fields: dict[str, Any] = dict(
        n_layers=n_layers,
        hidden_size=hidden,
        n_heads=need("num_attention_heads"),
        n_kv_heads=_count(cfg, "num_key_value_heads", label) or need("num_attention_heads"),
        ffn_hidden_size=need("intermediate_size"),
        ffn_activation="swiglu",
        vocab_size=need("vocab_size"),
        tied_embeddings=_flag(cfg, "tie_word_embeddings", False, label),
        layer_pattern="".join(a + b for a, b in zip(mixers, mlps)),
        mamba1=dict(
            d_inner=need("mamba_expand") * hidden,
            d_state=need("mamba_d_state"),
            dt_rank=dt_rank,
            conv_kernel=need("mamba_d_conv"),
            conv_bias=_flag(cfg, "mamba_conv_bias", True, label),
            proj_bias=_flag(cfg, "mamba_proj_bias", False, label),
        ),
    )
    if "E" in mlps:
        fields["moe"] = dict(
            n_experts=experts,
            top_k=need("num_experts_per_tok"),
            ffn_hidden_size=need("intermediate_size"),
            router="softmax",  # JambaTopKRouter: softmax, top-k not renormalised
        )
    if "S" not in mixers:
        del fields["mamba1"]
    return fields


def _kimi_linear_fields(cfg: Mapping[str, Any], need, label: str) -> dict[str, Any]:
    """Kimi Linear (transformers ``KimiLinearConfig``, ``KimiLinearDecoderLayer``): each layer
    Kimi Delta Attention (``KimiLinearDeltaAttention``: `GatedDeltaNetSpec` with ``gate_rank``
    = the head size) or MLA (``KimiLinearAttention``), each with a SwiGLU MLP of
    ``intermediate_size`` (``mlp_layer_types`` dense; by default the first
    ``first_k_dense_replace``, 1) or a MoE (``KimiLinearMoE``: ``num_local_experts`` of
    ``moe_intermediate_size``, sigmoid router with ``e_score_correction_bias``, one shared
    MLP ``n_shared_experts`` times as wide). The checkpoint gives the linear attention's shape
    and layers in ``linear_attn_config`` (``head_dim``, ``num_heads``,
    ``short_conv_kernel_size``, 1-indexed ``full_attn_layers`` / ``kda_layers``), which
    ``__post_init__`` reads before the defaults (every 4th layer from layer 4 MLA)."""
    nested = cfg.get("linear_attn_config") or {}
    if not isinstance(nested, Mapping):
        raise SpecError(f"{label!r}: linear_attn_config must be a mapping, got {nested!r}")
    n_layers, hidden = need("num_hidden_layers"), need("hidden_size")
    listed = cfg.get("layer_types")
    if not listed and "full_attn_layers" in nested and "kda_layers" in nested:
        listed = [None] * n_layers
        for key, kind in (("full_attn_layers", "full_attention"), ("kda_layers", "kda")):
            for i in nested[key]:
                if not (isinstance(i, int) and 1 <= i <= n_layers):
                    raise SpecError(
                        f"{label!r}: linear_attn_config.{key} names layer {i!r}; layers are "
                        f"numbered 1 to {n_layers}"
                    )
                listed[i - 1] = kind
    if not listed:
        listed = [
            "full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n_layers)
        ]
    mixers = {"full_attention": "*", "linear_attention": "G", "kda": "G"}
    unknown = sorted({str(k) for k in listed} - set(mixers))
    if unknown or len(listed) != n_layers:
        raise SpecError(
            f"{label!r}: layer_types must give full_attention or linear_attention for each of "
            f"the {n_layers} layers; got {len(listed)} entries"
            + (f" naming {', '.join(unknown)}" if unknown else "")
        )
    mlp_types = cfg.get("mlp_layer_types")
    if not mlp_types:
        dense = cfg.get("first_k_dense_replace", 1)
        mlp_types = ["dense" if i < dense else "sparse" for i in range(n_layers)]
    mlps = {"dense": "-", "sparse": "E"}
    if sorted({str(k) for k in mlp_types} - set(mlps)) or len(mlp_types) != n_layers:
        raise SpecError(
            f"{label!r}: mlp_layer_types must give dense or sparse for each of the {n_layers} "
            f"layers, got {mlp_types!r}"
        )
    for key in ("attention_bias",):
        if cfg.get(key):
            raise SpecError(f"{label!r}: {key} true is not modelled (the released: false)")
    act = cfg.get("hidden_act") or "silu"
    if act not in ("silu", "swish"):
        raise SpecError(f"{label!r}: hidden_act {act!r} is not kimi_linear's SwiGLU")
    heads = nested.get("num_heads") or need("linear_num_heads")
    head_dim = nested.get("head_dim") or need("linear_head_dim")
    pattern = "".join(mixers[k] + mlps[t] for k, t in zip(listed, mlp_types))
    fields: dict[str, Any] = dict(
        n_layers=n_layers,
        hidden_size=hidden,
        n_heads=need("num_attention_heads"),
        ffn_hidden_size=need("intermediate_size"),
        ffn_activation="swiglu",
        vocab_size=need("vocab_size"),
        tied_embeddings=_flag(cfg, "tie_word_embeddings", False, label),
        layer_pattern=pattern,
        gdn=dict(
            n_k_heads=heads,
            n_v_heads=heads,
            head_k_dim=head_dim,
            head_v_dim=head_dim,
            conv_kernel=nested.get("short_conv_kernel_size") or need("linear_conv_kernel_dim"),
            gate_rank=head_dim,  # f_a_proj, g_a_proj: hidden -> head_dim
        ),
        mla=dict(
            q_lora_rank=cfg.get("q_lora_rank"),
            kv_lora_rank=need("kv_lora_rank"),
            qk_nope_head_dim=need("qk_nope_head_dim"),
            qk_rope_head_dim=need("qk_rope_head_dim"),
            v_head_dim=need("v_head_dim"),
        ),
    )
    if "E" in pattern:
        moe_width = need("moe_intermediate_size")
        shared = cfg.get("num_shared_experts") or 0  # n_shared_experts (an alias)
        fields["moe"] = dict(
            n_experts=need("num_experts"),  # num_local_experts in the checkpoint (an alias)
            top_k=need("num_experts_per_token"),
            ffn_hidden_size=moe_width,
            n_shared_experts=1 if shared else 0,  # one MLP n_shared_experts times as wide
            shared_ffn_hidden_size=moe_width * shared if shared else None,
            router="sigmoid",  # KimiLinearTopkRouter: sigmoid scores + e_score_correction_bias
            load_balancing="aux_loss_free",
        )
    if "G" not in pattern:
        del fields["gdn"]
    if "*" not in pattern:
        del fields["mla"]
    return fields


def _qwen_next_fields(cfg: Mapping[str, Any], model_type: str, need, label: str) -> dict[str, Any]:
    """Qwen3-Next and Qwen3.5 (transformers ``Qwen3NextConfig``, ``Qwen3_5TextConfig``,
    ``Qwen3_5MoeTextConfig``): ``layer_types`` (``linear_attention``: a Gated DeltaNet mixer,
    `GatedDeltaNetSpec`; ``full_attention``: gated attention, `attention_output_gate`, whose
    q_proj also gives the gate), by default every ``full_attention_interval``-th layer (4)
    attention. The MLP: Qwen3-Next a MoE (routed experts and one shared expert) where
    ``num_experts`` > 0 and (i + 1) is a multiple of ``decoder_sparse_step``, a SwiGLU MLP of
    ``intermediate_size`` in the ``mlp_only_layers`` and elsewhere; Qwen3.5 dense every layer,
    Qwen3.5-MoE a MoE every layer."""
    n_layers = need("num_hidden_layers")
    listed = cfg.get("layer_types")
    if not listed:  # Qwen3NextConfig.__post_init__: full_attention_interval, 4 by default
        every = _count(cfg, "full_attention_interval", label) or 4
        listed = [
            "full_attention" if (i + 1) % every == 0 else "linear_attention"
            for i in range(n_layers)
        ]
    mixers = {"linear_attention": "G", "full_attention": "*"}
    unknown = sorted({str(k) for k in listed} - set(mixers))
    if unknown or len(listed) != n_layers:
        raise SpecError(
            f"{label!r}: layer_types must give one of {', '.join(mixers)} for each of the "
            f"{n_layers} layers; got {len(listed)} entries"
            + (f" naming {', '.join(unknown)}" if unknown else "")
        )
    if cfg.get("attention_bias"):
        raise SpecError(f"{label!r}: attention_bias true is not modelled (the released: false)")
    act = cfg.get("hidden_act") or "silu"
    if act not in ("silu", "swish"):
        raise SpecError(f"{label!r}: hidden_act {act!r} is not {model_type}'s SwiGLU")
    if model_type == "qwen3_5_text":
        experts = 0
    else:
        experts = need("num_experts")
    step = 1 if model_type != "qwen3_next" else _count(cfg, "decoder_sparse_step", label) or 1
    dense_only = set(cfg.get("mlp_only_layers") or ()) if model_type == "qwen3_next" else set()
    mlps = [
        "E" if experts and i not in dense_only and (i + 1) % step == 0 else "-"
        for i in range(n_layers)
    ]
    fields: dict[str, Any] = dict(
        n_layers=n_layers,
        hidden_size=need("hidden_size"),
        n_heads=need("num_attention_heads"),
        n_kv_heads=_count(cfg, "num_key_value_heads", label) or need("num_attention_heads"),
        head_dim=need("head_dim"),
        ffn_activation="swiglu",
        vocab_size=need("vocab_size"),
        tied_embeddings=_flag(cfg, "tie_word_embeddings", False, label),
        layer_pattern="".join(mixers[k] + mlp for k, mlp in zip(listed, mlps)),
        attention_output_gate=True,  # q_proj: 2 x heads x head_dim (the gate beside Q)
        gdn=dict(
            n_k_heads=need("linear_num_key_heads"),
            n_v_heads=need("linear_num_value_heads"),
            head_k_dim=need("linear_key_head_dim"),
            head_v_dim=need("linear_value_head_dim"),
            conv_kernel=need("linear_conv_kernel_dim"),
        ),
    )
    if "-" in mlps:  # the dense MLPs' width (Qwen3.5-MoE has none)
        fields["ffn_hidden_size"] = need("intermediate_size")
    if experts:
        fields["moe"] = dict(
            n_experts=experts,
            top_k=need("num_experts_per_tok"),
            ffn_hidden_size=need("moe_intermediate_size"),
            n_shared_experts=1,  # Qwen3NextSparseMoeBlock.shared_expert: one gated MLP
            shared_ffn_hidden_size=need("shared_expert_intermediate_size"),
            router="softmax",  # Qwen3NextTopKRouter: softmax, top-k renormalised
        )
    if "G" not in fields["layer_pattern"]:
        del fields["gdn"]
    return fields
