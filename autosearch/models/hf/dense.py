"""Hugging Face dense causal LMs beyond the Llama layout under the Engine: Qwen3, Gemma, Gemma 2,
Gemma 3 (text), Phi-3 / Phi-4 and Nemotron.

`HFDenseCausalLM` wraps a ``Qwen3ForCausalLM``, ``GemmaForCausalLM``, ``Gemma2ForCausalLM``,
``Gemma3ForCausalLM``, ``Phi3ForCausalLM`` or ``NemotronForCausalLM`` as `HFCausalLM` wraps Llama
(`autosearch.models.hf.causal_lm`): transformers' modules taken over under their own names, the
layers in an ``nn.ModuleDict``, a forward that skips what a pipeline stage drops, an attention
core per layer (selective recompute, context parallel) and a tensor-parallel plan. What these
families add, and how it runs:

* Sliding-window layers and attention-logit soft-capping (Gemma 2 and 3, Phi-3, Qwen3 with
  ``use_sliding_window``). transformers passes each layer's window (``sliding_window``, None on
  a global layer) and cap (``softcap``) to its attention function with the scores' ``scaling``;
  `WindowedAttentionCore` reads them. It builds its mask from token positions (key k is seen
  from query q when q - window < k <= q, transformers' ``sliding_window_overlay``) and
  soft-caps the scores, c * tanh(s / c), before the mask, as transformers'
  ``eager_attention_forward`` (its SDPA function has no soft-capping). Under context parallel
  it attends over the keys and values of the whole sequence, gathered over the cp ranks
  (`ContextParallel.whole_keys`), with the same mask on global positions: the math of
  one process (`autosearch.models.attention`). Layers without either run `AttentionCore`
  (transformers' SDPA, or the cp path).
* Rotary tables are computed for the whole sequence on every rank and stage and indexed at this
  rank's positions, so the rope types that read the sequence length (Phi-3's longrope,
  dynamic) see the same length on every cp rank.
* Family by family (transformers' modules as they are, unless named):
  Qwen3: per-head ``q_norm`` / ``k_norm`` (`HFCausalLM.tp_plan` shards them with the heads).
  Gemma (`autosearch.models.hf.gemma`): the embedding scaled by sqrt(hidden) (in transformers'
  embedding module), (1 + w) RMSNorms, GeGLU MLPs, tied embeddings; Gemma 2 / 3 add norms
  after attention and around the MLP (sequence parallel), final-logit soft-capping, and Gemma 3
  per-head q/k norms and a rotary table per layer type.
  Phi-3 (`autosearch.models.hf.phi3`): the fused ``qkv_proj`` and ``gate_up_proj`` are laid
  out once, whatever tp, so that column-wise tp gives each rank matching heads and halves.
  Nemotron: LayerNorm1P (weight + 1, with bias), a squared-ReLU MLP of ``up_proj`` and
  ``down_proj``, partial rotary.

The Engine wraps these models by itself (``Engine(lambda: Gemma2ForCausalLM(config), ...)``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from autosearch.core.errors import SpecError
from autosearch.core.model_spec import ModelSpec
from autosearch.models import attention
from autosearch.models.hf import gemma, phi3
from autosearch.models.hf.causal_lm import AttentionCore, HFCausalLM

DENSE_FAMILIES = ("qwen3", *gemma.GEMMA_FAMILIES, "phi3", "nemotron")


def is_dense_model(model) -> bool:
    """Whether the Engine wraps `model` in `HFDenseCausalLM`: a transformers causal LM (``.model``
    and ``.lm_head``) of model_type qwen3, gemma, gemma2, gemma3_text, phi3 or nemotron."""
    config = getattr(model, "config", None)
    return (
        type(model).__module__.startswith("transformers.")
        and getattr(config, "model_type", None) in DENSE_FAMILIES
        and hasattr(model, "model")
        and hasattr(model, "lm_head")
    )


class WindowedAttentionCore(AttentionCore):
    """`AttentionCore` with sliding windows and logit soft-capping (module doc): the window and
    the cap come with each call, as transformers passes them."""

    def forward(self, query, key, value, attention_mask, **kwargs):
        window = kwargs.pop("sliding_window", None)
        softcap = kwargs.pop("softcap", None)
        cp = self.context_parallel
        local = query.shape[2]
        whole = local * (cp.cp if cp is not None else 1)
        if softcap is None and (window is None or window >= whole):
            return super().forward(query, key, value, attention_mask, **kwargs)
        key, value, q_pos, k_pos = attention.positions(key, value, local, cp)
        scaling = kwargs.get("scaling")
        out = attention.masked_attention(
            query,
            key,
            value,
            attention.visible(q_pos, k_pos, window),
            scaling=scaling if scaling is not None else query.shape[-1] ** -0.5,
            softcap=softcap,
            dropout_p=kwargs.get("dropout", 0.0) if self.training else 0.0,
        )
        return out.transpose(1, 2).contiguous(), None


def zero_row_(weight: torch.Tensor, row: int) -> None:
    """Zero row `row` of a weight, a plain tensor or this rank's shard of a DTensor."""
    from torch.distributed.tensor import DTensor

    if not isinstance(weight, DTensor):
        weight[row].zero_()
        return
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(
        weight.shape, weight.device_mesh, weight.placements
    )
    if offset[0] <= row < offset[0] + shape[0]:
        weight.to_local()[row - offset[0]].zero_()


