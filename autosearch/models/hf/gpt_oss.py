"""Hugging Face gpt-oss causal LMs under the Engine.

`GptOssCausalLM` is `HFCausalLM` (autosearch/models/hf/causal_lm.py: transformers' modules
taken over, layers in an ``nn.ModuleDict``, the Llama tp plan with its q/k/v/o biases split with
their rows and columns) for ``GptOssForCausalLM``. What differs from Llama:

* Attention sinks: each head has a learned logit (``self_attn.sinks``) that joins the softmax
  over the keys and is dropped after it (transformers' gpt-oss ``eager_attention_forward``, the
  only kernel of transformers' own that computes them on CPU). `SinkAttentionCore` computes
  exactly that, with the causal mask and, on the ``sliding_attention`` layers (every other
  layer), the window ``query - key < sliding_window``, so sequences longer than the window
  train as transformers trains them. Under tp the sinks are sharded with the heads
  (`ShardedSinks`: a DTensor ``Shard(0)`` of ``sinks`` on the tp mesh). Under cp the core
  attends over the whole sequence's keys, all-gathered with their global positions
  (`autosearch.distributed.context_parallel.ContextParallel.whole_keys`), on any device: torch's
  CUDA ring attention has no sinks, so the CUDA path too is this exact all-gather attention.
  The core is a module, so selective recompute checkpoints it.
* Mixture of experts: each ``GptOssMLP`` becomes a `RouterMoE` routed by transformers' own
  ``GptOssTopKRouter`` (``mlp.router``: a linear with a bias, top-k of the logits, softmax over
  those k), with `GptOssExperts`: transformers' experts (``gate_up_proj [E, d, 2f]`` with the
  gate and up columns interleaved, their biases, ``down_proj [E, f, d]`` and its bias) computed
  as transformers does (clamped gate and up, ``(up + 1) * gate * sigmoid(alpha * gate)``) on
  the rows each expert receives, so expert parallelism shards all four on the expert dim.
  ``etp`` is refused: the down projection's bias would be added once per etp rank.
  transformers' decoder layer unpacks ``(output, router scores)`` from its MLP, so each layer
  becomes `MLPOutputBlock` (causal_lm.py), the same block (names unchanged) calling the MLP for
  its output only.
  With ``output_router_logits`` the model trains with transformers' load-balancing loss on the
  router's logits (``router_aux_loss_coef``), as Mixtral does here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from autosearch.models import attention
from autosearch.models.hf.causal_lm import HFCausalLM, MLPOutputBlock
from autosearch.models.hf.router_moe import RouterMoE
from autosearch.models.moe import FusedExperts, _local, grouped_mm

if TYPE_CHECKING:  # pragma: no cover
    from autosearch.distributed.context_parallel import ContextParallel


class SinkAttentionCore(nn.Module):
    """softmax over [QK^T * scaling, sink] without the sink's column, times V: transformers'
    gpt-oss ``eager_attention_forward`` (module doc), with the causal and sliding-window masks
    of the keys' global positions."""

    context_parallel: "ContextParallel | None" = None  # set by the Engine under cp

    def __init__(self, num_key_value_groups: int):
        super().__init__()
        self.num_key_value_groups = num_key_value_groups

    def forward(self, query, key, value, attention_mask, **kwargs):
        from torch.distributed.tensor import DTensor

        sinks = kwargs["s_aux"]
        if isinstance(sinks, DTensor):  # this tp rank's heads' sinks
            sinks = sinks.to_local()
        key, value, q_pos, k_pos = attention.positions(
            key, value, query.shape[2], self.context_parallel
        )
        out = attention.masked_attention(
            query,
            key,
            value,
            attention.visible(q_pos, k_pos, kwargs.get("sliding_window")),
            scaling=kwargs["scaling"],
            sinks=sinks,
            dropout_p=kwargs.get("dropout", 0.0) if self.training else 0.0,
        )
        return out.transpose(1, 2).contiguous(), None


class ShardedSinks(ParallelStyle):
    """Tensor-parallel style of a gpt-oss attention layer: its per-head ``sinks`` sharded with
    the heads (dim 0) over tp, then `then` (the input style under sequence parallel) if any."""

    def __init__(self, then: ParallelStyle | None = None):
        self.then = then

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        from torch.distributed.tensor import Shard, distribute_tensor

        sinks: Any = module.sinks
        sharded = distribute_tensor(sinks.detach(), device_mesh, [Shard(0)])
        module.sinks = nn.Parameter(sharded, requires_grad=sinks.requires_grad)
        return self.then._apply(module, device_mesh) if self.then is not None else module


class GptOssExperts(FusedExperts):
    """transformers' ``GptOssExperts`` weights on rows grouped by expert (module doc)."""

    weight_names = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
    no_etp_reason = (
        "gpt-oss's experts add a bias after the down projection, which the partial sums of "
        "an expert split over etp ranks would add once per rank"
    )

    def __init__(self, hf_experts: Any):
        super().__init__(hf_experts.gate_up_proj, hf_experts.down_proj)
        self.gate_up_proj_bias = hf_experts.gate_up_proj_bias
        self.down_proj_bias = hf_experts.down_proj_bias
        self.alpha, self.limit = hf_experts.alpha, hf_experts.limit

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        gate_up, gate_up_bias, down, down_bias = (
            _local(getattr(self, name)) for name in self.weight_names
        )
        expert = torch.repeat_interleave(torch.arange(len(counts), device=x.device), counts)
        h = grouped_mm(x, gate_up, counts) + gate_up_bias[expert]
        gate, up = h[..., ::2], h[..., 1::2]
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        h = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        return grouped_mm(h, down, counts) + down_bias[expert]


class GptOssCausalLM(HFCausalLM):
    """A transformers ``GptOssForCausalLM`` as the Engine runs it (module doc)."""

    model_types = ("gpt_oss",)
    hf_attn_implementation = "eager"  # transformers' gpt-oss has no SDPA path (sinks)

    def _attention_core(self, attn: Any) -> nn.Module:
        return SinkAttentionCore(attn.num_key_value_groups)

    def _use_moe(self) -> float:
        config = self.config
        layers = self.model.layers
        for name, layer in list(layers.items()):
            block = layer.mlp
            moe = RouterMoE(
                router=block.router,
                router_name="router",
                dim=config.hidden_size,
                hidden=config.intermediate_size,
                n_experts=config.num_local_experts,
                top_k=config.num_experts_per_tok,
            )
            moe.experts = GptOssExperts(block.experts)
            moe.record_router_logits = bool(config.output_router_logits)
            layer.mlp = moe
            layers[name] = MLPOutputBlock(layer, "mlp")
        return float(config.router_aux_loss_coef) if config.output_router_logits else 0.0

    def sliding_window(self) -> int | None:
        return None  # the attention core applies each layer's window itself

    @torch.no_grad()
    def init_weights(self) -> None:
        """`HFCausalLM.init_weights`, and transformers' gpt-oss init of what it no longer
        recognises: normal(0, initializer_range) expert weights, zero expert biases."""
        super().init_weights()  # the experts' weights too (`init_moe`)
        for module in self.modules():
            if isinstance(module, GptOssExperts):
                module.gate_up_proj_bias.zero_()
                module.down_proj_bias.zero_()

    def _adapt_tp_plan(self, plan: dict, *, sequence_parallel: bool) -> dict:
        """The sinks sharded with the heads (`ShardedSinks`)."""
        attn = "model.layers.*.self_attn"
        plan[attn] = ShardedSinks(plan.get(attn))
        return plan
