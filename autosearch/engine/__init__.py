"""The PyTorch runtime: `Engine` applies a Strategy with torch.distributed.

Exports are lazy (PEP 562): ``from autosearch.engine import Engine`` does not import torch; the
Engine imports it when first used. `SyntheticTokens`, `Accuracy` and `run_main` import torch.
"""

from __future__ import annotations

from autosearch._lazy import lazy_exports

_EXPORTS = {
    "Engine": "autosearch.engine._engine",
    "ParallelPlan": "autosearch.distributed.plan",
    "ParallelDims": "autosearch.engine.parallel_dims",
    "dp_mode": "autosearch.core.dp_modes",
    "SyntheticTokens": "autosearch.engine.data",
    "TokenFile": "autosearch.engine.data",
    "WarmupDecay": "autosearch.engine.lr_schedule",
    "HFCausalLM": "autosearch.models.hf.causal_lm",
    "Metric": "autosearch.engine.metrics",
    "Accuracy": "autosearch.engine.metrics",
    "run_main": "autosearch.engine.distributed",
    "token_cross_entropy": "autosearch.engine._engine",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports("autosearch.engine", globals(), _EXPORTS)
