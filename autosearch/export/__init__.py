"""Strategies out to the runtimes people already use: Megatron-LM, DeepSpeed, torchtitan.

Example:
    >>> from autosearch import Strategy
    >>> from autosearch.export import export
    >>> out = export(Strategy(dp=4, tp=8, pp=2, global_batch_size=64, sequence_parallel=True), to="megatron")
    >>> "--tensor-model-parallel-size 8" in out.text
    True
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autosearch.core.errors import SpecError
from autosearch.export._base import Exported, Exporter
from autosearch.export._deepspeed import DeepSpeedExporter
from autosearch.export._megatron import MegatronExporter
from autosearch.export._torchtitan import TorchTitanExporter

if TYPE_CHECKING:  # pragma: no cover
    from autosearch.core.model_spec import ModelSpec
    from autosearch.core.strategy import Strategy

EXPORTERS: dict[str, Exporter] = {
    e.name: e for e in (MegatronExporter(), DeepSpeedExporter(), TorchTitanExporter())
}


def export(strategy: "Strategy", *, to: str, model: "ModelSpec | None" = None) -> Exported:
    """`strategy` in the words of runtime `to` (``megatron``, ``deepspeed`` or ``torchtitan``)."""
    try:
        exporter = EXPORTERS[to.lower()]
    except KeyError:
        raise SpecError(
            f"unknown runtime {to!r} to export to; choose one of {', '.join(EXPORTERS)}"
        ) from None
    return exporter.export(strategy, model=model)


__all__ = [
    "EXPORTERS",
    "DeepSpeedExporter",
    "Exported",
    "Exporter",
    "MegatronExporter",
    "TorchTitanExporter",
    "export",
]
