"""Hugging Face GPT-2 and GPT-NeoX causal LMs under the Engine.

`HFGPTCausalLM` wraps a ``GPT2LMHeadModel`` or a ``GPTNeoXForCausalLM`` (or a subclass) as
`HFCausalLM` wraps the Llama family (`autosearch.models.hf.causal_lm`): HF's modules taken over,
the layers
in an ``nn.ModuleDict`` (``transformer.h`` / ``gpt_neox.layers``) so parameter names are HF's on
every pipeline stage, a forward that skips the modules a stage drops, an attention core per
layer for selective recompute and context parallel, and a tensor-parallel plan. What differs:

* GPT-2's ``Conv1D`` (weight stored (in, out), the transpose of ``nn.Linear``'s) becomes an
  ``nn.Linear`` holding the transposed weight and the same bias: the same affine map, so DTensor's
  ``ColwiseParallel`` / ``RowwiseParallel`` (which take ``nn.Linear`` and ``nn.Embedding`` only)
  and torchao's float8 conversion (``nn.Linear`` only) apply as they are. Writing plans on
  ``Conv1D``'s other dimension would need private ParallelStyle hooks and leave fp8 out.
* Fused q/k/v projections. Column-wise tp splits a weight's output rows into contiguous blocks,
  so each rank must find whole heads, each with its q, k and v, in its block. GPT-NeoX's
  ``query_key_value`` is already laid out so: row ``(head * 3 + part) * head_dim + d``
  (``view(..., heads, 3 * head_dim)`` then ``chunk(3)``), and rank r of tp holds heads
  ``r * H/tp .. (r+1) * H/tp - 1`` with their q, k, v; ``dense`` (row-wise) takes the same heads'
  columns. GPT-2's ``c_attn`` is ``[q | k | v]`` (row ``part * hidden + head * head_dim + d``),
  which a contiguous split would cut into all of q and part of k: the wrapper permutes its rows
  (and bias) once into NeoX's per-head layout, independent of tp, and runs GPT-2's attention
  with `GPT2Attention` below (the same math: scaling, dropouts, SDPA).
* State dicts keep HF's names; the converted GPT-2 weights are stored transposed (and ``c_attn``
  permuted), and `HFGPTCausalLM.hf_model` / ``Engine.save_pretrained`` convert them back, so a
  saved model loads in ``transformers`` as GPT-2.
* Positions: GPT-2's learned ``wpe`` lives on the first pipeline stage beside ``wte`` (tied to
  ``lm_head`` by default: `TiedWeights` under pp, one DTensor under tp) and is sharded by rows
  like the token embedding under tp; GPT-NeoX's partial rotary (``rotary_pct``) is computed on
  every stage. Both read global positions under context parallel, so cp is exact for both.
"""

from __future__ import annotations

import math
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
    _rebuild_rotary,
    _register_attention,
    _sequence_shards,
)

# model_type -> (causal LM class, attribute of the base model, attribute of its layer list)
LAYOUTS = {
    "gpt2": ("GPT2LMHeadModel", "transformer", "h"),
    "gpt_neox": ("GPTNeoXForCausalLM", "gpt_neox", "layers"),
}


def is_gpt_model(model) -> bool:
    """Whether the Engine wraps `model` in `HFGPTCausalLM`: a transformers ``GPT2LMHeadModel`` or
    ``GPTNeoXForCausalLM`` (or a subclass). GPT-2's other heads (``GPT2DoubleHeadsModel``, ...)
    are not causal LMs alone and are left as they are."""
    import transformers

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in LAYOUTS or not type(model).__module__.startswith("transformers."):
        return False
    return isinstance(model, getattr(transformers, LAYOUTS[model_type][0]))


def linear_from_conv1d(conv: nn.Module) -> nn.Linear:
    """An ``nn.Linear`` computing what a transformers ``Conv1D`` computes (x @ W + b, W of shape
    (in, out)): weight W^T, the same bias parameter. Built on the meta device, then given the
    converted tensors, so nothing is initialised twice."""
    weight: Any = conv.weight
    bias: Any = conv.bias
    linear = nn.Linear(weight.shape[0], weight.shape[1], device="meta", dtype=weight.dtype)
    linear.weight = nn.Parameter(weight.detach().t().contiguous(), weight.requires_grad)
    linear.bias = bias
    return linear


