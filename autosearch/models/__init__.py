"""The torch models the Engine trains: the reference transformer built from a ModelSpec, its
mixture-of-experts layer, and adapters that run Hugging Face ``transformers`` models under their
own parameter names (`autosearch.models.hf`).

The Engine imports models, never the other way round; models use the parallel building blocks of
`autosearch.distributed` (the plan each model declares, context-parallel attention). Exports are
lazy (PEP 562): importing this package does not import torch.
"""

from __future__ import annotations

from autosearch._lazy import lazy_exports

_EXPORTS = {
    "Transformer": "autosearch.models.transformer",
    "build": "autosearch.models.transformer",
    "MoE": "autosearch.models.moe",
    "HFCausalLM": "autosearch.models.hf.causal_lm",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports("autosearch.models", globals(), _EXPORTS)
