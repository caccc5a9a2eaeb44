"""`EstimateConfig`: the settings of `autosearch estimate`, declared once.

The flags of ``autosearch estimate`` and the keys of its ``--config`` file derive from these
fields (`autosearch.commands._schema`). A field that is a setting of a tuning job too (the
model, the cluster, the sequence length, LoRA, the runtime, the memory margin) takes
`TuneConfig`'s `Setting` whole, so its help text and its checks are written once.

Example:
    >>> from autosearch.tuning._estimate import EstimateConfig
    >>> EstimateConfig(model="llama3-8b", cluster="h100-sxm:1x8", strategy="dp=8").runtime is None
    True
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autosearch.core.schema import Schema, lora_of, read_batch, read_text, setting
from autosearch.tuning._config import TuneConfig

if TYPE_CHECKING:  # pragma: no cover
    from autosearch.core.hardware import Cluster
    from autosearch.core.model_spec import ModelSpec


def as_in_tune(name: str, default: Any = dataclasses.MISSING) -> Any:
    """A field read, checked and explained as `TuneConfig`'s field `name` (one help text)."""
    return dataclasses.field(
        default=default, metadata=TuneConfig.__dataclass_fields__[name].metadata
    )


@dataclass(frozen=True, kw_only=True)
class EstimateConfig(Schema):
    """One strategy of one model on one cluster, for the cost model. A frozen record."""

    model: "ModelSpec | dict | str" = as_in_tune("model")
    seq_len: int | None = as_in_tune("seq_len", None)
    lora_rank: int | None = as_in_tune("lora_rank", None)
    lora_targets: str | None = as_in_tune("lora_targets", None)
    cluster: "Cluster | dict | str" = as_in_tune("cluster")
    nnodes: int | None = as_in_tune("nnodes", None)
    gpus_per_node: int | None = as_in_tune("gpus_per_node", None)
    runtime: str | None = as_in_tune("runtime", None)
    strategy: str = setting(
        read=read_text,
        help='a strategy YAML file (naming dp, tp and pp), or "dp=8,tp=8,pp=4,micro_batch_size=1,'
        'global_batch_size=512,..." (degrees not named are 1; required, here or in the config '
        "file)",
    )
    global_batch_size: int | None = setting(
        None,
        read=read_batch,
        help="sequences per optimizer step, if the strategy does not give global_batch_size",
    )
    memory_margin: float | None = as_in_tune("memory_margin", None)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.lora()  # targets without a rank are refused

    def lora(self) -> dict[str, Any] | None:
        """The ``lora`` of `ModelSpec.load` these settings give (None: the model's own)."""
        return lora_of(self.lora_rank, self.lora_targets, where="lora_targets")