def interleave_qkv(tensor: torch.Tensor, n_heads: int, *, inverse: bool = False) -> torch.Tensor:
    """GPT-2's fused rows ``[q | k | v]`` reordered per head (``q_0 k_0 v_0 q_1 ...``, NeoX's
    layout; see the module doc), or back with `inverse`. Works on the weight (rows first) and
    on the bias."""
    rest = tensor.shape[1:]
    head_dim = tensor.shape[0] // (3 * n_heads)
    shape = (n_heads, 3) if inverse else (3, n_heads)
    return tensor.reshape(*shape, head_dim, *rest).transpose(0, 1).reshape(tensor.shape)


class GPT2Attention(nn.Module):
    """GPT-2's self-attention on a head-interleaved fused projection (module doc): ``c_attn``
    (column-wise under tp), the attention core, ``c_proj`` (row-wise), with GPT-2's scaling
    (``scale_attn_weights``, ``scale_attn_by_inverse_layer_idx``) and dropouts.

    Args:
        hf_attn: transformers' ``GPT2Attention`` of one block, whose modules are taken over.
    """

    def __init__(self, hf_attn: nn.Module):
        super().__init__()
        attn: Any = hf_attn
        self.head_dim, self.n_heads = attn.head_dim, attn.num_heads
        self.scaling = attn.scaling
        self.attn_dropout_p = attn.attn_dropout.p
        c_attn = linear_from_conv1d(attn.c_attn)
        c_attn.weight = nn.Parameter(interleave_qkv(c_attn.weight.detach(), self.n_heads))
        c_attn.bias = nn.Parameter(interleave_qkv(attn.c_attn.bias.detach(), self.n_heads))
        self.c_attn = c_attn
        self.c_proj = linear_from_conv1d(attn.c_proj)
        self.resid_dropout = attn.resid_dropout
        self.core = AttentionCore(num_key_value_groups=1)

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        """(attention output, None), as transformers' GPT-2 block expects; masks and caches are
        not used (training: causal attention over the whole sequence)."""
        shape = hidden_states.shape[:-1]
        qkv = self.c_attn(hidden_states).view(*shape, -1, 3 * self.head_dim).transpose(1, 2)
        q, k, v = qkv.chunk(3, dim=-1)
        dropout = self.attn_dropout_p if self.training else 0.0
        out, _ = self.core(q, k, v, None, dropout=dropout, scaling=self.scaling)
        out = self.c_proj(out.reshape(*shape, -1))
        return self.resid_dropout(out), None


