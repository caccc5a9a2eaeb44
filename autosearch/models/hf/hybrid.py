"""Hybrid Hugging Face causal LMs under the Engine: Nemotron-H / Nemotron 3 (model_type
nemotron_h) and IBM Granite 4.0-H (granitemoehybrid), Mamba-2 layers among attention layers.

Each wrapper takes transformers' modules over as `autosearch.models.hf.causal_lm.HFCausalLM`
does for Llama, under their own names: the layers in an ``nn.ModuleDict`` so that a pipeline
stage keeps the names of the full model, a forward that skips what a stage drops, and an
attention core per attention layer (transformers' SDPA) that selective recompute checkpoints.

* Nemotron-H (`NemotronHCausalLM`): one transformers layer per symbol of Megatron's hybrid
  pattern (``NemotronHBlock``: a pre-norm, one mixer, a residual): Mamba-2 (``M``), attention
  without positions (``*``), a squared-ReLU MLP (``-``) or Nemotron 3's mixture of experts
  (``E``, transformers' ``NemotronHMoE``). Its Mamba-2 mixers are replaced, when the wrapper
  takes the model over, by `autosearch.models.ssm.Mamba2Mixer` holding the same weights under
  the same names (``model.layers.0.mixer.in_proj.weight``), its packed rows re-laid group by
  group so that tensor parallel gives each rank whole groups (as Phi-3's fused rows,
  `autosearch.models.hf.phi3`); `hf_model` (``Engine.save_pretrained``) lays them back, so a
  saved model loads in transformers. It computes what transformers' torch path computes
  (tests/test_ssm.py).
* Granite 4.0-H (`GraniteHybridCausalLM`): Llama-like layers whose mixer is ``self_attn`` or
  ``mamba`` (its Mamba-2 layers replaced as Nemotron-H's), each with a SwiGLU ``shared_mlp``
  (its fused gate/up rows interleaved for tp, `InterleavedGatedMLP`) and routed experts where
  ``num_local_experts`` > 0 (transformers' module), the embedding, residual, attention and logit
  multipliers.

What runs: dp, ZeRO 1-3 (FSDP2, one unit per layer), pp (the pipeline splits layers of any
kind), full and selective recompute, autocast; tensor parallel (+ sequence parallel) for
both (Granite's shared MLP's fused gate/up rows interleaved, as Phi-3's). What is refused, with
the reason: context parallel (as the cost model: the Mamba state passes along the sequence),
expert parallel and tensor parallel of the MoE layers (transformers' own modules).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from autosearch.core.errors import SpecError
from autosearch.core.model_spec import ModelSpec
from autosearch.distributed.plan import ParallelPlan
from autosearch.models.hf.causal_lm import AttentionCore, HFCausalLM, init_moe
from autosearch.models.ssm import GatedDeltaNet, Mamba2Mixer, ssm_strategy_problems, ssm_tp_plan


class HFHybridCausalLM(HFCausalLM):
    """What the hybrid wrappers share (module doc): the take-over, transformers' init, the
    checks, the state-space mixers' rows laid back for transformers. A subclass names its
    embedding, final norm, attention and state-space mixer modules and the layers' attention
    test."""

    model_types: tuple[str, ...] = ()
    # transformers' names, by default the Llama layout's (HFCausalLM's)
    embedding = "embed_tokens"  # the attribute of transformers' base model
    final_norm = "norm"
    attention = "self_attn"  # the attribute of a layer holding its attention module
    ssm = "mixer"  # the attribute of a layer holding its Mamba-2 or Gated DeltaNet mixer

    @classmethod
    def takes(cls, model: nn.Module) -> bool:
        config = getattr(model, "config", None)
        return (
            getattr(config, "model_type", None) in cls.model_types
            and hasattr(getattr(model, "model", None), cls.embedding)
            and hasattr(model, "lm_head")
        )

    @staticmethod
    def is_attention(layer: nn.Module) -> bool:
        raise NotImplementedError

    def __init__(self, hf_model: nn.Module, *, seq_len: int | None = None):
        nn.Module.__init__(self)
        if not self.takes(hf_model):
            raise SpecError(
                f"{type(self).__name__} runs transformers causal LMs of model_type "
                f"{', '.join(self.model_types)}; got {type(hf_model).__name__}"
            )
        self._take_over(hf_model)
        for layer in self.model.layers.values():
            layer.config = self.config
            if self.is_attention(layer):
                attn = getattr(layer, self.attention)
                attn.config = self.config
                if not hasattr(attn, "core"):
                    attn.core = AttentionCore(attn.num_key_value_groups)
        self.spec = ModelSpec.from_hf_config(self.config, seq_len=seq_len)
        self.router_aux_loss_coef = 0.0  # transformers' MoE layers, if any, as they are
        self.n_moe_layers, self.n_experts, self.top_k = 0, 0, 0  # no autosearch MoE layers
        self.tied_embeddings = self.lm_head.weight is getattr(self.model, self.embedding).weight

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise every weight as transformers does (its ``_init_weights``: normal linear
        and embedding weights, ones for norms; Qwen3-Next's experts, the Engine's, normal(0,
        initializer_range) by `init_moe`), the state-space mixers (ours) by their ``init_ssm``;
        the Engine calls it after building on the meta device."""
        self._init_as_transformers()
        init_moe(self)
        for module in self.modules():
            if isinstance(module, (Mamba2Mixer, GatedDeltaNet)):
                module.init_ssm()

    def _ssm_layers(self) -> list[str]:
        """The names of the layers whose `ssm` mixer is ours (Mamba-2 or Gated DeltaNet)."""
        return [
            name
            for name, layer in self.model.layers.items()
            if isinstance(getattr(layer, self.ssm, None), (Mamba2Mixer, GatedDeltaNet))
        ]

    def parallel_plan(self) -> ParallelPlan:
        return ParallelPlan(
            blocks="model.layers",
            first_stage=(f"model.{self.embedding}",),
            last_stage=(f"model.{self.final_norm}", "lm_head"),
            tp_plan=None,
            attention_core=f"{self.attention}.core",
            check=self._check_strategy,
        )

    def _check_strategy(self, strategy) -> list[str]:
        problems = strategy.problems(self.spec) + ssm_strategy_problems(self.spec, strategy)
        if strategy.ep > 1 or strategy.etp > 1:
            problems.append(
                f"ep={strategy.ep}, etp={strategy.etp}: the MoE layers of "
                f"{self.config.model_type} run transformers' own module, which the Engine does "
                "not split over expert-parallel ranks; set ep=1 and etp=1"
            )
        return problems

    def sliding_window(self) -> int | None:
        return None

    def hf_model(self, state_dict: dict[str, torch.Tensor] | None = None) -> Any:
        """transformers' model holding `state_dict` (or this module's weights), the state-space
        mixers' rows laid back in transformers' order."""
        state = dict(state_dict if state_dict is not None else self.state_dict())
        for name in self._ssm_layers():
            mixer = getattr(self.model.layers[name], self.ssm)
            prefix = f"model.layers.{name}.{self.ssm}."
            own = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
            state.update({prefix + k: v for k, v in mixer.to_transformers(own).items()})
        return super().hf_model(state)


