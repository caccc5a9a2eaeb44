"""Qwen3-Next (transformers ``Qwen3NextForCausalLM``, model_type qwen3_next) under the Engine.

Transformers' modules are kept under their own names (`HFHybridCausalLM`, hybrid.py's pattern):
each ``Qwen3NextDecoderLayer`` has a pre-norm, a mixer (``linear_attn``: Gated DeltaNet, or
``self_attn``: gated attention) with a residual, then a pre-norm, an MLP (``mlp``: SwiGLU, or
``Qwen3NextSparseMoeBlock``: routed experts and a shared expert scaled by
sigmoid(``shared_expert_gate``)) and a residual. What the ModelSpec does not describe stays in
transformers' modules: the zero-centred RMSNorms (``Qwen3NextRMSNorm``: x * (1 + w)), the
per-head q/k norms, partial rotary (``partial_rotary_factor``, in transformers' rotary table and
``apply_rotary_pos_emb``), the gated shared expert.

When the wrapper takes the model over, each ``Qwen3NextGatedDeltaNet`` is replaced by
`autosearch.models.ssm.GatedDeltaNet` holding the same weights under the same names
(``model.layers.0.linear_attn.in_proj_qkvz.weight``), its conv channels re-laid by key head so
that tensor parallel gives each rank whole heads (`GatedDeltaNet.from_transformers`); it
computes transformers' torch path (tests/test_ssm.py). `hf_model` (``Engine.save_pretrained``)
lays them back. Each attention layer gets an attention core (transformers' SDPA through
`AttentionCore`) that selective recompute checkpoints; the output gate is transformers' own
code in ``Qwen3NextAttention.forward``: q_proj's rows are per head (query, gate), so tensor
parallel's column split by heads keeps each head's gate with it.

What runs: dp, ZeRO 1-3 (FSDP2), pp, full and selective recompute; tensor parallel (+ sequence
parallel) where every MLP is dense. Refused with the reason: context parallel (the Gated
DeltaNet state passes along the sequence, as the cost model says), expert parallel and tensor
parallel of the MoE layers (transformers' ``Qwen3NextSparseMoeBlock``, whose experts are one
parameter each). Qwen3.5 (qwen3_5_text, qwen3_5_moe_text) is not taken: its Gated DeltaNet has
separate in_proj_qkv / in_proj_z / in_proj_b / in_proj_a projections (not Qwen3-Next's packed
rows) and its text rotary is multimodal (M-RoPE), so it needs its own layout.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from torch import nn

from autosearch.distributed.plan import ParallelPlan
from autosearch.models.hf.causal_lm import _sequence_shards
from autosearch.models.hf.hybrid import HFHybridCausalLM
from autosearch.models.ssm import GatedDeltaNet, ssm_tp_plan


class Qwen3NextCausalLM(HFHybridCausalLM):
    """A transformers ``Qwen3NextForCausalLM`` as the Engine runs it (module doc).

    Args:
        hf_model: the causal LM (random or pretrained); its modules are taken over, not copied.
        seq_len: training sequence length for the ModelSpec (default the config's
            ``max_position_embeddings``).
    """

    model_types = ("qwen3_next",)
    embedding = "embed_tokens"
    final_norm = "norm"
    attention = "self_attn"

    @staticmethod
    def is_attention(layer: nn.Module) -> bool:
        return layer.block_type == "full_attention"

    def __init__(self, hf_model: nn.Module, *, seq_len: int | None = None):
        super().__init__(hf_model, seq_len=seq_len)
        gdn = self.spec.gdn
        for layer in self.model.layers.values():
            if layer.block_type == "linear_attention" and gdn is not None:
                layer.linear_attn = _as_gated_delta_net(
                    layer.linear_attn, gdn, self.config.hidden_size, self.config.rms_norm_eps
                )

    def _gdn_layers(self) -> list[str]:
        return [
            n
            for n, b in self.model.layers.items()
            if isinstance(getattr(b, "linear_attn", None), GatedDeltaNet)
        ]

    def _moe_layers(self) -> list[str]:
        return [n for n, b in self.model.layers.items() if hasattr(b.mlp, "experts")]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """Logits (batch, seq, vocab) of token ids (batch, seq); a pipeline stage maps hidden
        states to hidden states. Causal attention without a mask (`AttentionCore`), no cache."""
        m = self.model
        layers = list(m.layers.values())
        if m.embed_tokens is not None:
            seq = tokens.shape[1]
            h = m.embed_tokens(tokens)
        else:  # a later stage: under sequence parallel its input is this rank's shard
            h = tokens
            norm = layers[0].input_layernorm if layers else m.norm
            seq = h.shape[1] * (_sequence_shards(norm) if norm is not None else 1)
        positions = torch.arange(seq, device=h.device).unsqueeze(0)
        position_embeddings = m.rotary_emb(h, positions)  # partial rotary: transformers' table
        for layer in layers:
            h = layer(h, position_embeddings=position_embeddings)
        if m.norm is not None:
            h = m.norm(h)
        if self.lm_head is not None:
            h = self.lm_head(h)
        return h

    @torch.no_grad()
    def init_weights(self) -> None:
        """transformers' init (zero-centred norms at 0, normal projections and experts); the
        Gated DeltaNet mixers (ours) as `GatedDeltaNet.init_ssm` does."""
        super().init_weights()
        for module in self.modules():
            if isinstance(module, GatedDeltaNet):
                module.init_ssm()

    def parallel_plan(self) -> ParallelPlan:
        return dataclasses.replace(
            super().parallel_plan(),
            tp_plan=functools.partial(self.qwen3_next_tp_plan, gdn=tuple(self._gdn_layers())),
        )

    @staticmethod
    def qwen3_next_tp_plan(
        *, sequence_parallel: bool, loss_parallel: bool, gdn: tuple[str, ...] = ()
    ) -> dict:
        """Megatron's split on transformers' names: q_proj (each head's query and gate rows),
        k_proj, v_proj column-wise and o_proj row-wise, the per-head q/k norms on this rank's
        heads (a replicated weight whose gradient is summed over tp, as Qwen3's), the dense
        MLPs' gate/up column-wise and down row-wise, each Gated DeltaNet by key heads
        (`ssm_tp_plan`); embeddings by vocabulary rows, lm_head by vocabulary columns; with
        sequence parallel the norms on the ranks' shards and each mixer's and MLP's input
        gathered."""
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            PrepareModuleInput,
            RowwiseParallel,
            SequenceParallel,
        )

        act = Shard(1) if sequence_parallel else Replicate()
        layer = "model.layers.*."
        plan: dict = {
            "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=act),
            "lm_head": ColwiseParallel(
                input_layouts=act,
                output_layouts=Shard(-1) if loss_parallel else Replicate(),
                use_local_output=not loss_parallel,
            ),
            layer + "self_attn.q_proj": ColwiseParallel(),
            layer + "self_attn.k_proj": ColwiseParallel(),
            layer + "self_attn.v_proj": ColwiseParallel(),
            layer + "self_attn.o_proj": RowwiseParallel(output_layouts=act),
            layer + "self_attn.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
            layer + "self_attn.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
            layer + "mlp.gate_proj": ColwiseParallel(),
            layer + "mlp.up_proj": ColwiseParallel(),
            layer + "mlp.down_proj": RowwiseParallel(output_layouts=act),
        }
        if sequence_parallel:
            plan["model.norm"] = SequenceParallel()
            plan[layer + "input_layernorm"] = SequenceParallel()
            plan[layer + "post_attention_layernorm"] = SequenceParallel()
            plan[layer + "self_attn"] = PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": Shard(1)},
                desired_input_kwarg_layouts={"hidden_states": Replicate()},
            )
            plan[layer + "mlp"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            )
        for name in gdn:  # its own style gathers its input under sp
            plan.update(
                ssm_tp_plan(
                    f"model.layers.{name}.linear_attn", "gdn", sequence_parallel=sequence_parallel
                )
            )
        return plan

    def _check_strategy(self, strategy) -> list[str]:
        problems = super()._check_strategy(strategy)
        if strategy.tp > 1 and self._moe_layers():
            problems.append(
                f"tp={strategy.tp}: Qwen3-Next's MoE layers run transformers' "
                "Qwen3NextSparseMoeBlock, which has no tensor-parallel plan here; use tp=1 "
                "(dp, zero, pp), or a config whose MLPs are all dense (num_experts 0)"
            )
        return problems

    def hf_model(self, state_dict: dict[str, torch.Tensor] | None = None) -> Any:
        """transformers' model holding `state_dict` (or this module's weights), the Gated
        DeltaNet rows laid back in transformers' order."""
        state = dict(state_dict if state_dict is not None else self.state_dict())
        for name in self._gdn_layers():
            mixer = self.model.layers[name].linear_attn
            prefix = f"model.layers.{name}.linear_attn."
            own = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
            state.update({prefix + k: v for k, v in mixer.to_transformers(own).items()})
        return super().hf_model(state)


def _as_gated_delta_net(theirs: Any, spec, hidden: int, eps: float) -> GatedDeltaNet:
    """`GatedDeltaNet` holding the weights of transformers' ``Qwen3NextGatedDeltaNet``
    `theirs` (re-laid by key head), on its device (the meta device too). Its SiLU is the
    only activation `ModelSpec.from_hf_config` reads for Qwen3-Next (hidden_act)."""
    with torch.device(theirs.A_log.device):
        ours = GatedDeltaNet(spec, hidden, eps=eps)
    ours.load_state_dict(ours.from_transformers(theirs.state_dict()), assign=True)
    return ours
