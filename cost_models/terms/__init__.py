"""The cost model's mechanisms, one module each, as pure functions of a Strategy and a `Context`
(no self, no globals, no mutation): compute, tensor parallel, context parallel, pipeline, data
parallel, memory and offload to host memory. Each term declares the Strategy fields it reads
(``@reads(...)``, its ``READS``); `AnalyticCostModel` composes the terms into a CostReport and
caches their results keyed by exactly those fields.

A model is a sequence of blocks (`layers`): the base block (attention + dense MLP) is priced by
compute, tensor and context parallel and memory; each other kind of block by the module `KINDS`
names, as what it adds to the base.
"""

from typing import Callable

from cost_models.terms import (
    compute,
    context_parallel,
    data_parallel,
    experts,
    layers,
    memory,
    offload,
    pipeline,
    ssm,
    tensor_parallel,
)
from cost_models.terms._base import ACT_BYTES, Context, LayerCosts, fields_read, reads

# a part of a block that differs from the base (`layers.parts`) -> what prices it
# (`layers.KindCosts` from its `costs`)
KINDS: "dict[tuple[str, str], Callable[..., layers.KindTerm]]" = {
    ("mlp", "moe"): experts.MoELayers,
    ("mixer", "mamba"): ssm.MambaMixers,
    ("mixer", "gdn"): ssm.GatedDeltaNetMixers,
    ("mixer", "attention+mamba"): ssm.ParallelMambaMixers,
    ("mixer", "mamba1"): ssm.Mamba1Mixers,
    ("mixer", "none"): ssm.NoMixer,
    ("mlp", "none"): ssm.NoMLP,
}

__all__ = [
    "ACT_BYTES",
    "KINDS",
    "Context",
    "LayerCosts",
    "compute",
    "context_parallel",
    "data_parallel",
    "experts",
    "fields_read",
    "layers",
    "memory",
    "offload",
    "pipeline",
    "reads",
    "ssm",
    "tensor_parallel",
]
