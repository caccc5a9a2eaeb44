"""Phi-3 and Phi-4 (model_type phi3) under the Engine: fused projections laid out for tensor
parallel, for `HFDenseCausalLM` (`autosearch.models.hf.dense`).

Phi-3 fuses q, k and v into ``qkv_proj`` (rows ``[q | k | v]``: H x d, KV x d, KV x d) and the
MLP's gate and up into ``gate_up_proj`` (rows ``[gate | up]``, F each). Column-wise tp gives rank
r the r-th contiguous block of a weight's rows, which in that order holds queries only (or gates
only). The wrapper re-lays the rows once, when it takes the model over, in an order that does
not depend on tp (as `autosearch.models.hf.gpt` does with GPT-2's ``c_attn``):

* ``qkv_proj`` by key/value group: for kv head g, the G = H / KV query heads that share it, then
  k_g, then v_g. A contiguous block of KV / tp groups is whole groups, so every tp dividing KV
  gives each rank its queries with their keys and values; ``o_proj`` (row-wise) takes the
  columns of the same query heads, which keep transformers' order.
* ``gate_up_proj`` interleaved row by row: gate_0, up_0, gate_1, up_1, ... A contiguous block of
  2F / tp rows holds the gate and up rows of the same F / tp units, which ``down_proj``
  (row-wise) takes by columns; tp must divide F.

`Phi3Attention` and `Phi3MLP` below compute transformers' Phi-3 on that layout (same rotary,
partial rotary included, scaling, window, dropout). The alternatives, and why not: splitting the
fused linear into separate column-parallel linears changes the parameters' names (one parameter
is one tensor; ``qkv_proj.weight`` as three would need state-dict hooks that DCP, FSDP2 and the
optimizer's per-parameter state do not see); a DTensor placement for "three parts, each split"
(``_StridedShard``, private) describes equal parts only, not GQA's q, k, v of unequal sizes.

Parameter names and shapes stay transformers'; the values are permuted in the Engine's
checkpoints, and `to_transformers` (``Engine.save_pretrained``) permutes them back, so a saved
model loads in transformers. A raw transformers state dict does not load with ``engine.load``:
build the model with ``from_pretrained`` in the factory.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn


def group_qkv(
    tensor: torch.Tensor, n_heads: int, n_kv_heads: int, *, inverse: bool = False
) -> torch.Tensor:
    """transformers' ``[q | k | v]`` rows regrouped per key/value head (module doc), or back
    with `inverse`."""
    rest = tensor.shape[1:]
    head_dim = tensor.shape[0] // (n_heads + 2 * n_kv_heads)
    groups = n_heads // n_kv_heads
    sizes = [groups * head_dim, head_dim, head_dim]  # per group: its queries, k, v
    if not inverse:
        kv = n_kv_heads * head_dim
        q, k, v = tensor.split([n_heads * head_dim, kv, kv])
        parts = [p.reshape(n_kv_heads, size, *rest) for p, size in zip((q, k, v), sizes)]
        return torch.cat(parts, dim=1).reshape(tensor.shape)
    grouped = tensor.reshape(n_kv_heads, sum(sizes), *rest).split(sizes, dim=1)
    return torch.cat([p.reshape(-1, *rest) for p in grouped]).reshape(tensor.shape)


def interleave_gate_up(tensor: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
    """transformers' ``[gate | up]`` rows interleaved (gate_0, up_0, gate_1, ...), or back with
    `inverse`."""
    rest, half = tensor.shape[1:], tensor.shape[0] // 2
    shape = (half, 2) if inverse else (2, half)
    return tensor.reshape(*shape, *rest).transpose(0, 1).reshape(tensor.shape)


def _permuted(linear: nn.Linear, rows: torch.Tensor) -> None:
    linear.weight = nn.Parameter(rows, requires_grad=linear.weight.requires_grad)


class Phi3Attention(nn.Module):
    """transformers' Phi-3 attention on the grouped ``qkv_proj`` (module doc); ``o_proj`` and
    the rotary, scaling and window as transformers'. The attention core is set by the wrapper.

    Args:
        hf_attn: transformers' ``Phi3Attention`` of one layer, whose projections are taken over.
    """

    core: nn.Module

    def __init__(self, hf_attn: nn.Module):
        super().__init__()
        attn: Any = hf_attn
        self.config = attn.config
        self.layer_idx = attn.layer_idx
        self.head_dim = attn.head_dim
        self.num_key_value_groups = attn.num_key_value_groups
        self.scaling = attn.scaling
        self.attention_dropout = attn.attention_dropout
        config = attn.config
        self.qkv_proj = attn.qkv_proj
        _permuted(
            self.qkv_proj,
            group_qkv(
                attn.qkv_proj.weight.detach(),
                config.num_attention_heads,
                config.num_key_value_heads,
            ),
        )
        self.o_proj = attn.o_proj

    def forward(self, hidden_states: torch.Tensor, position_embeddings, *args, **kwargs):
        """(attention output, None), as transformers' Phi-3 layer expects; masks and caches
        are not used (training: the core masks by positions)."""
        from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

        shape = hidden_states.shape[:-1]
        groups, d = self.num_key_value_groups, self.head_dim
        qkv = self.qkv_proj(hidden_states).view(*shape, -1, (groups + 2) * d)
        q, k, v = qkv.split([groups * d, d, d], dim=-1)
        q = q.reshape(*shape, -1, d).transpose(1, 2)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)  # partial rotary: the first cos.shape[-1]
        out, _ = self.core(
            q,
            k,
            v,
            None,
            dropout=self.attention_dropout if self.training else 0.0,
            scaling=self.scaling,
            sliding_window=getattr(self.config, "sliding_window", None),
        )
        return self.o_proj(out.reshape(*shape, -1)), None


class Phi3MLP(nn.Module):
    """transformers' Phi-3 MLP, up * act(gate), on the interleaved ``gate_up_proj``.

    Args:
        hf_mlp: transformers' ``Phi3MLP`` of one layer, whose projections are taken over.
    """

    def __init__(self, hf_mlp: nn.Module):
        super().__init__()
        mlp: Any = hf_mlp
        self.gate_up_proj = mlp.gate_up_proj
        _permuted(self.gate_up_proj, interleave_gate_up(mlp.gate_up_proj.weight.detach()))
        self.down_proj = mlp.down_proj
        self.activation_fn = mlp.activation_fn

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(hidden_states).unflatten(-1, (-1, 2)).unbind(-1)
        return self.down_proj(up * self.activation_fn(gate))


def fuse_for_tp(layers: Iterable[nn.Module]) -> None:
    """Give each transformers Phi-3 layer `Phi3Attention` and `Phi3MLP` (the same parameters
    under the same names, rows re-laid: module doc)."""
    layer: Any
    for layer in layers:
        if not isinstance(layer.self_attn, Phi3Attention):
            layer.self_attn = Phi3Attention(layer.self_attn)
        if not isinstance(layer.mlp, Phi3MLP):
            layer.mlp = Phi3MLP(layer.mlp)


def tp_entries() -> dict:
    """The fused projections column-wise (whole groups and matching halves per rank)."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    layer = "model.layers.*."
    return {
        layer + "self_attn.qkv_proj": ColwiseParallel(),
        layer + "mlp.gate_up_proj": ColwiseParallel(),
    }


def strategy_problems(config: Any, strategy) -> list[str]:
    """tp must divide the MLP width: a block of 2F / tp interleaved rows must hold whole
    gate/up pairs (the heads are checked by the Strategy's rules)."""
    tp, width = strategy.tp, config.intermediate_size
    if tp > 1 and width % tp:
        return [
            f"tp={tp} does not divide Phi-3's intermediate_size={width}: each tp rank must "
            f"hold matching rows of the fused gate_up_proj; use a tp that divides {width}"
        ]
    return []


def to_transformers(state: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """A state dict of the wrapper with the fused rows back in transformers' order."""
    out = dict(state)
    for key, tensor in state.items():
        if key.endswith("self_attn.qkv_proj.weight"):
            out[key] = group_qkv(
                tensor, config.num_attention_heads, config.num_key_value_heads, inverse=True
            )
        elif key.endswith("mlp.gate_up_proj.weight"):
            out[key] = interleave_gate_up(tensor, inverse=True)
    return out
