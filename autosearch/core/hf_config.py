"""Read a Hugging Face ``config.json`` into a ModelSpec (torch-free; transformers not needed).

Reads the dense decoder-only families whose shape a ModelSpec describes:

======================  ==================================================  ==============
model_type              keys read                                           ModelSpec style
======================  ==================================================  ==============
llama, mistral, qwen2   num_hidden_layers, hidden_size, num_attention_      swiglu (Llama)
                        heads, num_key_value_heads, intermediate_size,
                        vocab_size, max_position_embeddings, tie_word_
                        embeddings, hidden_act (silu), head_dim
gpt2                    n_layer, n_embd, n_head, n_inner, vocab_size,        gelu (GPT)
                        n_positions, activation_function
gpt_neox                num_hidden_layers, hidden_size, num_attention_      gelu (GPT)
                        heads, intermediate_size, vocab_size, max_position_
                        embeddings, tie_word_embeddings, hidden_act
======================  ==================================================  ==============

What a ModelSpec leaves out, and so the cost model does not count: Qwen2's q/k/v biases (3h + 2
kv_h parameters per layer, under 0.1% of Qwen2-7B), and GPT-NeoX's rotary positions (the GPT style
counts learned positions, seq_len * h parameters, 0.2% of Pythia-1B at 2,048 tokens).
Mixture-of-experts configs (Mixtral, Qwen2-MoE, DeepSeek, ...) are refused with a clear message
until experts are modelled.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from autosearch.core._io import name_from, read_regular_file
from autosearch.core.errors import SpecError

LLAMA_LIKE = ("llama", "mistral", "qwen2")
GPT_LIKE = ("gpt2", "gpt_neox")
SUPPORTED = LLAMA_LIKE + GPT_LIKE
# Keys by which a config announces experts (Mixtral, Qwen2-MoE / Qwen3-MoE, DeepSeek-V2/V3, DBRX).
MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
GELU_NAMES = ("gelu", "gelu_new", "gelu_fast", "gelu_pytorch_tanh", "gelu_python")


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
        name: the spec's name; default the config's ``_name_or_path``, else its model_type.
        seq_len: training sequence length; default the config's maximum positions
            (``max_position_embeddings`` / ``n_positions``), which is often longer than one trains.

    Raises:
        SpecError: an unsupported family (named, with the supported ones), a mixture-of-experts
            config, a head size other than hidden_size / heads, or missing keys.

    Example:
        >>> fields = spec_fields({"model_type": "llama", "num_hidden_layers": 2,
        ...     "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128,
        ...     "vocab_size": 100, "max_position_embeddings": 32})
        >>> fields["ffn_activation"], fields["n_kv_heads"]
        ('swiglu', 4)
    """
    cfg = read_config(source)
    model_type = cfg.get("model_type")
    # The name: given, else the config's path or model_type made a plain name (a path may hold
    # spaces or worse; ModelSpec refuses a name it cannot write into scripts safely).
    path_name = cfg.get("_name_or_path")
    label = name or (name_from(path_name, "") if isinstance(path_name, str) else "")
    label = label or (name_from(model_type, "") if isinstance(model_type, str) else "")
    label = label or "hf-model"
    experts = [k for k in MOE_KEYS if cfg.get(k)]
    if experts or "moe" in str(model_type) or model_type == "mixtral":
        detail = f" ({experts[0]}={cfg[experts[0]]})" if experts else ""
        raise SpecError(
            f"Hugging Face config of {label!r} is a mixture-of-experts model "
            f"(model_type {model_type!r}{detail}); autosearch does not model experts yet. "
            "Describe a dense model of the same width, or wait for MoE support"
        )
    if model_type not in SUPPORTED:
        raise SpecError(
            f"Hugging Face model_type {model_type!r} is not supported; supported: "
            f"{', '.join(SUPPORTED)}. Write a ModelSpec YAML (n_layers, hidden_size, n_heads, "
            "vocab_size, seq_len) for other models"
        )

    def need(*keys: str):
        for key in keys:
            if cfg.get(key) is not None:
                return cfg[key]
        raise SpecError(
            f"Hugging Face config of {label!r} (model_type {model_type!r}) lacks {keys[0]!r}"
        )

    if model_type in LLAMA_LIKE:
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise SpecError(
                f"{label!r}: hidden_act {act!r} is not the gated SiLU (SwiGLU) MLP of "
                f"{model_type}; only silu is modelled"
            )
        fields = dict(
            n_layers=need("num_hidden_layers"),
            hidden_size=need("hidden_size"),
            n_heads=need("num_attention_heads"),
            n_kv_heads=_count(cfg, "num_key_value_heads", label) or need("num_attention_heads"),
            ffn_hidden_size=need("intermediate_size"),
            ffn_activation="swiglu",
            vocab_size=need("vocab_size"),
            seq_len=seq_len or need("max_position_embeddings"),
            tied_embeddings=_flag(cfg, "tie_word_embeddings", False, label),
        )
    elif model_type == "gpt2":
        act = cfg.get("activation_function", "gelu_new")
        hidden = need("n_embd", "hidden_size")
        fields = dict(
            n_layers=need("n_layer", "num_hidden_layers"),
            hidden_size=hidden,
            n_heads=need("n_head", "num_attention_heads"),
            ffn_hidden_size=cfg.get("n_inner") or 4 * hidden,
            ffn_activation="gelu",
            vocab_size=need("vocab_size"),
            seq_len=seq_len or need("n_positions", "n_ctx"),
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
            seq_len=seq_len or need("max_position_embeddings"),
            tied_embeddings=_flag(cfg, "tie_word_embeddings", False, label),
        )
    if model_type in GPT_LIKE and act not in GELU_NAMES:
        raise SpecError(
            f"{label!r}: activation {act!r} is not a GELU; only GELU MLPs are modelled for "
            f"{model_type}"
        )
    head_dim = _count(cfg, "head_dim", label)
    if head_dim is not None and head_dim * fields["n_heads"] != fields["hidden_size"]:
        raise SpecError(
            f"{label!r}: head_dim {head_dim} x {fields['n_heads']} heads != hidden_size "
            f"{fields['hidden_size']}; a ModelSpec assumes head size = hidden_size / heads"
        )
    return {"name": str(label), **fields}