class NemotronHCausalLM(HFHybridCausalLM):
    """A transformers ``NemotronHForCausalLM`` as the Engine runs it (module doc).

    Args:
        hf_model: the causal LM (random or pretrained); its modules are taken over, not copied.
        seq_len: training sequence length for the ModelSpec (default the config's
            ``max_position_embeddings``).
    """

    model_types = ("nemotron_h",)
    embedding = "embeddings"
    final_norm = "norm_f"
    attention = "mixer"

    @staticmethod
    def is_attention(layer: nn.Module) -> bool:
        return layer.block_type in ("full_attention", "attention")

    def __init__(self, hf_model: nn.Module, *, seq_len: int | None = None):
        super().__init__(hf_model, seq_len=seq_len)
        mamba = self.spec.mamba
        for layer in self.model.layers.values():
            if layer.block_type in ("linear_attention", "mamba") and mamba is not None:
                layer.mixer = _as_mamba2_mixer(
                    layer.mixer, mamba, self.config.hidden_size, self.config.layer_norm_epsilon
                )

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

    def parallel_plan(self) -> ParallelPlan:
        import dataclasses
        import functools

        kinds = {n: b.block_type for n, b in self.model.layers.items()}
        for name in self._ssm_layers():
            kinds[name] = "mamba"
        return dataclasses.replace(
            super().parallel_plan(),
            tp_plan=functools.partial(self.nemotron_h_tp_plan, kinds=kinds),
        )

    @staticmethod
    def nemotron_h_tp_plan(
        *, sequence_parallel: bool, loss_parallel: bool, kinds: dict[str, str] | None = None
    ) -> dict:
        """Megatron's split on transformers' names: attention q/k/v column-wise and o_proj
        row-wise, the MLPs' up_proj column-wise and down_proj row-wise, each Mamba-2 mixer by
        groups (`autosearch.models.ssm.ssm_tp_plan`; `kinds`: {layer name: ``mamba`` or
        transformers' block type}); embeddings by vocabulary rows, lm_head by vocabulary
        columns; with sequence parallel the norms on the ranks' shards of the sequence and each
        mixer's input gathered (the attention's by keyword, as transformers passes it)."""
        from torch.distributed.tensor.parallel import SequenceParallel

        from autosearch.models.hf.tp_plans import (
            LAYER,
            attention_entries,
            column_row_entries,
            gather_input,
            vocab_entries,
        )

        sp = sequence_parallel
        plan: dict = {
            **vocab_entries("model.embeddings", sequence_parallel=sp, loss_parallel=loss_parallel),
            **attention_entries(LAYER + "mixer", sequence_parallel=sp),
            **column_row_entries(
                LAYER + "mixer.", ("up_proj",), "down_proj", sequence_parallel=sp
            ),
        }
        if sequence_parallel:
            plan["model.norm_f"] = SequenceParallel()
            plan[LAYER + "norm"] = SequenceParallel()
        for name, kind in (kinds or {}).items():
            mixer = f"model.layers.{name}.mixer"
            if kind == "mamba":  # its own style gathers its input under sp
                plan.update(ssm_tp_plan(mixer, "mamba", sequence_parallel=sequence_parallel))
            elif sequence_parallel:  # the attention's input by keyword, as transformers passes it
                plan[mixer] = gather_input(by_keyword=kind in ("full_attention", "attention"))
        return plan

    def _check_strategy(self, strategy) -> list[str]:
        problems = super()._check_strategy(strategy)
        if strategy.tp > 1 and any(
            b.block_type == "moe" for b in self.model.layers.values()
        ):  # transformers' NemotronHMoE: its experts are one parameter each, no tp plan
            problems.append(
                f"tp={strategy.tp}: Nemotron 3's MoE layers run transformers' NemotronHMoE, "
                "which has no tensor-parallel plan here; use tp=1 (dp, zero, pp)"
            )
        return problems