class HFDenseCausalLM(HFCausalLM):
    """A transformers Qwen3, Gemma (1, 2, 3 text), Phi-3 or Nemotron causal LM as the Engine runs
    it (module doc). An `HFCausalLM` for the Engine (``save_pretrained``, the strategy checks)
    with its own forward, plan and conversion back to transformers.

    Args:
        hf_model: a ``*ForCausalLM`` of one of those model_types (random or pretrained); its
            modules are taken over, Phi-3's fused projections laid out for tp (`phi3`).
        seq_len: training sequence length for the ModelSpec (default the config's
            ``max_position_embeddings``).

    Example:
        >>> from transformers import Gemma2Config, Gemma2ForCausalLM         # doctest: +SKIP
        >>> cfg = Gemma2Config(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
        ...     num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=128,
        ...     sliding_window=8)                                             # doctest: +SKIP
        >>> model = HFDenseCausalLM(Gemma2ForCausalLM(cfg), seq_len=32)     # doctest: +SKIP
        >>> model(torch.zeros(2, 32, dtype=torch.long)).shape               # doctest: +SKIP
        torch.Size([2, 32, 128])
    """

    def __init__(self, hf_model: nn.Module, *, seq_len: int | None = None):
        nn.Module.__init__(self)  # HFCausalLM's __init__ reads the Llama layout
        if not is_dense_model(hf_model):
            raise SpecError(
                f"HFDenseCausalLM runs transformers causal LMs of model_type "
                f"{', '.join(DENSE_FAMILIES)}; got {type(hf_model).__name__} (model_type "
                f"{getattr(getattr(hf_model, 'config', None), 'model_type', None)!r})"
            )
        hf: Any = hf_model
        if getattr(hf.config, "use_bidirectional_attention", False):
            raise SpecError(
                f"this {type(hf).__name__} has use_bidirectional_attention=true (an encoder, as "
                "EmbeddingGemma); the Engine trains causal LMs: set it false"
            )
        self._take_over(hf)
        if self.config.model_type == "phi3":
            phi3.fuse_for_tp(self.model.layers.values())
        for layer in self.model.layers.values():
            attn = layer.self_attn
            attn.config = self.config
            if not isinstance(getattr(attn, "core", None), WindowedAttentionCore):
                attn.core = WindowedAttentionCore(attn.num_key_value_groups)
        self.spec = ModelSpec.from_hf_config(self.config, seq_len=seq_len)
        self.router_aux_loss_coef = 0.0  # dense: no mixture-of-experts loss
        self.n_moe_layers = self.n_experts = self.top_k = 0
        self.tied_embeddings = self.lm_head.weight is self.model.embed_tokens.weight

    @classmethod
    def takes(cls, model: nn.Module) -> bool:
        return is_dense_model(model)

    @property
    def hf_attn_implementation(self) -> str:  # type: ignore[override]
        """The kernel of the transformers model `hf_model` returns: eager for soft-capped
        attention (transformers' SDPA function has none) and where the class refuses SDPA
        (Gemma 2), else SDPA."""
        softcap = getattr(self.config, "attn_logit_softcapping", None)
        return "sdpa" if self.hf_class._supports_sdpa and not softcap else "eager"

    def sliding_window(self) -> int | None:
        """None: the windows are applied layer by layer (`WindowedAttentionCore`), so no
        sequence length is refused for them."""
        return None

    def forward(self, tokens: torch.Tensor, balance: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (batch, seq, vocab) of token ids (batch, seq); a pipeline stage maps hidden
        states to hidden states (`balance`: the base class's MoE loss sums, never given here)."""
        m = self.model
        h, seq = self._stage_input(tokens)  # Gemma: the embedding scaled by sqrt(hidden) in it
        cp = self.context_parallel
        positions = (
            cp.positions(seq, h.device) if cp is not None else torch.arange(seq, device=h.device)
        )
        rotary = self._rotary_tables(h, seq * (cp.cp if cp is not None else 1), positions)
        for name, layer in m.layers.items():
            h = layer(h, position_embeddings=rotary(name), position_ids=positions.unsqueeze(0))
        if m.norm is not None:
            h = m.norm(h)
        if self.lm_head is not None:
            h = self.lm_head(h)
            cap = getattr(self.config, "final_logit_softcapping", None)
            if cap is not None:  # Gemma 2 / 3
                h = torch.tanh(h / cap) * cap
        return h

    def _rotary_tables(
        self, h: torch.Tensor, whole: int, positions: torch.Tensor
    ) -> Callable[[str], tuple[torch.Tensor, torch.Tensor]]:
        """(cos, sin) of a layer (by its name) at this rank's positions, from the tables of the
        whole sequence (module doc); Gemma 3 has one per layer type."""
        everywhere = torch.arange(whole, device=h.device).unsqueeze(0)
        local = positions if whole != positions.numel() else None

        def at_positions(table: tuple[torch.Tensor, torch.Tensor]):
            cos, sin = table
            return (cos, sin) if local is None else (cos[:, local], sin[:, local])

        rotary = self.model.rotary_emb
        if self.config.model_type == "gemma3_text":
            types = self.config.layer_types
            tables = {t: at_positions(rotary(h, everywhere, t)) for t in set(types)}
            return lambda name: tables[types[int(name)]]
        table = at_positions(rotary(h, position_ids=everywhere))
        return lambda name: table

    @torch.no_grad()
    def init_weights(self) -> None:
        """`HFCausalLM.init_weights` (transformers' ``_init_weights``: Gemma's zero (1 + w) norm
        weights, embedding scale and Gemma 3's rotary tables included), then the pad token's
        embedding row zeroed in this rank's shard: transformers zeroes
        ``weight[padding_idx]``, which on a DTensor (tp, FSDP) writes a copy, not the shard."""
        super().init_weights()
        embed = self.model.embed_tokens
        if embed is not None and embed.padding_idx is not None:
            zero_row_(embed.weight, embed.padding_idx)

    # ---- what the Engine asks ------------------------------------------------------------------
    def _adapt_tp_plan(self, plan: dict, *, sequence_parallel: bool) -> dict:
        """The family's own entries: Gemma's extra norms, Phi-3's fused projections (the Llama
        entries naming modules a family lacks are skipped: Nemotron's gate_proj, Phi-3's
        separate projections)."""
        if self.config.model_type in gemma.GEMMA_FAMILIES:
            plan.update(gemma.tp_entries(self.config, sequence_parallel=sequence_parallel))
        if self.config.model_type == "phi3":
            plan.update(phi3.tp_entries())
        return plan

    def _check_strategy(self, strategy) -> list[str]:
        problems = super()._check_strategy(strategy)
        if self.config.model_type == "phi3":
            problems += phi3.strategy_problems(self.config, strategy)
        return problems

    # ---- back to transformers ------------------------------------------------------------------
    def hf_model(self, state_dict: dict[str, torch.Tensor] | None = None) -> Any:
        """A plain transformers model of the same class and config holding `state_dict` (full
        tensors with this module's names, as ``Engine.save(path, training=False)`` writes them)
        or this module's weights: Phi-3's fused rows back in transformers' order, Gemma's
        non-persistent buffers (embedding scale, Gemma 3's rotary tables) rebuilt."""
        state = dict(state_dict if state_dict is not None else self.state_dict())
        if self.config.model_type == "phi3":
            state = phi3.to_transformers(state, self.config)
        model = super().hf_model(state)
        if self.config.model_type in gemma.GEMMA_FAMILIES:
            gemma.rebuild_buffers(model)
        return model
