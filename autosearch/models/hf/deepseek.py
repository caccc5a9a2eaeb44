"""Hugging Face DeepSeek-V2 and DeepSeek-V3 causal LMs under the Engine.

`DeepseekCausalLM` is `HFCausalLM` (autosearch/models/hf/causal_lm.py: transformers' modules
taken over, layers in an ``nn.ModuleDict``, an attention core per layer registered in
transformers' `AttentionInterface`, pipeline stages that skip removed modules) for
``DeepseekV2ForCausalLM`` and ``DeepseekV3ForCausalLM``. What differs from Llama:

* Multi-head latent attention (MLA; DeepSeek-V2, DeepSeek-AI 2024, eqs. 9-19): queries through a
  low-rank ``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj`` (or one ``q_proj`` without
  ``q_lora_rank``), keys and values through ``kv_a_proj_with_mqa`` (the latent plus one rotary
  key shared by all heads) -> ``kv_a_layernorm`` -> ``kv_b_proj``. transformers' own forward
  runs; its attention kernel is the layer's core, so selective recompute and context parallel
  work as for Llama (cp: the core attends over the whole sequence, the rotary angles are those
  of the global positions).
* Tensor parallel splits heads, as Megatron-Core's ``MLASelfAttention`` and torchtitan's
  DeepSeek-V3 plan: ``q_b_proj`` / ``q_proj`` and ``kv_b_proj`` column-wise (each rank's rows
  are whole heads: ``[heads, qk_head_dim]`` and ``[heads, qk_nope + v_head_dim]``), ``o_proj``
  row-wise; the down projections and their norms replicated. A replicated module's gradient is
  the sum over the tp ranks' heads: the latents reach the heads through the column-parallel
  ``q_b_proj`` / ``kv_b_proj``, whose input gradient DTensor sums over tp, but the shared
  rotary key goes to this rank's heads directly, so its gradient is summed over tp explicitly
  (`SharedRopeKey`; Megatron-Core's ``copy_to_tensor_model_parallel_region`` on it). Under
  sequence parallel the attention gathers its input as a plain tensor (every path's gradient
  is then whole on every rank, and the backward keeps this rank's shard).
* Mixture of experts: each ``DeepseekV2Moe`` / ``DeepseekV3MoE`` becomes `RouterMoE`, the
  Engine's `MoE` (fused SwiGLU experts ``mlp.experts.gate_up_proj`` / ``down_proj`` that expert
  parallelism shards, the shared experts ``mlp.shared_experts.*`` every token goes through)
  routed by transformers' own router module (``mlp.gate``: V2's softmax greedy or
  group-limited greedy top-k, V3's sigmoid scores with ``e_score_correction_bias`` and
  group-limited top-k over ``n_group`` / ``topk_group``, ``norm_topk_prob`` and
  ``routed_scaling_factor``), so routing is transformers' exactly. The first
  ``first_k_dense_replace`` layers keep their dense MLP (split as Llama's under tp).
  transformers trains DeepSeek without a load-balancing loss and never updates
  ``e_score_correction_bias`` (DeepSeek-V3's auxiliary-loss-free bias update, tech report
  sec. 2.1.2, is not in transformers), and neither does the Engine: the bias is a buffer,
  replicated, kept in checkpoints.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle

from autosearch.models.hf.causal_lm import HFCausalLM
from autosearch.models.hf.router_moe import RouterMoE
from autosearch.models.hf.tp_plans import gather_input
from autosearch.models.moe import FusedExperts


class _SumGradOverGroup(torch.autograd.Function):
    """Identity on `x` whose backward sums the gradient of its last-dim columns ``[start:]``
    over `group` (Megatron-LM's ``copy_to_tensor_model_parallel_region``, on those columns)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, start: int, group) -> torch.Tensor:
        ctx.start, ctx.group = start, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rope = grad[..., ctx.start :].contiguous()
        dist.all_reduce(rope, group=ctx.group)
        return torch.cat([grad[..., : ctx.start], rope], dim=-1), None, None


class SharedRopeKey(ParallelStyle):
    """Tensor-parallel style of ``kv_a_proj_with_mqa`` (replicated): its output's rotary-key
    columns (after the `kv_lora_rank` latent ones) feed every head, this rank's only under tp,
    so their gradient is summed over tp (module doc)."""

    def __init__(self, kv_lora_rank: int):
        self.kv_lora_rank = kv_lora_rank

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        group, start = device_mesh.get_group(), self.kv_lora_rank
        module.register_forward_hook(
            lambda _module, _inputs, out: _SumGradOverGroup.apply(out, start, group)
        )
        return module


class DeepseekCausalLM(HFCausalLM):
    """A transformers ``DeepseekV2ForCausalLM`` or ``DeepseekV3ForCausalLM`` as the Engine runs
    it (module doc)."""

    model_types = ("deepseek_v2", "deepseek_v3")

    def _use_moe(self) -> float:
        config = self.config
        for layer in self.model.layers.values():
            block = layer.mlp
            if not hasattr(block, "experts"):  # the first first_k_dense_replace layers
                continue
            hf_experts = block.experts
            moe = RouterMoE(
                router=block.gate,
                dim=config.hidden_size,
                hidden=hf_experts.intermediate_dim,
                n_experts=hf_experts.num_experts,
                top_k=config.num_experts_per_tok,
            )
            moe.experts = FusedExperts(hf_experts.gate_up_proj, hf_experts.down_proj)
            moe.shared_experts = block.shared_experts
            layer.mlp = moe
        return 0.0  # transformers' DeepSeek trains without a load-balancing loss

    def sliding_window(self) -> int | None:
        return None

    def _adapt_tp_plan(self, plan: dict, *, sequence_parallel: bool) -> dict:
        """MLA's split (module doc): ``q_b_proj`` and ``kv_b_proj`` column-wise,
        ``kv_a_proj_with_mqa`` with `SharedRopeKey`, the other down projections and norms
        replicated, the attention input gathered as a plain tensor under sequence parallel."""
        layer = "model.layers.*.self_attn."
        for name in ("k_proj", "v_proj", "q_norm", "k_norm"):  # Llama's and Qwen3's names
            plan.pop(layer + name)
        plan[layer + "q_b_proj"] = ColwiseParallel()
        plan[layer + "kv_b_proj"] = ColwiseParallel()
        plan[layer + "kv_a_proj_with_mqa"] = SharedRopeKey(self.config.kv_lora_rank)
        if sequence_parallel:
            plan["model.layers.*.self_attn"] = gather_input(by_keyword=True, use_local_output=True)
        return plan