class HFGPTCausalLM(HFCausalLM):
    """A transformers GPT-2 or GPT-NeoX causal LM as the Engine runs it (see the module doc).

    It is an `HFCausalLM` for the Engine (``save_pretrained``, the strategy checks) with its
    own layout, forward, plan and conversion back to transformers.

    Args:
        hf_model: a ``GPT2LMHeadModel`` or ``GPTNeoXForCausalLM`` (random or pretrained); its
            modules are taken over, GPT-2's ``Conv1D`` converted (module doc).
        seq_len: training sequence length for the ModelSpec (default the config's maximum
            positions).

    Example:
        >>> from transformers import GPT2Config, GPT2LMHeadModel              # doctest: +SKIP
        >>> cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128,
        ...                  n_positions=32)                                    # doctest: +SKIP
        >>> model = HFGPTCausalLM(GPT2LMHeadModel(cfg))                        # doctest: +SKIP
        >>> model(torch.zeros(2, 32, dtype=torch.long)).shape                 # doctest: +SKIP
        torch.Size([2, 32, 128])
    """

    base: str  # "transformer" (GPT-2) or "gpt_neox"
    layers_name: str  # "h" or "layers"

    @classmethod
    def takes(cls, model: nn.Module) -> bool:
        return is_gpt_model(model)

    def __init__(self, hf_model: nn.Module, *, seq_len: int | None = None):
        nn.Module.__init__(self)  # HFCausalLM's __init__ reads the Llama layout
        if not is_gpt_model(hf_model):
            raise SpecError(
                "HFGPTCausalLM runs transformers GPT2LMHeadModel and GPTNeoXForCausalLM; got "
                f"{type(hf_model).__name__} (model_type "
                f"{getattr(getattr(hf_model, 'config', None), 'model_type', None)!r})"
            )
        hf: Any = hf_model
        if not isinstance(getattr(hf, "lm_head", None), nn.Linear):
            raise SpecError(
                f"this {type(hf).__name__} has no `lm_head` (older transformers name GPT-NeoX's "
                "output projection embed_out); the Engine wraps the layout of transformers 5: "
                "pip install -U transformers"
            )
        if getattr(hf.config, "add_cross_attention", False):
            raise SpecError(
                "this GPT-2 has cross-attention (add_cross_attention=true, an encoder-decoder "
                "part); the Engine trains decoder-only causal LMs: build it without it"
            )
        _register_attention()
        self.hf_class = type(hf)
        self.config = _own_config(hf.config)
        _, self.base, self.layers_name = LAYOUTS[self.config.model_type]
        base = getattr(hf, self.base)
        setattr(self, self.base, base)  # registered under HF's name: HF's parameter names
        self.lm_head = hf.lm_head
        base.config = self.config
        layers = getattr(base, self.layers_name)
        if isinstance(layers, nn.ModuleList):
            setattr(
                base, self.layers_name, nn.ModuleDict({str(i): m for i, m in enumerate(layers)})
            )
        for layer in getattr(base, self.layers_name).values():
            if self.config.model_type == "gpt2":
                if not isinstance(layer.attn, GPT2Attention):
                    layer.attn = GPT2Attention(layer.attn)
                for name in ("c_fc", "c_proj"):
                    sub = getattr(layer.mlp, name)
                    if not isinstance(sub, nn.Linear):
                        setattr(layer.mlp, name, linear_from_conv1d(sub))
            else:
                attn = layer.attention
                attn.config = self.config
                if not hasattr(attn, "core"):
                    attn.core = AttentionCore(num_key_value_groups=1)
        self.spec = ModelSpec.from_hf_config(self.config, seq_len=seq_len)
        self.tied_embeddings = self.lm_head.weight is self._embedding().weight

    @property
    def model(self) -> Any:
        """The base model (``transformer`` / ``gpt_neox``), for what reads HFCausalLM.model."""
        return getattr(self, self.base)

    def _embedding(self) -> Any:
        return self.model.wte if self.config.model_type == "gpt2" else self.model.embed_in

    def sliding_window(self) -> int | None:
        return None

    def _check_strategy(self, strategy) -> list[str]:
        """The Strategy's rules for this spec (tp dividing the heads, ...). Unlike the Llama
        families, GPT-2's and GPT-NeoX's modules carry no transformers hub-kernel wrapper, so
        compile runs with every recompute kind."""
        return strategy.problems(self.spec)

    def forward(self, tokens: torch.Tensor, balance: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (batch, seq, vocab) of token ids (batch, seq); a pipeline stage maps hidden
        states to hidden states (`balance`: the base class's MoE loss sums, never given here)."""
        if self.config.model_type == "gpt2":
            h = self._gpt2_embed(tokens)
            for layer in getattr(self.model, self.layers_name).values():
                h = layer(h)
            norm = self.model.ln_f
        else:
            h = self._neox_layers(tokens)
            norm = self.model.final_layer_norm
        if norm is not None:
            h = norm(h)
        if self.lm_head is not None:
            h = self.lm_head(h)
        return h

    def _positions(self, seq: int, device: torch.device) -> torch.Tensor:
        """Global positions (1, seq) of this rank's tokens (its chunks under context parallel)."""
        cp = self.context_parallel
        positions = (
            cp.positions(seq, device) if cp is not None else torch.arange(seq, device=device)
        )
        return positions.unsqueeze(0)

    def _gpt2_embed(self, tokens: torch.Tensor) -> torch.Tensor:
        t = self.model
        if t.wte is None:  # a later pipeline stage: the previous stage's hidden states
            return tokens
        seq = tokens.shape[1]
        whole = seq * (self.context_parallel.cp if self.context_parallel is not None else 1)
        if whole > self.config.n_positions:
            raise SpecError(
                f"sequences of {whole} tokens are longer than this GPT-2's n_positions="
                f"{self.config.n_positions} learned positions; train with sequences <= "
                "n_positions"
            )
        h = t.wte(tokens) + t.wpe(self._positions(seq, tokens.device))
        return t.drop(h)

    def _neox_layers(self, tokens: torch.Tensor) -> torch.Tensor:
        m = self.model
        layers = list(getattr(m, self.layers_name).values())
        if m.embed_in is not None:
            seq = tokens.shape[1]
            h = m.emb_dropout(m.embed_in(tokens))
        else:
            h = tokens
            seq = h.shape[1] * (_sequence_shards(layers[0].input_layernorm) if layers else 1)
        positions = self._positions(seq, h.device)
        rotary = m.rotary_emb(h, position_ids=positions)
        for layer in layers:
            h = layer(h, position_embeddings=rotary, position_ids=positions)
            if isinstance(h, tuple):  # transformers 4.x layers return (hidden_states, ...)
                h = h[0]
        return h

    @torch.no_grad()
    def init_weights(self) -> None:
        """transformers' initialisation (``_init_weights``: normal(0, initializer_range) for
        linear and embedding weights, zero biases, LayerNorm ones and zeros; GPT-2's output
        projections scaled by 1/sqrt(2 * n_layer)) and the rotary tables; the Engine calls it after
        building on the meta device (``meta_init``)."""
        for p in self.parameters():
            if getattr(p, "_is_hf_initialized", False):
                p._is_hf_initialized = False  # type: ignore[attr-defined]

        def init(module: nn.Module) -> None:
            if module is not self:
                self.model._init_weights(module)
            if isinstance(module, GPT2Attention):  # transformers' branch for its GPT2Attention
                std = self.config.initializer_range / math.sqrt(2 * self.config.n_layer)
                nn.init.normal_(module.c_proj.weight, mean=0.0, std=std)

        # children first, as transformers' initialize_weights (`Module.apply`): GPT-2's MLP and
        # attention then rescale their c_proj after its nn.Linear init
        self.apply(init)
        _rebuild_rotary(self)

    # ---- what the Engine asks ------------------------------------------------------------------
    def parallel_plan(self) -> ParallelPlan:
        b = self.base
        gpt2 = self.config.model_type == "gpt2"
        return ParallelPlan(
            blocks=f"{b}.{self.layers_name}",
            first_stage=(f"{b}.wte", f"{b}.wpe") if gpt2 else (f"{b}.embed_in",),
            last_stage=(f"{b}.ln_f" if gpt2 else f"{b}.final_layer_norm", "lm_head"),
            tp_plan=self.tp_plan,
            attention_core="attn.core" if gpt2 else "attention.core",
            check=self._check_strategy,
        )

    def tp_plan(self, *, sequence_parallel: bool, loss_parallel: bool) -> dict:  # type: ignore[override]
        """Megatron-style plan with sequence parallel on the two families' module names: the
        fused q/k/v and the MLP up-projection column-wise (whole heads per rank, module doc),
        the attention and MLP output projections row-wise, token (and GPT-2's position)
        embeddings by rows, ``lm_head`` by vocabulary columns, ``SequenceParallel`` on the
        LayerNorms."""
        from torch.distributed.tensor.parallel import SequenceParallel

        from autosearch.models.hf.tp_plans import column_row_entries, gather_input, vocab_entries

        sp = sequence_parallel
        b, layer = self.base, f"{self.base}.{self.layers_name}.*."
        gpt2 = self.config.model_type == "gpt2"
        attn, qkv, out = (
            ("attn", "c_attn", "c_proj") if gpt2 else ("attention", "query_key_value", "dense")
        )
        up, down = ("c_fc", "c_proj") if gpt2 else ("dense_h_to_4h", "dense_4h_to_h")
        embeddings = (f"{b}.wte", f"{b}.wpe") if gpt2 else (f"{b}.embed_in",)
        plan: dict = {
            **vocab_entries(*embeddings, sequence_parallel=sp, loss_parallel=loss_parallel),
            **column_row_entries(f"{layer}{attn}.", (qkv,), out, sequence_parallel=sp),
            **column_row_entries(f"{layer}mlp.", (up,), down, sequence_parallel=sp),
        }
        if sequence_parallel:
            norms = ("ln_1", "ln_2") if gpt2 else ("input_layernorm", "post_attention_layernorm")
            plan[f"{b}.ln_f" if gpt2 else f"{b}.final_layer_norm"] = SequenceParallel()
            for norm in norms:
                plan[layer + norm] = SequenceParallel()
            for sub in (attn, "mlp"):  # both families pass the input by position
                plan[layer + sub] = gather_input()
        return plan

    # ---- back to transformers ------------------------------------------------------------------
    def hf_model(self, state_dict: dict[str, torch.Tensor] | None = None) -> Any:
        """A plain transformers model of the same class and config holding `state_dict` (full
        tensors with this module's names, as ``Engine.save(path, training=False)`` writes them) or
        this module's weights; GPT-2's converted weights go back to ``Conv1D``'s layout."""
        state = dict(state_dict if state_dict is not None else self.state_dict())
        if self.config.model_type == "gpt2":
            for key in list(state):
                parts = key.split(".")
                if parts[-2] not in ("c_attn", "c_proj", "c_fc"):
                    continue
                tensor = state[key]
                if parts[-2] == "c_attn":
                    tensor = interleave_qkv(tensor, self.config.n_head, inverse=True)
                state[key] = tensor.t().contiguous() if parts[-1] == "weight" else tensor
        return super().hf_model(state)


def _own_config(config: Any) -> Any:
    """A copy of the config whose attention kernel is the attention core's (the caller's config
    keeps its own)."""
    import copy

    config = copy.deepcopy(config)
    config._attn_implementation = ATTN_IMPLEMENTATION
    return config
