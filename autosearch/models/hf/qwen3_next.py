"""Qwen3-Next (transformers ``Qwen3NextForCausalLM``, model_type qwen3_next) under the Engine.

Transformers' modules are kept under their own names (`HFHybridCausalLM`, hybrid.py's pattern):
each ``Qwen3NextDecoderLayer`` has a pre-norm, a mixer (``linear_attn``: Gated DeltaNet, or
``self_attn``: gated attention) with a residual, then a pre-norm, an MLP (``mlp``: SwiGLU, or
``Qwen3NextSparseMoeBlock``: routed experts and a shared expert scaled by
sigmoid(``shared_expert_gate``)) and a residual. What the ModelSpec does not describe stays in
transformers' modules: the zero-centred RMSNorms (``Qwen3NextRMSNorm``: x * (1 + w)), the
per-head q/k norms, partial rotary (``partial_rotary_factor``, in transformers' rotary table and
``apply_rotary_pos_emb``); the shared expert's gate is transformers' Linear inside ours.

When the wrapper takes the model over, each ``Qwen3NextGatedDeltaNet`` is replaced by
`autosearch.models.ssm.GatedDeltaNet` holding the same weights under the same names
(``model.layers.0.linear_attn.in_proj_qkvz.weight``), its conv channels re-laid by key head so
that tensor parallel gives each rank whole heads (`GatedDeltaNet.from_transformers`); it
computes transformers' torch path (tests/test_ssm.py). `hf_model` (``Engine.save_pretrained``)
lays them back. Each attention layer gets an attention core (transformers' SDPA through
`AttentionCore`) that selective recompute checkpoints; the output gate is transformers' own
code in ``Qwen3NextAttention.forward``: q_proj's rows are per head (query, gate), so tensor
parallel's column split by heads keeps each head's gate with it.

Each ``Qwen3NextSparseMoeBlock`` becomes the Engine's MoE with the gated shared expert
(`autosearch.models.hf.qwen2_moe.GatedSharedMoE`: transformers' Qwen3-Next router, experts and
shared expert are Qwen2-MoE's code), under transformers' names (``mlp.gate.weight``,
``mlp.experts.gate_up_proj``, ``mlp.shared_expert_gate.weight``), which expert parallelism
shards.

What runs: dp, ZeRO 1-3 (FSDP2), pp, full and selective recompute, tensor parallel (+ sequence
parallel; the MoE layers route each tp rank's tokens), expert parallel. Refused with the reason:
context parallel (the Gated DeltaNet state passes along the sequence, as the cost model says),
a tp that does not divide the Gated DeltaNet key heads, ``output_router_logits`` (transformers'
load-balancing loss is not added; Qwen3NextConfig's default is off). Qwen3.5 (qwen3_5_text,
qwen3_5_moe_text) is not taken: its Gated DeltaNet has separate in_proj_qkv / in_proj_z /
in_proj_b / in_proj_a projections (not Qwen3-Next's packed rows) and its text rotary is
multimodal (M-RoPE), so it needs its own layout.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from torch import nn

from autosearch.core.errors import SpecError
from autosearch.distributed.plan import ParallelPlan
from autosearch.models.hf.causal_lm import HFCausalLM
from autosearch.models.hf.hybrid import HFHybridCausalLM
from autosearch.models.hf.qwen2_moe import use_gated_shared_moe
from autosearch.models.ssm import GatedDeltaNet, ssm_strategy_problems, ssm_tp_plan


class Qwen3NextCausalLM(HFHybridCausalLM):
    """A transformers ``Qwen3NextForCausalLM`` as the Engine runs it (module doc).

    Args:
        hf_model: the causal LM (random or pretrained); its modules are taken over, not copied.
        seq_len: training sequence length for the ModelSpec (default the config's
            ``max_position_embeddings``).
    """

    model_types = ("qwen3_next",)
    ssm = "linear_attn"

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
        self._use_gated_shared_moe()
        self._count_moe_layers()

    def _use_gated_shared_moe(self) -> None:
        """Each ``Qwen3NextSparseMoeBlock`` becomes the Engine's MoE with the gated shared
        expert (`autosearch.models.hf.qwen2_moe.GatedSharedMoE`: transformers' router, experts
        and shared expert are Qwen2-MoE's, the same code), under the same names."""
        config = self.config
        if getattr(config, "output_router_logits", False):
            raise SpecError(
                "output_router_logits true: the Engine trains Qwen3-Next without transformers' "
                "load-balancing loss (Qwen3NextConfig's default is false); set "
                "config.output_router_logits = False"
            )
        use_gated_shared_moe(self)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """Logits (batch, seq, vocab) of token ids (batch, seq); a pipeline stage maps hidden
        states to hidden states. Causal attention without a mask (`AttentionCore`), no cache."""
        m = self.model
        h, seq = self._stage_input(tokens)
        positions = torch.arange(seq, device=h.device).unsqueeze(0)
        position_embeddings = m.rotary_emb(h, positions)  # partial rotary: transformers' table
        for layer in m.layers.values():
            h = layer(h, position_embeddings=position_embeddings)
        if m.norm is not None:
            h = m.norm(h)
        if self.lm_head is not None:
            h = self.lm_head(h)
        return h

    def parallel_plan(self) -> ParallelPlan:
        return dataclasses.replace(
            super().parallel_plan(),
            tp_plan=functools.partial(
                self.qwen3_next_tp_plan,
                gdn=tuple(self._ssm_layers()),
                moe_blocks=self._moe_blocks(),
            ),
        )

    @staticmethod
    def qwen3_next_tp_plan(
        *,
        sequence_parallel: bool,
        loss_parallel: bool,
        gdn: tuple[str, ...] = (),
        moe_blocks: dict[str, bool] | None = None,
    ) -> dict:
        """The Llama layout's plan on transformers' names (`HFCausalLM.tp_plan`: q_proj with
        each head's query and gate rows, k/v_proj column-wise, o_proj row-wise, the per-head
        q/k norms on this rank's heads, the dense MLPs, the MoE layers of `moe_blocks` routing
        each tp rank's own tokens, sequence parallel's norms and gathers), plus each Gated
        DeltaNet layer of `gdn` split by key heads (`ssm_tp_plan`; its own style gathers its
        input under sp). Its attention and MLP modules carry the Llama layout's names, so the
        same entries reach them; the ``linear_attn`` layers match none of them."""
        plan = HFCausalLM.tp_plan(
            sequence_parallel=sequence_parallel,
            loss_parallel=loss_parallel,
            moe_blocks=moe_blocks,
        )
        for name in gdn:
            mixer = f"model.layers.{name}.linear_attn"
            plan.update(ssm_tp_plan(mixer, "gdn", sequence_parallel=sequence_parallel))
        return plan

    def _check_strategy(self, strategy) -> list[str]:
        """The ModelSpec's and the Gated DeltaNet's checks (cp refused, tp dividing the key
        heads); the MoE layers are the Engine's, so ep, etp and tp run."""
        return strategy.problems(self.spec) + ssm_strategy_problems(self.spec, strategy)


def _as_gated_delta_net(theirs: Any, spec, hidden: int, eps: float) -> GatedDeltaNet:
    """`GatedDeltaNet` holding the weights of transformers' ``Qwen3NextGatedDeltaNet``
    `theirs` (re-laid by key head), on its device (the meta device too). Its SiLU is the
    only activation `ModelSpec.from_hf_config` reads for Qwen3-Next (hidden_act)."""
    with torch.device(theirs.A_log.device):
        ours = GatedDeltaNet(spec, hidden, eps=eps)
    ours.load_state_dict(ours.from_transformers(theirs.state_dict()), assign=True)
    return ours
