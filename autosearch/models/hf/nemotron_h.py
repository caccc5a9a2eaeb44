"""Nemotron-H and Nemotron 3 (transformers ``NemotronHForCausalLM``, model_type nemotron_h)
under the Engine.

A Nemotron-H layer is one symbol of Megatron's hybrid pattern (``NemotronHBlock``: a pre-norm,
one mixer, a residual): a Mamba-2 mixer (``M``), attention without positions (``*``), a
squared-ReLU MLP (``-``) or, in Nemotron 3, a mixture of experts (``E``). `NemotronHCausalLM`
takes transformers' modules over as `autosearch.models.hf.causal_lm.HFCausalLM` does for Llama,
under their own names (``model.layers.0.mixer.in_proj.weight``, ``model.embeddings.weight``,
``model.norm_f.weight``, ``lm_head.weight``): the layers in an ``nn.ModuleDict`` so that a
pipeline stage keeps the names of the full model, a forward that skips what a stage drops, and
an attention core per attention layer (``mixer.core``, transformers' SDPA) that selective
recompute checkpoints. The Mamba-2 mixers run transformers' own torch path (its fused kernels
need ``mamba_ssm`` and CUDA); `autosearch.models.ssm.Mamba2Mixer` computes the same
(tests/test_ssm.py).

What runs: dp, ZeRO 1-3 (FSDP2, one unit per layer), pp (the pipeline splits layers of any
kind), full and selective recompute, bf16 / fp16 autocast. What is refused, with the reason:
tensor parallel (`autosearch.models.transformer.ssm_tp_problems`), context parallel (as the cost
model: the Mamba layers' state passes across the sequence), and expert parallel for Nemotron 3's
MoE layers (they run transformers' ``NemotronHMoE``, which has no expert-parallel plan here).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from autosearch.core.errors import SpecError
from autosearch.core.model_spec import ModelSpec
from autosearch.distributed.plan import ParallelPlan
from autosearch.models.hf.causal_lm import (
    ATTN_IMPLEMENTATION,
    AttentionCore,
    HFCausalLM,
    _register_attention,
)


class NemotronHCausalLM(HFCausalLM):
    """A transformers ``NemotronHForCausalLM`` as the Engine runs it (module doc).

    Args:
        hf_model: the causal LM (random or pretrained); its modules are taken over, not copied.
        seq_len: training sequence length for the ModelSpec (default the config's
            ``max_position_embeddings``).
    """

    model_types = ("nemotron_h",)

    @classmethod
    def takes(cls, model: nn.Module) -> bool:
        config = getattr(model, "config", None)
        return (
            getattr(config, "model_type", None) in cls.model_types
            and hasattr(getattr(model, "model", None), "embeddings")
            and hasattr(model, "lm_head")
        )

    def __init__(self, hf_model: nn.Module, *, seq_len: int | None = None):
        nn.Module.__init__(self)
        if not self.takes(hf_model):
            raise SpecError(
                f"NemotronHCausalLM runs transformers' NemotronHForCausalLM; got "
                f"{type(hf_model).__name__}"
            )
        _register_attention()
        hf: Any = hf_model
        self.hf_class = type(hf)
        self.config = copy.deepcopy(hf.config)
        self.config._attn_implementation = ATTN_IMPLEMENTATION
        self.model = hf.model
        self.lm_head = hf.lm_head
        if isinstance(self.model.layers, nn.ModuleList):
            self.model.layers = nn.ModuleDict(
                {str(i): layer for i, layer in enumerate(self.model.layers)}
            )
        self.model.config = self.config
        for layer in self.model.layers.values():
            layer.config = self.config
            if layer.block_type == "full_attention":
                layer.mixer.config = self.config
                if not hasattr(layer.mixer, "core"):
                    layer.mixer.core = AttentionCore(layer.mixer.num_key_value_groups)
        self.spec = ModelSpec.from_hf_config(self.config, seq_len=seq_len)
        self.router_aux_loss_coef = 0.0  # Nemotron 3's router balances by its expert bias
        self.n_moe_layers, self.n_experts, self.top_k = 0, 0, 0  # no autosearch MoE layers
        self.tied_embeddings = self.lm_head.weight is self.model.embeddings.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """Logits (batch, seq, vocab) of token ids (batch, seq); a pipeline stage maps hidden
        states to hidden states."""
        m = self.model
        h = m.embeddings(tokens) if m.embeddings is not None else tokens
        for layer in m.layers.values():
            h = layer(h)  # causal attention without a mask; no cache
        if m.norm_f is not None:
            h = m.norm_f(h)
        if self.lm_head is not None:
            h = self.lm_head(h)
        return h

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise every weight as transformers does (``NemotronHPreTrainedModel.
        _init_weights``: the Mamba mixers' A_log, D and dt_bias, normal linear and embedding
        weights, ones for norms); the Engine calls it after building on the meta device."""
        for p in self.parameters():
            if getattr(p, "_is_hf_initialized", False):
                p._is_hf_initialized = False  # type: ignore[attr-defined]
        for module in self.modules():
            if module is not self:
                self.model._init_weights(module)

    def parallel_plan(self) -> ParallelPlan:
        return ParallelPlan(
            blocks="model.layers",
            first_stage=("model.embeddings",),
            last_stage=("model.norm_f", "lm_head"),
            tp_plan=None,
            attention_core="mixer.core",
            check=self._check_strategy,
        )

    def _check_strategy(self, strategy) -> list[str]:
        from autosearch.models.transformer import ssm_tp_problems

        problems = strategy.problems(self.spec) + ssm_tp_problems(self.spec, strategy.tp)
        if strategy.ep > 1 or strategy.etp > 1:
            problems.append(
                f"ep={strategy.ep}, etp={strategy.etp}: Nemotron 3's MoE layers run "
                "transformers' NemotronHMoE (squared-ReLU experts under an aux-loss-free "
                "sigmoid router), which the Engine does not split over expert-parallel ranks; "
                "set ep=1 and etp=1"
            )
        return problems

    def sliding_window(self) -> int | None:
        return None
