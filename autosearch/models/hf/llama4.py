"""Hugging Face Llama 4 text causal LMs (``Llama4ForCausalLM``, model_type llama4_text) under
the Engine.

`Llama4CausalLM` is `HFCausalLM` (autosearch/models/hf/causal_lm.py: transformers' modules
taken over, layers in an ``nn.ModuleDict``, transformers' attention forward with the Engine's
attention core, the Llama tp plan on Llama 4's names). What differs from Llama:

* Every ``interleave_moe_layer_step``-th layer's ``feed_forward`` is a ``Llama4TextMoe``, which
  becomes `Llama4MoE`: the Engine's `MoE` with transformers' router (``feed_forward.router``:
  top-k of the logits, weights ``sigmoid(logit)``, not normalised), experts
  (``feed_forward.experts.gate_up_proj [E, d, 2f]``, gate columns first, ``down_proj [E, f,
  d]``) and shared expert (``feed_forward.shared_expert``), under those names. Llama 4 scales
  each routed token's input by its weight, not the expert's output (``experts(w * x)``:
  `MoE.weight_inputs`); transformers computes every expert on every token with weight 0 for
  the ones not chosen, which (no biases, ``silu(0) * 0 = 0``) adds exact zeros, so the dropless
  grouped GEMMs over the chosen rows compute the same sums. transformers' decoder layer unpacks
  ``(output, router logits)`` from its MoE, so each layer becomes `MLPOutputBlock` (causal_lm.py),
  the same block (names unchanged) calling its feed-forward for the output only. ``etp`` is
  refused (the gate and up columns share one matrix).
* Attention: the rope layers attend within chunks of ``attention_chunk_size`` tokens
  (``chunked_attention`` in ``layer_types``): `ChunkedAttentionCore` masks keys outside the
  query's chunk, by global positions (under cp over the whole sequence's keys, all-gathered:
  `ContextParallel.whole_keys`). The layers without rope (``no_rope_layers``) attend over
  everything with the Engine's `AttentionCore`. QK L2 norm is transformers' own (no weights).
* Attention temperature tuning (``attn_temperature_tuning``, the no-rope layers) scales the
  queries by ``1 + attn_scale * log1p(floor((position + 1) / floor_scale))``, and transformers
  reads the position from the local sequence: under cp, whose ranks hold chunks at other
  positions, it would scale by the wrong position as soon as the sequence reaches
  ``floor_scale`` tokens (8,192 in the released configs), so that case is refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from autosearch.core.errors import SpecError
from autosearch.models.hf.causal_lm import AttentionCore, HFCausalLM, MLPOutputBlock
from autosearch.models.moe import FusedExperts, MoE, _local, grouped_mm

if TYPE_CHECKING:  # pragma: no cover
    from autosearch.distributed.context_parallel import ContextParallel


class ChunkedAttentionCore(nn.Module):
    """Causal attention within chunks of `chunk` tokens (transformers' chunked causal mask:
    key and query in the same chunk, key not after the query), by SDPA with that mask."""

    context_parallel: "ContextParallel | None" = None  # set by the Engine under cp

    def __init__(self, num_key_value_groups: int, chunk: int):
        super().__init__()
        self.num_key_value_groups, self.chunk = num_key_value_groups, chunk

    def forward(self, query, key, value, attention_mask, **kwargs):
        if self.context_parallel is not None:
            key, value, q_pos, k_pos = self.context_parallel.whole_keys(key, value)
        else:
            q_pos = k_pos = torch.arange(query.shape[2], device=query.device)
        allowed = (k_pos[None, :] <= q_pos[:, None]) & (
            k_pos[None, :] // self.chunk == q_pos[:, None] // self.chunk
        )
        out = F.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=allowed,
            dropout_p=kwargs.get("dropout", 0.0) if self.training else 0.0,
            scale=kwargs.get("scaling"),
            enable_gqa=key.shape[1] != query.shape[1],
        )
        return out.transpose(1, 2).contiguous(), None


class Llama4Experts(FusedExperts):
    """transformers' ``Llama4TextExperts`` weights (``x @ gate_up_proj[e]``, gate columns then
    up columns; ``up * silu(gate) @ down_proj[e]``) on rows grouped by expert."""

    no_etp_reason = (
        "transformers' Llama 4 experts hold the gate and up columns in one matrix, which the "
        "Engine does not split over tp"
    )

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        gate_up, down = _local(self.gate_up_proj), _local(self.down_proj)
        gate, up = grouped_mm(x, gate_up, counts).chunk(2, dim=-1)
        return grouped_mm(up * F.silu(gate), down, counts)


class Llama4MoE(MoE):
    """The Engine's `MoE` with Llama 4's router, input-weighted experts and shared expert
    (module doc), under transformers' names."""

    weight_inputs = True

    def __init__(self, hf_moe: Any, *, dim: int):
        experts = hf_moe.experts
        super().__init__(
            dim=dim,
            hidden=experts.expert_dim,
            n_experts=experts.num_experts,
            top_k=hf_moe.top_k,
            aux_loss_coef=0.0,  # transformers' Llama 4 trains without a load-balancing loss
        )
        del self.gate
        self.router = hf_moe.router
        self.experts = Llama4Experts(experts.gate_up_proj, experts.down_proj)
        self.shared_expert = hf_moe.shared_expert

    def route(
        self, x: torch.Tensor, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.router.weight)  # Llama4Router is a Linear without bias
        top, experts = torch.topk(logits, self.top_k, dim=1)
        weights = torch.sigmoid(top.float()).to(logits.dtype)
        # the third value (probabilities) feeds only the Engine's balance loss, which is off
        return weights.to(dtype or x.dtype), experts, logits

    def add_shared(self, routed: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.shared_expert(x) + routed


class Llama4CausalLM(HFCausalLM):
    """A transformers ``Llama4ForCausalLM`` as the Engine runs it (module doc)."""

    model_types = ("llama4_text",)

    def _attention_core(self, attn: Any) -> nn.Module:
        if self.config.layer_types[attn.layer_idx] == "chunked_attention":
            return ChunkedAttentionCore(
                attn.num_key_value_groups, self.config.attention_chunk_size
            )
        return AttentionCore(attn.num_key_value_groups)

    def _use_moe(self) -> float:
        layers = self.model.layers
        for name, layer in list(layers.items()):
            if getattr(layer, "is_moe_layer", False):
                layer.feed_forward = Llama4MoE(layer.feed_forward, dim=self.config.hidden_size)
            layers[name] = MLPOutputBlock(layer, "feed_forward")
        return 0.0

    def sliding_window(self) -> int | None:
        return None  # chunks are masked by the attention core

    def _moe_blocks(self) -> dict[str, bool] | None:
        blocks = {n: isinstance(b.feed_forward, MoE) for n, b in self.model.layers.items()}
        return blocks if any(blocks.values()) else None

    def _tuned_layers(self) -> bool:
        """Whether some layer without rope scales its queries by position (module doc)."""
        config = self.config
        return bool(config.attn_temperature_tuning) and not all(config.no_rope_layers)

    def _check_strategy(self, strategy) -> list[str]:
        problems = super()._check_strategy(strategy)
        if strategy.cp > 1 and self._tuned_layers():
            if self.spec.seq_len >= self.config.floor_scale:
                problems.append(self._cp_tuning_problem(strategy.cp, self.spec.seq_len))
        return problems

    def _cp_tuning_problem(self, cp: int, seq_len: int) -> str:
        return (
            f"cp={cp} with Llama 4's attention temperature tuning at {seq_len} tokens: "
            "transformers scales the no-rope layers' queries by the position within the "
            f"rank's chunks, which differs from the sequence's once it reaches floor_scale="
            f"{self.config.floor_scale}; use cp=1, shorter sequences, or "
            "attn_temperature_tuning=false"
        )

    def forward(self, tokens: torch.Tensor, balance: torch.Tensor | None = None) -> Any:
        cp = self.context_parallel
        if cp is not None and self._tuned_layers() and self.model.embed_tokens is not None:
            whole = tokens.shape[1] * cp.cp  # the token ids of this rank's chunks
            if whole >= self.config.floor_scale:
                raise SpecError(self._cp_tuning_problem(cp.cp, whole))
        return super().forward(tokens, balance)

    def _adapt_tp_plan(self, plan: dict, *, sequence_parallel: bool) -> dict:
        """On Llama 4's names (``feed_forward`` for ``mlp``)."""
        return {key.replace(".mlp", ".feed_forward"): style for key, style in plan.items()}
