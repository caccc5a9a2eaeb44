"""The Engine's `MoE` routed by a transformers router module kept as it is (DeepSeek-V2/V3's
group-limited routers, gpt-oss's router with a bias): routing is transformers' own, the experts
and the token dispatch the Engine's (expert parallelism, dropless grouped GEMMs)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from autosearch.models.moe import MoE


class RouterMoE(MoE):
    """`MoE` whose `route` calls `router`: ``router(x [T, d]) -> (router logits [T, E],
    weights [T, k], experts [T, k])``, the convention of DeepSeek's ``*TopkRouter`` and
    gpt-oss's ``GptOssTopKRouter``. The router is registered under `router_name` (transformers'
    name for it: ``gate`` or ``router``), in place of the `MoE`'s own linear gate.

    Args:
        router: transformers' router module of the sparse block.
        router_name: its attribute name in transformers' block.
        **moe: the `MoE` arguments. The Engine's per-sequence balance loss is off
            (``aux_loss_coef`` 0: the router gives no probabilities); a model-level loss
            (transformers' ``load_balancing_loss_func``) reads the logits recorded with
            ``record_router_logits``.
    """

    def __init__(self, *, router: nn.Module, router_name: str = "gate", **moe: Any):
        super().__init__(**{**moe, "aux_loss_coef": 0.0})
        del self.gate
        self.router_name = router_name
        self.add_module(router_name, router)

    def route(
        self, x: torch.Tensor, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits, weights, experts = getattr(self, self.router_name)(x)
        if self.record_router_logits:
            self.router_logits = logits
        # the third value (probabilities) feeds only the Engine's balance loss, which is off
        return weights.to(dtype or x.dtype), experts, logits