def _as_mamba2_mixer(theirs: Any, spec, hidden: int, eps: float) -> Mamba2Mixer:
    """`Mamba2Mixer` holding the weights of transformers' mixer `theirs` (re-laid by group), on
    its device (the meta device too)."""
    limit = tuple(getattr(theirs, "time_step_limit", (0.0, float("inf"))))
    if limit != (0.0, float("inf")):
        raise SpecError(
            f"time_step_limit {limit}: the Engine's Mamba-2 mixer does not clamp the step "
            "sizes (Nemotron-H's default is (0, inf)); use the default"
        )
    device = theirs.A_log.device
    with torch.device(device):
        ours = Mamba2Mixer(spec, hidden, eps=eps)
    ours.load_state_dict(ours.from_transformers(theirs.state_dict()), assign=True)
    return ours


class InterleavedGatedMLP(nn.Module):
    """Granite's SwiGLU ``shared_mlp`` on rows of its fused ``input_linear`` interleaved gate,
    up, gate, up (`autosearch.models.hf.phi3.interleave_gate_up`): a contiguous 1/tp of the
    rows holds the gate and up rows of the same units, which ``output_linear`` (row-wise) takes
    by columns. Computes transformers' ``GraniteMoeHybridMLP`` (act(gate) * up) under the same
    parameter names."""

    def __init__(self, hf_mlp: Any):
        super().__init__()
        from autosearch.models.hf.phi3 import interleave_gate_up

        self.input_linear = hf_mlp.input_linear
        self.output_linear = hf_mlp.output_linear
        self.activation = hf_mlp.activation
        weight = self.input_linear.weight
        self.input_linear.weight = nn.Parameter(
            interleave_gate_up(weight.detach()), requires_grad=weight.requires_grad
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        gate, up = self.input_linear(hidden_states).unflatten(-1, (-1, 2)).unbind(-1)
        return self.output_linear(self.activation(gate) * up)


class GraniteHybridCausalLM(HFHybridCausalLM):
    """A transformers ``GraniteMoeHybridForCausalLM`` as the Engine runs it (module doc): the
    Granite multipliers applied where transformers applies them (embedding x
    ``embedding_multiplier`` on the first stage, logits / ``logits_scaling`` on the last; the
    residual and attention multipliers inside the layers). Laid out for tensor parallel as
    Nemotron-H: the Mamba-2 layers become `autosearch.models.ssm.Mamba2Mixer` (rows by group),
    the shared MLP's fused gate/up rows are interleaved (`InterleavedGatedMLP`); `hf_model`
    lays both back.

    Args:
        hf_model: the causal LM (random or pretrained); its modules are taken over, not copied.
        seq_len: training sequence length for the ModelSpec (default the config's
            ``max_position_embeddings``).
    """

    model_types = ("granitemoehybrid",)
    ssm = "mamba"

    @staticmethod
    def is_attention(layer: nn.Module) -> bool:
        return layer.self_attn is not None

    def __init__(self, hf_model: nn.Module, *, seq_len: int | None = None):
        super().__init__(hf_model, seq_len=seq_len)
        mamba = self.spec.mamba
        for layer in self.model.layers.values():
            if layer.mamba is not None and mamba is not None:
                layer.mamba = _as_mamba2_mixer(
                    layer.mamba, mamba, self.config.hidden_size, self.config.rms_norm_eps
                )
            layer.shared_mlp = InterleavedGatedMLP(layer.shared_mlp)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        m = self.model
        h, seq = self._stage_input(tokens)
        if m.embed_tokens is not None:
            h = h * m.embedding_multiplier
        position_embeddings = None
        if m.rotary_emb is not None:
            positions = torch.arange(seq, device=h.device).unsqueeze(0)
            position_embeddings = m.rotary_emb(h, positions)
        for layer in m.layers.values():
            h = layer(h, position_embeddings=position_embeddings)
        if m.norm is not None:
            h = m.norm(h)
        if self.lm_head is not None:
            h = self.lm_head(h) / self.config.logits_scaling
        return h

    def parallel_plan(self) -> ParallelPlan:
        import dataclasses
        import functools

        return dataclasses.replace(
            super().parallel_plan(),
            tp_plan=functools.partial(self.granite_tp_plan, mamba=tuple(self._ssm_layers())),
        )

    @staticmethod
    def granite_tp_plan(
        *, sequence_parallel: bool, loss_parallel: bool, mamba: tuple[str, ...] = ()
    ) -> dict:
        """Megatron's split on transformers' names: q/k/v column-wise, o_proj row-wise, the
        shared MLP's (interleaved) input_linear column-wise and output_linear row-wise, each
        Mamba-2 layer by groups (`ssm_tp_plan`); embeddings by vocabulary rows, lm_head by
        vocabulary columns; with sequence parallel the norms on the ranks' shards and each
        mixer's and MLP's input gathered."""
        from autosearch.models.hf.tp_plans import (
            LAYER,
            column_row_entries,
            llama_layout_entries,
            llama_sequence_parallel_entries,
        )

        sp = sequence_parallel
        plan: dict = {
            **llama_layout_entries(sequence_parallel=sp, loss_parallel=loss_parallel),
            **column_row_entries(
                LAYER + "shared_mlp.", ("input_linear",), "output_linear", sequence_parallel=sp
            ),
        }
        if sequence_parallel:
            plan.update(llama_sequence_parallel_entries(mlp="shared_mlp"))
        for name in mamba:
            plan.update(
                ssm_tp_plan(
                    f"model.layers.{name}.mamba", "mamba", sequence_parallel=sequence_parallel
                )
            )
        return plan

    def _check_strategy(self, strategy) -> list[str]:
        problems = super()._check_strategy(strategy)
        if strategy.tp > 1 and self.config.num_local_experts > 0:
            problems.append(
                f"tp={strategy.tp}: Granite's MoE layers run transformers' "
                "GraniteMoeHybridMoE, which has no tensor-parallel plan here; use tp=1"
            )
        return problems

    def hf_model(self, state_dict: dict[str, torch.Tensor] | None = None) -> Any:
        """transformers' model holding `state_dict` (or this module's weights), the Mamba rows
        (`HFHybridCausalLM.hf_model`) and the shared MLPs' gate/up rows laid back in
        transformers' order."""
        from autosearch.models.hf.phi3 import interleave_gate_up

        state = dict(state_dict if state_dict is not None else self.state_dict())
        for key in [k for k in state if k.endswith("shared_mlp.input_linear.weight")]:
            state[key] = interleave_gate_up(state[key], inverse=True)
        return super().hf_model(state)
