"""autosearch: find the fastest way to train a model on a cluster, then train with it.

Everything is exported lazily (PEP 562), so `import autosearch` stays light: the specs and the
cost model never import torch, and the Engine imports it only when used.
"""

from __future__ import annotations

from autosearch._lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "SpecError": "autosearch.core.errors",
    "ModelSpec": "autosearch.core.model_spec",
    "model_catalog": "autosearch.core.model_spec",
    "Strategy": "autosearch.core.strategy",
    "Cluster": "autosearch.core.hardware",
    "HardwareProfile": "autosearch.core.hardware",
    "CostReport": "autosearch.core.report",
    "AnalyticCostModel": "cost_models.analytic",
    "estimate": "cost_models.analytic",
    "RuntimeOptions": "autosearch.core.runtime",
    "tune": "autosearch.tuning._study",
    "TuneConfig": "autosearch.tuning._config",
    "TuneResult": "autosearch.tuning._result",
    "SweepConfig": "autosearch.tuning._sweep",
    "sweep": "autosearch.tuning._sweep",
    "Engine": "autosearch.autotune",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports("autosearch", globals(), _EXPORTS)
