"""Gemma, Gemma 2 and Gemma 3 (text) under the Engine: what `HFDenseCausalLM`
(`autosearch.models.hf.dense`) needs beyond the Llama plan.

transformers' Gemma modules run as they are: the embedding multiplies by sqrt(hidden) in its own
forward (``Gemma*TextScaledWordEmbedding``, so only the first pipeline stage scales), RMSNorms
compute x / rms(x) * (1 + w), the MLPs are GeGLU (tanh GELU gate), and lm_head is tied to the
embedding by default. Gemma 2 and 3 add a norm after attention and two around the MLP; the one
after attention and the one after the MLP feed the residual sum, so under sequence parallel they
hand back local shards as the row-parallel projections before them do. Gemma 3 normalises q and
k per head after the heads' transpose (b, heads, s, d): a replicated weight whose input holds
this rank's heads on dim 1 (Qwen3's norms see (b, s, heads, d): dim 2). Soft-capping and sliding
windows are `WindowedAttentionCore`'s (dense.py), Gemma 3's rotary table per layer type the
wrapper's forward.
"""

from __future__ import annotations

from typing import Any

import torch

GEMMA_FAMILIES = ("gemma", "gemma2", "gemma3_text")


def tp_entries(config: Any, *, sequence_parallel: bool) -> dict:
    """Entries added to `HFCausalLM.tp_plan` for Gemma 2 / 3 (module doc); none for Gemma."""
    from torch.distributed.tensor.parallel import SequenceParallel

    layer = "model.layers.*."
    plan: dict = {}
    if config.model_type == "gemma3_text":
        for norm in ("q_norm", "k_norm"):
            plan[f"{layer}self_attn.{norm}"] = SequenceParallel(
                sequence_dim=1, use_local_output=True
            )
    if sequence_parallel and config.model_type != "gemma":
        plan[layer + "post_attention_layernorm"] = SequenceParallel(use_local_output=True)
        plan[layer + "pre_feedforward_layernorm"] = SequenceParallel()
        plan[layer + "post_feedforward_layernorm"] = SequenceParallel(use_local_output=True)
    return plan


def rebuild_buffers(model: Any) -> None:
    """The non-persistent buffers of a transformers Gemma built on the meta device and given a
    state dict (`HFCausalLM.hf_model`): the embedding scale, and Gemma 3's rotary tables (one
    per layer type, which `_rebuild_rotary` does not know)."""
    embed = model.model.embed_tokens
    scale = torch.tensor(embed.scalar_embed_scale)
    embed.register_buffer("embed_scale", scale, persistent=False)
    rotary = model.model.rotary_emb
    if any(b.is_meta for b in rotary.buffers()):
        model.model.rotary_emb = type(rotary)(model.config)
