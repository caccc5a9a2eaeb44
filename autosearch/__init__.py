"""autosearch: find the fastest way to train a model on a cluster, then train with it.

Everything is exported lazily (PEP 562), so `import autosearch` stays light: the specs and the
cost model never import torch, and the Engine imports it only when used.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "SpecError": "autosearch.errors",
    "ModelSpec": "autosearch.model_spec",
    "model_catalog": "autosearch.model_spec",
    "Strategy": "autosearch.strategy",
    "Cluster": "cost_models.hardware",
    "HardwareProfile": "cost_models.hardware",
    "CostReport": "cost_models.report",
    "AnalyticCostModel": "cost_models.analytic",
    "estimate": "cost_models.analytic",
    "RuntimeOptions": "cost_models.runtime",
    "tune": "autosearch.tuner",
    "TuneResult": "autosearch.tuner",
    "Engine": "autosearch.engine",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'autosearch' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
