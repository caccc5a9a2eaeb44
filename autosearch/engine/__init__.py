"""The PyTorch runtime: `Engine` applies a Strategy with torch.distributed.

Exports are lazy (PEP 562): ``from autosearch.engine import Engine`` does not import torch; the
Engine imports it when first used. `SyntheticTokens`, `Accuracy` and `run_main` import torch.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Engine": "autosearch.engine._engine",
    "ParallelPlan": "autosearch.engine.plan",
    "ParallelDims": "autosearch.engine.parallel_dims",
    "DP_MODES": "autosearch.engine.parallel_dims",
    "SyntheticTokens": "autosearch.engine.data",
    "Metric": "autosearch.engine.metrics",
    "Accuracy": "autosearch.engine.metrics",
    "run_main": "autosearch.engine.distributed",
    "token_cross_entropy": "autosearch.engine._engine",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'autosearch.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
