"""Hugging Face Qwen2-MoE causal LMs under the Engine.

`Qwen2MoeCausalLM` is `HFCausalLM` (autosearch/models/hf/causal_lm.py: transformers' modules
taken over, layers in an ``nn.ModuleDict``, an attention core per layer, the Llama tp plan; the
q/k/v biases are split with their columns) with each sparse block
(``Qwen2MoeSparseMoeBlock``) replaced by `GatedSharedMoE`: the Engine's `MoE` (softmax top-k
router, ``norm_topk_prob``, fused SwiGLU experts that expert parallelism shards) plus Qwen2-MoE's
shared expert scaled by a sigmoid gate, ``sigmoid(shared_expert_gate(x)) * shared_expert(x)``
(transformers' ``Qwen2MoeSparseMoeBlock.forward``), all under transformers' parameter names
(``mlp.gate.weight``, ``mlp.experts.gate_up_proj``, ``mlp.shared_expert.up_proj.weight``,
``mlp.shared_expert_gate.weight``). The shared expert and its gate are replicated over tp and ep
and run on the tokens each rank routes; their gradients are summed over tp as the router's
(`autosearch.models.moe.reduce_moe_grads`). With ``output_router_logits`` the model trains with
transformers' load-balancing loss (``router_aux_loss_coef``), as Mixtral does here.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from autosearch.models.hf.causal_lm import HFCausalLM, swap_sparse_blocks
from autosearch.models.moe import MoE


class GatedSharedMoE(MoE):
    """The Engine's `MoE` with Qwen2-MoE's gated shared expert (module doc).

    Args:
        shared_expert: transformers' ``Qwen2MoeMLP`` every token goes through.
        shared_expert_gate: its gate, a ``Linear(hidden, 1)``.
        **moe: the `MoE` arguments (without ``shared_hidden``).
    """

    def __init__(self, *, shared_expert: nn.Module, shared_expert_gate: nn.Module, **moe: Any):
        super().__init__(**moe)
        self.shared_expert = shared_expert
        self.shared_expert_gate = shared_expert_gate

    def add_shared(self, routed: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return routed + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


def use_gated_shared_moe(model: HFCausalLM) -> float:
    """Each sparse block of Qwen2-MoE or Qwen3-Next (transformers' router, experts and gated
    shared expert are the same code in both) as a `GatedSharedMoE` under the same names
    (`swap_sparse_blocks`); transformers' auxiliary-loss coefficient."""
    return swap_sparse_blocks(
        model, GatedSharedMoE, shared=("shared_expert", "shared_expert_gate")
    )


class Qwen2MoeCausalLM(HFCausalLM):
    """A transformers ``Qwen2MoeForCausalLM`` as the Engine runs it (module doc)."""

    model_types = ("qwen2_moe",)

    def _use_moe(self) -> float:
        return use_gated_shared_moe(self)

    def sliding_window(self) -> int | None:
        """Qwen2-MoE slides only with ``use_sliding_window`` (as Qwen2)."""
        if not getattr(self.config, "use_sliding_window", False):
            return None
        return self.config.sliding_window
