"""Which wrapper the Engine puts around a transformers mixture-of-experts model of the families
with their own module here (Qwen2-MoE, DeepSeek-V2/V3, gpt-oss, Llama 4 text); Mixtral and
Qwen3-MoE run in `HFCausalLM` itself (autosearch/models/hf/causal_lm.py)."""

from __future__ import annotations

import importlib

from torch import nn

from autosearch.models.hf.causal_lm import HFCausalLM, has_llama_layout

# model_type -> "module:class" of its wrapper (imported when a model of that family comes)
WRAPPERS = {
    "qwen2_moe": "autosearch.models.hf.qwen2_moe:Qwen2MoeCausalLM",
    "deepseek_v2": "autosearch.models.hf.deepseek:DeepseekCausalLM",
    "deepseek_v3": "autosearch.models.hf.deepseek:DeepseekCausalLM",
    "gpt_oss": "autosearch.models.hf.gpt_oss:GptOssCausalLM",
    "llama4_text": "autosearch.models.hf.llama4:Llama4CausalLM",
}


def wrapper_class(model: nn.Module) -> type[HFCausalLM] | None:
    """The wrapper class of a transformers causal LM of one of these families (``.model`` and
    ``.lm_head``), else None."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in WRAPPERS or not has_llama_layout(model, (model_type,)):
        return None
    module, _, name = WRAPPERS[model_type].partition(":")
    return getattr(importlib.import_module(module), name)
