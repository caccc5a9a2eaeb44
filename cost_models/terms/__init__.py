"""The cost model's mechanisms, one module each, as pure functions of a Strategy and a `Context`
(no self, no globals, no mutation): compute, tensor parallel, context parallel, pipeline, data
parallel and memory. Each term declares the Strategy fields it reads (``@reads(...)``, its
``READS``); `AnalyticCostModel` composes the terms into a CostReport and caches their results
keyed by exactly those fields.
"""

from cost_models.terms import (
    compute,
    context_parallel,
    data_parallel,
    memory,
    pipeline,
    tensor_parallel,
)
from cost_models.terms._base import ACT_BYTES, Context, LayerCosts, fields_read, reads

__all__ = [
    "ACT_BYTES",
    "Context",
    "LayerCosts",
    "compute",
    "context_parallel",
    "data_parallel",
    "fields_read",
    "memory",
    "pipeline",
    "reads",
    "tensor_parallel",
]
