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
=====================================  =======================================================

What a ModelSpec leaves out, and so neither counts nor prices: Qwen2's q/k/v biases (3h + 2
kv_h per layer, under 0.1% of Qwen2-7B), Qwen3's and Gemma 3's q/k norms and Gemma 2/3's extra
post-attention and post-MLP norms (h or head_dim weights each), Nemotron's LayerNorm biases,
gpt-oss's attention and expert biases and attention sinks (0.03% of gpt-oss-120b), Qwen2-MoE's
shared-expert gate (h weights), Llama 4's chunked attention (``attention_chunk_size``: counted as
full attention, an upper bound) and GPT-NeoX's rotary positions (the GPT style counts learned
positions, seq_len * h parameters, 0.2% of Pythia-1B at 2,048 tokens).
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping
from typing import Any

from autosearch.core._io import name_from, read_regular_file
from autosearch.core.errors import SpecError

# The Llama-shaped families the Engine's Hugging Face plans know (`autosearch.engine.hf`).
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
SUPPORTED = SWIGLU_DENSE + GEMMA_LIKE + ("nemotron",) + MOE_FAMILIES + GPT_LIKE
NESTED = {"llama4": "llama4_text", "gemma3": "gemma3_text"}  # multimodal: the text model
# Keys by which a config announces experts (Mixtral, Qwen2-MoE / Qwen3-MoE, DeepSeek-V2/V3, DBRX).
MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
GELU_NAMES = ("gelu", "gelu_new", "gelu_fast", "gelu_pytorch_tanh", "gelu_python")
# A training length above this is rarely meant: warn when it comes from max_position_embeddings.
LONG_SEQ_LEN = 32768


class LongSequenceWarning(UserWarning):
    """The training sequence length came from a config's maximum positions and is long."""


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

    Raises:
        SpecError: an unsupported family (named, with the supported ones), a layout a ModelSpec
            cannot describe (named), or missing keys.

    Example:
        >>> fields = spec_fields({"model_type": "llama", "num_hidden_layers": 2,
        ...     "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128,
        ...     "vocab_size": 100, "max_position_embeddings": 32})
        >>> fields["ffn_activation"], fields["n_kv_heads"]
        ('swiglu', 4)
    """
    cfg = read_config(source)
    model_type = cfg.get("model_type")
    if model_type in NESTED and isinstance(cfg.get("text_config"), Mapping):
        outer = cfg
        cfg = {"model_type": NESTED[model_type], **cfg["text_config"]}
        cfg.setdefault("_name_or_path", outer.get("_name_or_path"))
        model_type = cfg["model_type"]
    label = _label(cfg, source, name)
    experts = [k for k in MOE_KEYS if cfg.get(k)]
    if model_type not in SUPPORTED:
        what = "mixture-of-experts family" if experts or "moe" in str(model_type) else "family"
        raise SpecError(
            f"Hugging Face model_type {model_type!r} ({label!r}) is not a supported {what}; "
            f"supported: {', '.join(SUPPORTED)}. Write a ModelSpec YAML (n_layers, hidden_size, "
            "n_heads, vocab_size, seq_len; moe and mla as nested mappings) for other models"
        )

    def need(*keys: str):
        for key in keys:
            if cfg.get(key) is not None:
                return cfg[key]
        raise SpecError(
            f"Hugging Face config of {label!r} (model_type {model_type!r}) lacks {keys[0]!r}"
        )

    if model_type in GPT_LIKE:
        fields = _gpt_fields(cfg, model_type, need, label)
    else:
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
    if seq_len is None:
        seq_len = need("max_position_embeddings", "n_positions", "n_ctx")
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
