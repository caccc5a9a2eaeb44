"""Which wrapper the Engine puts around a transformers causal LM: one entry per ``model_type``.

Every family the planner reads (`autosearch.core.hf_config.SUPPORTED`) trains here
(`build.refuse_hf_family` names them for a model of another family), each under its own
parameter names: the Llama layout in `HFCausalLM` (causal_lm.py: Llama, Mistral, Qwen2, and
Mixtral / Qwen3-MoE with the Engine's MoE), GPT-2 and GPT-NeoX in `HFGPTCausalLM` (gpt.py), the
dense families beyond Llama in `HFDenseCausalLM` (dense.py: Qwen3, Gemma 1-3, Phi-3, Nemotron),
the MoE families with their own module (qwen2_moe.py, deepseek.py, gpt_oss.py, llama4.py), and
the hybrids Nemotron-H / Nemotron 3 and Granite 4.0-H (hybrid.py) and Qwen3-Next
(qwen3_next.py; not yet Qwen3.5, whose Gated DeltaNet projections are laid out otherwise). A
new family is one entry here and, if the existing wrappers do not fit, one module
(docs/contributing.md).
"""

from __future__ import annotations

import importlib

from torch import nn

_CAUSAL = "autosearch.models.hf.causal_lm:HFCausalLM"
_GPT = "autosearch.models.hf.gpt:HFGPTCausalLM"
_DENSE = "autosearch.models.hf.dense:HFDenseCausalLM"
# model_type -> "module:class" of its wrapper (imported when a model of that family comes)
WRAPPERS = {
    **dict.fromkeys(("llama", "mistral", "qwen2", "mixtral", "qwen3_moe"), _CAUSAL),
    **dict.fromkeys(("gpt2", "gpt_neox"), _GPT),
    **dict.fromkeys(("qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "nemotron"), _DENSE),
    "qwen2_moe": "autosearch.models.hf.qwen2_moe:Qwen2MoeCausalLM",
    "deepseek_v2": "autosearch.models.hf.deepseek:DeepseekCausalLM",
    "deepseek_v3": "autosearch.models.hf.deepseek:DeepseekCausalLM",
    "gpt_oss": "autosearch.models.hf.gpt_oss:GptOssCausalLM",
    "llama4_text": "autosearch.models.hf.llama4:Llama4CausalLM",
    "nemotron_h": "autosearch.models.hf.hybrid:NemotronHCausalLM",
    "granitemoehybrid": "autosearch.models.hf.hybrid:GraniteHybridCausalLM",
    "qwen3_next": "autosearch.models.hf.qwen3_next:Qwen3NextCausalLM",
}
FAMILIES = tuple(WRAPPERS)  # the model_types the Engine trains


def model_type_of(model: nn.Module) -> str | None:
    return getattr(getattr(model, "config", None), "model_type", None)


def wrapper_class(model: nn.Module) -> type[nn.Module] | None:
    """The wrapper class of a transformers causal LM of a family the Engine trains, if it has
    that family's layout (a Llama-layout model has ``.model`` and ``.lm_head``; GPT-2's other
    heads are not causal LMs alone), else None."""
    model_type = model_type_of(model)
    if model_type not in WRAPPERS or not type(model).__module__.startswith("transformers."):
        return None
    module, _, name = WRAPPERS[model_type].partition(":")
    wrapper = getattr(importlib.import_module(module), name)
    return wrapper if wrapper.takes(model) else None
