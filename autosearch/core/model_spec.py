"""ModelSpec: the shape of a decoder-only transformer, and the catalog of real models.

Two styles, chosen by `ffn_activation`, matching the reference transformer in
`autosearch.models.transformer` and the published architectures:

* ``gelu``  -> GPT style (Radford et al. 2019; Brown et al. 2020): LayerNorm with bias, biases in
  every linear layer, learned position embeddings, dropout.
* ``swiglu`` -> Llama style (Touvron et al. 2023): RMSNorm, no biases, rotary positions, no
dropout,
  gated MLP with three matrices.

Example:
    >>> from autosearch import ModelSpec
    >>> m = ModelSpec.load("gpt3-175b")
    >>> round(m.n_params / 1e9, 1)
    174.6
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
import re
from dataclasses import dataclass
from importlib import resources
from typing import Any

import yaml

from autosearch.core._io import check_keys, check_name, name_from, positive_int, read_yaml_mapping
from autosearch.core._lora import LoraSpec
from autosearch.core._moe import MLASpec, MoESpec
from autosearch.core._ssm import GatedDeltaNetSpec, Mamba1Spec, MambaSpec
from autosearch.core.errors import SpecError
from autosearch.core.layers import ATTENDING, Layer, parse_pattern, pattern_of

FFN_ACTIVATIONS = ("gelu", "swiglu", "geglu", "relu2")
GATED_ACTIVATIONS = ("swiglu", "geglu")  # three matrices: act(x W1) * (x W3), then W2
POSITION_EMBEDDINGS = ("learned", "rotary", "alibi")
_HEAD_DIM_LIMIT = 1 << 16
_MTP_LIMIT = 64  # prediction depths; DeepSeek-V3 trains 1


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A decoder-only transformer, by the numbers that decide its cost.

    Args:
        name: a label (catalog names are lowercase with hyphens: ``llama3-8b``): letters, digits
            and ``._+=-/``, as it is written into scripts and configs (`_io.check_name`).
        n_layers: transformer blocks.
        hidden_size: model width h.
        n_heads: attention heads a.
        n_kv_heads: key/value heads (grouped-query attention); defaults to ``n_heads``.
        ffn_hidden_size: MLP width (of the dense layers of a MoE model); defaults to
            ``4 * hidden_size``.
        ffn_activation: ``gelu`` (GPT style, two matrices), ``swiglu`` (Llama style, gated, three
            matrices), ``geglu`` (Gemma: gated like SwiGLU with a tanh GELU, three matrices) or
            ``relu2`` (squared ReLU, Nemotron: two matrices, no gate).
        vocab_size: vocabulary V.
        seq_len: training sequence length s.
        tied_embeddings: the output projection shares the input embedding matrix.
        position_embedding: ``learned`` (GPT), ``rotary`` (Llama) or ``alibi`` (MPT: no
            parameters, a bias on the attention scores); defaults by `ffn_activation`.
        linear_bias: biases in the linear layers and norms; defaults to GPT style.
        dropout: dropout after attention and MLP (it stores masks); defaults to GPT style.
        head_dim: channels per attention head; defaults to ``hidden_size / n_heads``. Give it
            where heads x head_dim is not the width (Gemma, Mistral-Nemo, Qwen3).
        sliding_window: keys a query attends to in the sliding-window layers (Mistral v0.1 4096,
            Gemma 2 4096, Gemma 3 1024); None: full attention everywhere.
        sliding_window_pattern: which layers slide: None, every layer (Mistral v0.1, Phi-3);
            p >= 2, every p-th layer (layers p-1, 2p-1, ...) attends globally and the others
            within the window (Gemma 2 and gpt-oss 2, Gemma 3 6).
        attn_logit_softcapping: attention scores pass through c * tanh(scores / c) (Gemma 2: 50).
        final_logit_softcapping: the same on the output logits (Gemma 2: 30).
        moe: the mixture-of-experts MLP (`MoESpec`), or None for a dense model.
        mla: DeepSeek's multi-head latent attention (`MLASpec`), or None for multi-head /
            grouped-query attention.
        lora: low-rank adapters on a frozen model (`LoraSpec`: rank, targets), or None to
            train every weight.
        mtp_layers: multi-token prediction modules trained with the model (DeepSeek-V3 tech
            report, sec. 2.2: D = 1; Hugging Face ``num_nextn_predict_layers``; Megatron
            ``--mtp-num-layers``). Each is one more block of the last layer's kind, a norm and
            2h -> h projection and a second output head with its loss, on the last pipeline
            stage, sharing the embedding and output matrices (the last stage keeps an embedding
            copy under pp). Priced only under a runtime that trains it (`RuntimeOptions.mtp`);
            0: none.
        layer_pattern: the blocks in Megatron-Core's hybrid layer pattern (`layers`: ``*``
            attention, ``M`` Mamba-2, ``G`` Gated DeltaNet, ``P`` attention and Mamba-2 in
            parallel, ``-`` dense MLP, ``E`` mixture of experts; ``*-*E*E`` is a dense layer
            then two MoE layers), one block per layer: which MLPs are MoE and which mixers are
            not attention. None: every block is
            attention with the MLP `moe` says (`moe.first_dense_layers`, `moe.layer_step`).
        mamba: the Mamba-2 mixer of the ``M`` blocks and of the ``P`` blocks' Mamba-2 part
            (`MambaSpec`), or None for a model without them.
        gdn: the Gated DeltaNet mixer of the ``G`` blocks (`GatedDeltaNetSpec`), or None.
        mamba1: the Mamba-1 mixer of the ``S`` blocks (`Mamba1Spec`: Jamba's), or None.
        attention_output_gate: the attention output is multiplied by sigmoid(x W_g) before
            the output projection, W_g an h x (heads x head_dim) projection beside Q's (Qwen3-Next
            and Qwen3.5: Hugging Face ``Qwen3NextAttention.q_proj`` is twice the query width;
            Qiu et al. 2025, "Gated Attention for Large Language Models", G1). Priced as that
            projection's FLOPs and parameters and the gate's elementwise pass.
    """

    name: str = "custom"
    n_layers: int
    hidden_size: int
    n_heads: int
    n_kv_heads: int = None  # type: ignore[assignment]  # None: n_heads, set in __post_init__
    ffn_hidden_size: int = None  # type: ignore[assignment]  # None: 4 * hidden_size
    ffn_activation: str = "gelu"
    vocab_size: int
    seq_len: int
    tied_embeddings: bool = False
    position_embedding: str = None  # type: ignore[assignment]  # None: by ffn_activation
    linear_bias: bool = None  # type: ignore[assignment]  # None: GPT style (gelu)
    dropout: bool = None  # type: ignore[assignment]  # None: GPT style (gelu)
    head_dim: int = None  # type: ignore[assignment]  # None: hidden_size / n_heads
    sliding_window: int | None = None
    sliding_window_pattern: int | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    moe: MoESpec | None = None
    mla: MLASpec | None = None
    lora: LoraSpec | None = None
    mtp_layers: int = 0
    layer_pattern: str | None = None
    mamba: MambaSpec | None = None
    gdn: GatedDeltaNetSpec | None = None
    attention_output_gate: bool = False
    mamba1: Mamba1Spec | None = None

    def __post_init__(self) -> None:
        check_name(self.name, "model name")
        problems = []
        gpt = self.ffn_activation == "gelu"
        for name, fallback in (
            ("position_embedding", "learned" if gpt else "rotary"),
            ("linear_bias", gpt),
            ("dropout", gpt),
        ):
            if getattr(self, name) is None:
                object.__setattr__(self, name, fallback)
        if self.position_embedding not in POSITION_EMBEDDINGS:
            problems.append(
                f"position_embedding must be one of {POSITION_EMBEDDINGS}, "
                f"got {self.position_embedding!r}"
            )
        for name in ("linear_bias", "dropout"):
            if not isinstance(getattr(self, name), bool):
                problems.append(f"{name} must be true or false, got {getattr(self, name)!r}")
        for name in ("n_layers", "hidden_size", "n_heads", "vocab_size", "seq_len"):
            try:
                object.__setattr__(self, name, positive_int(getattr(self, name), name))
            except SpecError as exc:
                problems.append(str(exc))
        defaults: tuple[tuple[str, int | None], ...] = (
            ("n_kv_heads", self.n_heads),
            (
                "ffn_hidden_size",
                4 * self.hidden_size if isinstance(self.hidden_size, int) else None,
            ),
        )
        for name, default in defaults:
            value = getattr(self, name)
            if value is None:
                object.__setattr__(self, name, default)
            else:
                try:
                    object.__setattr__(self, name, positive_int(value, name))
                except SpecError as exc:
                    problems.append(str(exc))
        if self.ffn_activation not in FFN_ACTIVATIONS:
            problems.append(
                f"ffn_activation must be one of {FFN_ACTIVATIONS}, got {self.ffn_activation!r}"
            )
        try:
            value = positive_int(self.mtp_layers, "mtp_layers", minimum=0, maximum=_MTP_LIMIT)
            object.__setattr__(self, "mtp_layers", value)
        except SpecError as exc:
            problems.append(
                str(exc) + " (multi-token prediction modules trained with the model: DeepSeek-V3"
                " 1; 0 for none)"
            )
        if not isinstance(self.tied_embeddings, bool):
            problems.append(f"tied_embeddings must be true or false, got {self.tied_embeddings!r}")
        if not isinstance(self.attention_output_gate, bool):
            problems.append(
                f"attention_output_gate must be true or false, got {self.attention_output_gate!r}"
            )
        elif self.attention_output_gate and self.mla is not None:
            problems.append(
                "attention_output_gate with mla is not modelled (the gate is a projection beside "
                "Q's, which latent attention does not have); drop one"
            )
        problems += self._check_variants()
        if not problems:
            explicit_head = self.head_dim is not None
            if not explicit_head and self.hidden_size % self.n_heads:
                problems.append(
                    f"hidden_size {self.hidden_size} must be a multiple of n_heads {self.n_heads} "
                    "(head size = hidden_size / n_heads), or give head_dim"
                )
            elif not explicit_head:
                object.__setattr__(self, "head_dim", self.hidden_size // self.n_heads)
            if self.n_heads % self.n_kv_heads:
                problems.append(
                    f"n_heads {self.n_heads} must be a multiple of n_kv_heads {self.n_kv_heads} "
                    "(each key/value head serves a whole group of query heads)"
                )
            if self.moe is not None:
                try:
                    moe = self.moe.check(
                        n_layers=self.n_layers, ffn_hidden_size=self.ffn_hidden_size
                    )
                    object.__setattr__(self, "moe", moe)
                except SpecError as exc:
                    problems += exc.problems
            if self.mla is not None:
                try:
                    self.mla.check()
                except SpecError as exc:
                    problems += exc.problems
            for mixer in (self.mamba, self.gdn, self.mamba1):
                if mixer is not None:
                    try:
                        mixer.check()
                    except SpecError as exc:
                        problems += exc.problems
            if self.layer_pattern is not None and not problems:
                problems += self._check_pattern()
            elif not problems:
                for name, symbol, what in _MIXER_SPECS:
                    if getattr(self, name) is not None:
                        problems.append(
                            f"the model has a {name} block but no layer_pattern saying which "
                            f"layers are {what} ({symbol}); give one, or drop {name}"
                        )
            if self.lora is not None and not problems:
                problems += self._check_lora()
        if problems:
            raise SpecError(problems, context=f"model {self.name!r}")

    def _check_pattern(self) -> list[str]:
        """`layer_pattern` against the other fields: one block per layer, ``E`` where and only
        where there is a `moe`, and a `moe` placement that says the same or nothing."""
        try:
            blocks = parse_pattern(self.layer_pattern)  # type: ignore[arg-type]
        except SpecError as exc:
            return exc.problems
        problems = []
        if len(blocks) != self.n_layers:
            problems.append(
                f"layer_pattern {self.layer_pattern[:40]!r} has {len(blocks)} blocks (a mixer "  # type: ignore[index]
                f"symbol with the MLP symbol after it, or either alone) but n_layers is "
                f"{self.n_layers}; give one block per layer"
            )
        for name, symbol, what in _MIXER_SPECS:
            has = any(name in _SPECS_OF.get(mixer, ()) for mixer, _ in blocks)
            if has and getattr(self, name) is None:
                problems.append(
                    f"layer_pattern has {what} mixers ({symbol}) but the model has no {name} "
                    f"block; describe them under {name} ({_MIXER_FIELDS[name]})"
                )
            elif getattr(self, name) is not None and not has:
                problems.append(
                    f"the model has a {name} block but its layer_pattern no {symbol} ({what} "
                    f"mixer); mark those layers {symbol}, or drop {name}"
                )
        has_moe = any(mlp == "moe" for _, mlp in blocks)
        if has_moe and self.moe is None:
            problems.append(
                "layer_pattern has mixture-of-experts MLPs (E) but the model has no moe block; "
                "describe the experts under moe, or write - for dense MLPs"
            )
        elif self.moe is not None and not has_moe:
            problems.append(
                "the model has a moe block but its layer_pattern no E (mixture-of-experts MLP); "
                "mark the MoE layers E, or drop moe"
            )
        elif self.moe is not None and not problems:
            placed = (self.moe.first_dense_layers, self.moe.layer_step) != (0, 1)
            if placed and self._moe_flags_from_fields() != tuple(m == "moe" for _, m in blocks):
                problems.append(
                    f"moe.first_dense_layers {self.moe.first_dense_layers} and moe.layer_step "
                    f"{self.moe.layer_step} place the MoE layers elsewhere than layer_pattern "
                    "does; drop them (the pattern says where the experts are)"
                )
        return problems

    def _check_lora(self) -> list[str]:
        """The adapters, resolved for this model (`LoraSpec.check`)."""
        if self.moe is not None or self.mla is not None:
            return [
                "lora on a mixture-of-experts or latent-attention model is not described (its "
                "adapters would sit on experts or latent projections); drop lora, or describe "
                "a dense model"
            ]
        try:
            object.__setattr__(self, "lora", self.lora.check(self))  # type: ignore[union-attr]
        except SpecError as exc:
            return exc.problems
        return []

    def _check_variants(self) -> list[str]:
        """The attention variants: head_dim, sliding windows, soft-capping, and the nested
        specs' types (their own fields are checked by `MoESpec.check` / `MLASpec.check`)."""
        problems = []
        if self.head_dim is not None:
            try:
                value = positive_int(self.head_dim, "head_dim", maximum=_HEAD_DIM_LIMIT)
                object.__setattr__(self, "head_dim", value)
            except SpecError as exc:
                problems.append(str(exc))
        if self.sliding_window is not None:
            try:
                positive_int(self.sliding_window, "sliding_window", maximum=1 << 24)
            except SpecError as exc:
                problems.append(str(exc) + " (tokens a query attends to; null: full attention)")
        pattern = self.sliding_window_pattern
        if pattern is not None:
            if self.sliding_window is None:
                problems.append(
                    f"sliding_window_pattern = {pattern!r} needs a sliding_window (the window "
                    "size in tokens); give one, or drop the pattern"
                )
            elif pattern == 1:
                problems.append(
                    "sliding_window_pattern = 1 would make every layer global (no window); drop "
                    "sliding_window instead, or give a pattern >= 2 (every p-th layer global)"
                )
            else:
                try:
                    positive_int(pattern, "sliding_window_pattern", minimum=2, maximum=1 << 16)
                except SpecError as exc:
                    problems.append(
                        str(exc) + " (every p-th layer attends globally; null: every layer slides)"
                    )
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            cap = getattr(self, name)
            if cap is not None and (
                isinstance(cap, bool)
                or not isinstance(cap, (int, float))
                or not math.isfinite(cap)
                or cap <= 0
            ):
                problems.append(
                    f"{name} must be a number > 0 (scores become c * tanh(scores / c)), or null "
                    f"for none; got {cap!r}"
                )
            elif cap is not None:
                object.__setattr__(self, name, float(cap))
        what = f"model {self.name!r}"
        nested = (
            ("moe", MoESpec),
            ("mla", MLASpec),
            ("lora", LoraSpec),
            ("mamba", MambaSpec),
            ("gdn", GatedDeltaNetSpec),
            ("mamba1", Mamba1Spec),
        )
        for name, kind in nested:
            value = getattr(self, name)
            if value is not None and not isinstance(value, kind):
                try:
                    object.__setattr__(self, name, kind.from_value(value, what=what))
                except SpecError as exc:
                    problems.append(str(exc).removeprefix(f"{what}: "))
        return problems

    # ---- derived shape -------------------------------------------------------------------------
    @property
    def is_gpt_style(self) -> bool:
        """GPT style (gelu, biases, LayerNorm, learned positions, dropout) vs Llama style."""
        return self.ffn_activation == "gelu"

    @property
    def ffn_gated(self) -> bool:
        """A gated MLP (SwiGLU, GeGLU): act(x W1) * (x W3) W2, three matrices."""
        return self.ffn_activation in GATED_ACTIVATIONS

    @property
    def attention_hidden_size(self) -> int:
        """Width of the queries and of the attention output, n_heads * head_dim (= hidden_size
        unless head_dim is given)."""
        return self.n_heads * self.head_dim

    @property
    def kv_hidden_size(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def n_ffn_matrices(self) -> int:
        return 3 if self.ffn_gated else 2

    @property
    def attention_gate_width(self) -> int:
        """Width of the attention's output gate projection: heads x head_dim with
        `attention_output_gate`, else 0."""
        return self.attention_hidden_size if self.attention_output_gate else 0

    @property
    def attention_matmul_params(self) -> int:
        """Weights of the attention's projections: QKV (and the output gate's), output (or
        MLA's, `MLASpec`)."""
        h, q = self.hidden_size, self.attention_hidden_size
        if self.mla is not None:
            return self.mla.matmul_params(h, self.n_heads)
        return h * (q + self.attention_gate_width + 2 * self.kv_hidden_size) + q * h

    @property
    def layer_matmul_params(self) -> int:
        """Weights of the matrix multiplies of one dense block (QKV, output projection, MLP)."""
        h, f = self.hidden_size, self.ffn_hidden_size
        return self.attention_matmul_params + self.n_ffn_matrices * h * f

    @property
    def _norm_and_bias_params(self) -> int:
        """Norms (and GPT-style biases) of one block besides the MLP's biases."""
        h = self.hidden_size
        mla_norms = self.mla.norm_params if self.mla is not None else 0
        if self.linear_bias:
            # QKV and output biases, two LayerNorms with weight and bias
            return (self.attention_hidden_size + 2 * self.kv_hidden_size) + h + 4 * h + mla_norms
        return 2 * h + mla_norms  # two norm weights (RMSNorm, or LayerNorm without bias)

    @property
    def layer_params(self) -> int:
        """All parameters of one dense block, biases and norms included.

        GPT style: 12h^2 + 13h for ffn = 4h (Narayanan et al. 2021, sec. 3: P = 12lh^2(1 + 13/(12h)
        + ...)).
        """
        h, f = self.hidden_size, self.ffn_hidden_size
        n = self.layer_matmul_params
        if self.linear_bias:
            return n + self._norm_and_bias_params + (self.n_ffn_matrices - 1) * f + h
        return n + self._norm_and_bias_params

    # ---- mixture of experts --------------------------------------------------------------------
    @functools.cached_property
    def layers(self) -> tuple[Layer, ...]:
        """The model as a sequence of blocks, each a mixer and an MLP (`autosearch.core.layers`):
        from `layer_pattern`, else attention everywhere with the MLPs `moe` places, each
        attention layer with the keys its window leaves (`attention_keys`)."""
        keys = self.attention_keys
        if self.layer_pattern is not None:
            blocks = parse_pattern(self.layer_pattern)
        else:
            blocks = tuple(
                ("attention", "moe" if moe else "dense") for moe in self._moe_flags_from_fields()
            )
        return tuple(
            Layer(mixer, mlp, keys[i] if mixer in ATTENDING else None)
            for i, (mixer, mlp) in enumerate(blocks)
        )

    @property
    def pattern(self) -> str:
        """The layers in Megatron's hybrid pattern (``*-*E*E...``): `layer_pattern` as given,
        or as the fields describe them."""
        return pattern_of(self.layers)

    def _moe_flags_from_fields(self) -> tuple[bool, ...]:
        moe = self.moe
        if moe is None:
            return (False,) * self.n_layers
        return tuple(
            i >= moe.first_dense_layers and (i + 1) % moe.layer_step == 0
            for i in range(self.n_layers)
        )

    @property
    def moe_layers(self) -> tuple[bool, ...]:
        """For each layer, whether its MLP is a mixture of experts (`layers`; without a
        `layer_pattern`, `MoESpec`'s placement: Hugging Face's layer convention)."""
        return tuple(layer.mlp == "moe" for layer in self.layers)

    @property
    def n_moe_layers(self) -> int:
        return sum(self.moe_layers)

    def _expert_params(self, n_routed: int) -> int:
        """Router, `n_routed` routed experts and the shared experts of one MoE layer (matrices;
        the MLP biases of a GPT-style expert are not counted)."""
        moe, h, m = self.moe, self.hidden_size, self.n_ffn_matrices
        assert moe is not None  # callers check
        routed = n_routed * m * h * moe.ffn_hidden_size
        shared = moe.n_shared_experts * m * h * moe.shared_ffn_hidden_size
        return h * moe.n_experts + routed + shared  # the router: h x n_experts

    @property
    def moe_layer_params(self) -> int:
        """All parameters of one MoE block: attention, norms, router, every routed and shared
        expert (Megatron-Core MoELayer; Hugging Face MixtralSparseMoeBlock and
        DeepseekV3MoE)."""
        if self.moe is None:
            return 0
        return (
            self.attention_matmul_params
            + self._norm_and_bias_params
            + self._expert_params(self.moe.n_experts)
        )

    @property
    def moe_layer_active_params(self) -> int:
        """Parameters one token goes through in a MoE block: attention, norms, router, its
        top-k routed experts and the shared ones."""
        if self.moe is None:
            return 0
        return (
            self.attention_matmul_params
            + self._norm_and_bias_params
            + self._expert_params(self.moe.top_k)
        )

    # ---- blocks of every kind ------------------------------------------------------------------
    # Each Megatron layer (a mixer, or an MLP) has its own pre-norm (Megatron-Core
    # ``mamba_block.py`` / ``transformer_layer.py``; Hugging Face ``NemotronHBlock.norm``), so a
    # block's parameters are its mixer's and its MLP's, each with its norm: an attention + dense
    # block sums to `layer_params`, an attention + MoE block to `moe_layer_params`.
    def _mixer_params(self, mixer: str) -> int:
        """Parameters of a mixer with its pre-norm (and, GPT style, its biases)."""
        h = self.hidden_size
        if mixer == "attention":
            return self.attention_matmul_params + self._norm_and_bias_params - self._mlp_norm
        if mixer in ("mamba", "gdn", "mamba1"):
            spec = getattr(self, mixer)
            assert spec is not None  # __post_init__ checks
            return spec.params(h) + self._mlp_norm
        if mixer == "attention+mamba":  # one pre-norm, both mixers (FalconH1DecoderLayer)
            assert self.mamba is not None  # __post_init__ checks
            return self._mixer_params("attention") + self.mamba.params(h)
        return 0

    @property
    def _mlp_norm(self) -> int:
        """One pre-norm: RMSNorm's weight, or LayerNorm's weight and bias."""
        return 2 * self.hidden_size if self.linear_bias else self.hidden_size

    def _mlp_params(self, mlp: str, *, active: bool) -> int:
        """Parameters of an MLP with its pre-norm: the dense MLP's matrices and biases, or a
        MoE MLP's router and experts (`active`: those a token goes through)."""
        h, f = self.hidden_size, self.ffn_hidden_size
        if mlp == "dense":
            bias = (self.n_ffn_matrices - 1) * f + h if self.linear_bias else 0
            return self.n_ffn_matrices * h * f + bias + self._mlp_norm
        if mlp == "moe":
            assert self.moe is not None  # __post_init__ checks
            return self._expert_params(self.moe.top_k if active else self.moe.n_experts) + (
                self._mlp_norm
            )
        return 0

    def block_params(self, layer: Layer, *, active: bool = False) -> int:
        """All parameters of one block of `layers` (`active`: a MoE MLP's top-k experts)."""
        return self._mixer_params(layer.mixer) + self._mlp_params(layer.mlp, active=active)

    def block_matmul_params(self, layer: Layer) -> int:
        """Weights of the matrix multiplies a token goes through in one block: the attention's
        projections or Mamba's in / out projections, the dense MLP or the router, top-k routed
        and shared experts."""
        if layer.mixer == "attention":
            mixer = self.attention_matmul_params
        elif layer.mixer in ("mamba", "gdn", "mamba1"):
            mixer = getattr(self, layer.mixer).matmul_params(self.hidden_size)
        elif layer.mixer == "attention+mamba":
            mixer = self.attention_matmul_params + self.mamba.matmul_params(self.hidden_size)  # type: ignore[union-attr]
        else:
            mixer = 0
        if layer.mlp == "dense":
            return mixer + self.n_ffn_matrices * self.hidden_size * self.ffn_hidden_size
        if layer.mlp == "moe":
            return mixer + self._expert_params(self.moe.top_k)  # type: ignore[union-attr]
        return mixer

    @functools.cached_property
    def _kind_counts(self) -> tuple[tuple[Layer, int], ...]:
        """Each kind of block (without keys) and how many blocks are of it."""
        counts: dict[Layer, int] = {}
        for layer in self.layers:
            key = Layer(layer.mixer, layer.mlp)
            counts[key] = counts.get(key, 0) + 1
        return tuple(counts.items())

    @functools.cached_property
    def attended_keys(self) -> int:
        """Keys a token's queries attend to, summed over the attention blocks and the
        multi-token prediction modules (each one block of the last layer's kind): the keys
        `flops_per_token` counts scores and values over. Mamba and Gated DeltaNet blocks attend
        to none."""
        blocks = sum(layer.keys or 0 for layer in self.layers if layer.mixer in ATTENDING)
        last = self.layers[-1]
        return blocks + self.mtp_layers * (last.keys or 0 if last.mixer in ATTENDING else 0)

    def _blocks_sum(self, per_kind: "Any") -> int:
        """Sum of `per_kind(layer)` over the blocks, once per kind of block."""
        return sum(n * per_kind(layer) for layer, n in self._kind_counts)

    # ---- sliding windows -----------------------------------------------------------------------
    @property
    def attention_keys(self) -> tuple[int, ...]:
        """For each layer, the keys a query attends to at most: ``seq_len``, or
        ``min(sliding_window, seq_len)`` in a sliding-window layer."""
        s, w, p = self.seq_len, self.sliding_window, self.sliding_window_pattern
        if w is None or w >= s:
            return (s,) * self.n_layers
        return tuple(s if p is not None and (i + 1) % p == 0 else w for i in range(self.n_layers))

    @property
    def sliding_layers(self) -> int:
        """Layers whose window is shorter than the sequence."""
        return sum(k < self.seq_len for k in self.attention_keys)

    # ---- totals --------------------------------------------------------------------------------
    @property
    def embedding_params(self) -> int:
        """Token embedding (+ learned positions)."""
        learned = self.position_embedding == "learned"
        positions = self.seq_len * self.hidden_size if learned else 0
        return self.vocab_size * self.hidden_size + positions

    @property
    def head_params(self) -> int:
        """Final norm and, if untied, the output projection."""
        norm = 2 * self.hidden_size if self.linear_bias else self.hidden_size
        return norm + (0 if self.tied_embeddings else self.vocab_size * self.hidden_size)

    @property
    def mtp_layer_params(self) -> int:
        """Parameters of one multi-token prediction module besides the embedding and output
        matrices it shares with the model: a block of the last layer's kind, its two input
        norms and final norm, and the 2h -> h projection (Megatron-Core
        ``MultiTokenPredictionLayer``: enorm, hnorm, eh_proj, the layer, final_layernorm;
        DeepSeek-V3 tech report, sec. 2.2, eq. 21)."""
        h = self.hidden_size
        return self.block_params(self.layers[-1]) + 3 * h + 2 * h * h

    @property
    def n_params(self) -> int:
        """All parameters: every block (each expert of a MoE block), embeddings and head.

        The multi-token prediction modules are not counted (`mtp_layer_params`), as the
        published sizes leave them out (DeepSeek-V3: 671B, the 14B of its MTP module apart).
        """
        blocks = self._blocks_sum(self.block_params)
        return blocks + self.embedding_params + self.head_params

    @property
    def n_active_params(self) -> int:
        """Parameters one token uses: `n_params` less the routed experts a token does not go
        to (embeddings and head included, as in Mixtral's "13B active" and DeepSeek-V3's "37B
        activated"). Equal to `n_params` for a dense model."""
        blocks = self._blocks_sum(functools.partial(self.block_params, active=True))
        return blocks + self.embedding_params + self.head_params

    def flops_per_token(self, *, training: bool = True) -> float:
        """Model FLOPs per token, counting matrix multiplies only (the usual MFU convention).

        Forward: 2 FLOPs per weight of every block matmul a token goes through and of the
        logits, plus the attention scores and weighted sum, 2 * s_k * (d_qk + d_v) * n_heads per
        layer where s_k is the keys a query attends to (`attention_keys`: full, not
        causal-halved; a sliding window caps it). Training is 3x forward. For GPT shapes this is
        Narayanan et al. 2021 eq. (3) without recompute: 72 B s l h^2 (1 + s/(6h) + V/(12 l h))
        per batch of B sequences; PaLM's 6N + 12 l h s. With `lora`, training counts the
        frozen GEMMs twice (forward, input gradient) and the attention core three times, as
        NeMo's LoRA rows do. A MoE layer counts its router and the
        top-k routed and shared experts, not all experts (Megatron-LM
        ``num_floating_point_operations``; DeepSeek-V3 tech report, sec. 3.1: 37B activated
        parameters per token); MLA counts its five projections (DeepSeek-V2 eqs. 9-19) and
        scores over qk_nope + qk_rope channels, values over v_head_dim. Each multi-token
        prediction module (`mtp_layers`) counts one more block of the last layer's kind, its
        2h -> h projection and its output head (Megatron-Bridge
        ``num_floating_point_operations`` counts MTP so).
        """
        if self.mla is not None:
            per_key = self.n_heads * (self.mla.qk_head_dim + self.mla.v_head_dim)
        else:
            per_key = 2 * self.attention_hidden_size
        matmuls = self._blocks_sum(self.block_matmul_params)
        h = self.hidden_size
        last = self.block_matmul_params(self.layers[-1])  # an MTP module's block
        matmuls += self.mtp_layers * (last + 2 * h * h + self.vocab_size * h)
        gemms = 2 * matmuls + 2 * self.vocab_size * h
        attention = 2 * per_key * self.attended_keys
        # the scans (Megatron-LM / Megatron-Bridge counts; Mamba-1's `Mamba1Spec`)
        for name in ("mamba", "gdn", "mamba1"):
            spec = getattr(self, name)
            if spec is not None:
                n_blocks = sum(
                    n for layer, n in self._kind_counts if name in _SPECS_OF.get(layer.mixer, ())
                )
                attention += n_blocks * spec.scan_flops_per_token
        if training and self.lora is not None:
            # LoRA, as Megatron-Bridge counts it (training/utils/flop_utils.py, its LoRA branch):
            # the frozen GEMMs run forward and input gradient only, 2/3 of 3x; the attention
            # core its whole backward; the adapters are not counted.
            return 2.0 * gemms + 3.0 * attention
        forward = gemms + attention
        return 3.0 * forward if training else float(forward)

    def describe(self) -> str:
        """The model in one line, for summaries: its name, parameters (and, with experts, those
        a token uses: `n_active_params`), layers, experts and top-k, and sequence length.

        Example:
            >>> print(ModelSpec.load("mixtral-8x7b").describe())
            mixtral-8x7b: 46.7 B parameters (12.9 B active), 32 layers, 8 experts top-2, seq 32,768
        """
        parts = [f"{_in_units(self.n_params)} parameters"]
        if self.n_active_params != self.n_params:
            parts[0] += f" ({_in_units(self.n_active_params)} active)"
        layers = f"{self.n_layers} layers"
        if any("none" in layer.kind for layer in self.layers):  # a mixer or an MLP alone
            layers += f" ({len(self.pattern)} in Megatron's hybrid pattern)"
        parts.append(layers)
        if self.moe is not None:
            shared = self.moe.n_shared_experts
            parts.append(
                f"{self.moe.n_experts} experts top-{self.moe.top_k}"
                + (f" + {shared} shared" if shared else "")
            )
        parts.append(f"seq {self.seq_len:,}")
        return f"{self.name}: {', '.join(parts)}"

    # ---- loading -------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any], *, what: str = "model") -> "ModelSpec":
        """A ModelSpec from a mapping of its fields (``moe`` and ``mla`` as nested mappings)."""
        kwargs = check_keys(data, cls, what=what)
        missing = [
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.name not in kwargs
        ]
        if missing:
            raise SpecError(f"{what}: missing required key(s) {', '.join(missing)}")
        if kwargs.get("moe") is not None:
            kwargs["moe"] = MoESpec.from_value(kwargs["moe"], what=what)
        if kwargs.get("mla") is not None:
            kwargs["mla"] = MLASpec.from_value(kwargs["mla"], what=what)
        if kwargs.get("lora") is not None:
            kwargs["lora"] = LoraSpec.from_value(kwargs["lora"], what=what)
        if kwargs.get("mamba") is not None:
            kwargs["mamba"] = MambaSpec.from_value(kwargs["mamba"], what=what)
        if kwargs.get("gdn") is not None:
            kwargs["gdn"] = GatedDeltaNetSpec.from_value(kwargs["gdn"], what=what)
        if kwargs.get("mamba1") is not None:
            kwargs["mamba1"] = Mamba1Spec.from_value(kwargs["mamba1"], what=what)
        return cls(**kwargs)

    @classmethod
    def from_hf_config(
        cls, source, *, name: str | None = None, seq_len: int | None = None
    ) -> "ModelSpec":
        """A ModelSpec from a Hugging Face config.json (or its folder), dict or PretrainedConfig
        (`autosearch.core.hf_config`): the keys it leaves out take transformers' defaults, and a
        key its family does not know warns (`UnknownConfigKeyWarning`). Without `seq_len`, the
        config's maximum positions are the training length, with a `LongSequenceWarning` above
        32,768 tokens."""
        from autosearch.core.hf_config import spec_fields

        fields = spec_fields(source, name=name, seq_len=seq_len)
        for key, kind in (
            ("moe", MoESpec),
            ("mla", MLASpec),
            ("mamba", MambaSpec),
            ("gdn", GatedDeltaNetSpec),
            ("mamba1", Mamba1Spec),
        ):
            if fields.get(key) is not None:
                fields[key] = kind(**fields[key])
        return cls(**fields)

    @classmethod
    def load(
        cls,
        name_or_path: "str | os.PathLike | ModelSpec",
        *,
        seq_len: int | None = None,
        lora: "LoraSpec | dict | None" = None,
    ) -> "ModelSpec":
        """A catalog model by name (``llama3-70b``), a YAML file with the fields above, or a
        Hugging Face ``config.json`` or the model's folder holding one (`from_hf_config`). A
        catalog name comes first: write a folder named like one as a path (``./Qwen3-8B``).

        Args:
            name_or_path: the model.
            seq_len: the training sequence length, replacing the catalog's, the file's or the
                Hugging Face config's maximum positions (the CLI's ``--seq-len``).
            lora: low-rank adapters replacing the model's (`LoraSpec`, or a mapping of its
                fields: the CLI's ``--lora-rank`` / ``--lora-targets``).
        """
        spec = cls._load(name_or_path, seq_len=seq_len)
        if seq_len is not None and spec.seq_len != seq_len:
            spec = spec.scaled(seq_len=seq_len)
        if lora is not None:
            spec = spec.scaled(lora=LoraSpec.from_value(lora, what=f"model {spec.name!r}"))
        return spec

    @classmethod
    def _load(
        cls, name_or_path: "str | os.PathLike | ModelSpec", *, seq_len: int | None
    ) -> "ModelSpec":
        if isinstance(name_or_path, ModelSpec):
            return name_or_path
        if not isinstance(name_or_path, (str, os.PathLike)):  # None, a number: named, not fspath's
            from autosearch.core.schema import kind_of

            raise TypeError(
                "model must be a catalog name, the path of a model YAML or config.json, or a "
                f"ModelSpec; got {kind_of(name_or_path)}"
            )
        key = os.fspath(name_or_path)
        catalog = model_catalog()
        if key.lower() in catalog:
            return catalog[key.lower()]
        if key.endswith(".json"):  # a Hugging Face config.json
            return cls.from_hf_config(key, seq_len=seq_len)
        if os.path.isdir(key):  # a Hugging Face model's folder
            if not os.path.isfile(os.path.join(key, "config.json")):
                raise SpecError(
                    f"model folder {key!r} holds no config.json; pass a Hugging Face model's "
                    "folder (the one holding its config.json), a config.json, a model YAML file "
                    "or a catalog name (`autosearch models`)"
                )
            return cls.from_hf_config(key, seq_len=seq_len)
        if key.endswith((".yaml", ".yml")) or os.path.sep in key or os.path.exists(key):
            data = read_yaml_mapping(key, what="model")
            data.setdefault("name", name_from(os.path.splitext(os.path.basename(key))[0]))
            return cls.from_dict(data, what=f"model file {key!r}")
        family = re.sub(r"[^a-z].*", "", key.lower())  # the leading letters
        close = difflib.get_close_matches(key.lower(), catalog, n=4, cutoff=0.6)
        close += [n for n in catalog if family and n.startswith(family) and n not in close][
            : 8 - len(close)
        ]
        hint = f" Similar names: {', '.join(close)}." if close else ""
        raise SpecError(
            f"unknown model {key!r}: not in the catalog and not a YAML file.{hint} Run `autosearch"
            " models` for the catalog, or pass a YAML file with n_layers, hidden_size, n_heads,"
            " vocab_size and seq_len."
        )

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for name in ("layer_pattern", "mamba", "gdn", "mamba1"):  # files as before the fields
            if out[name] is None:
                del out[name]
        if self.mamba is not None and self.mamba.gated_norm:  # files as before the field
            del out["mamba"]["gated_norm"]
        if not self.attention_output_gate:
            del out["attention_output_gate"]
        if self.lora is not None:  # plain YAML data: a list, not a tuple
            out["lora"]["targets"] = list(self.lora.targets or ())
        return out

    def scaled(self, **changes: Any) -> "ModelSpec":
        """A copy with some fields changed (e.g. fewer layers to run a catalog model on a CPU).

        Derived defaults follow the change: a model whose kv heads were its heads keeps them equal
        when n_heads changes, an ffn of 4 * hidden stays 4 * hidden when hidden_size changes, and
        a head size of hidden / heads stays so when either changes.
        """
        if (
            "n_heads" in changes
            and "n_kv_heads" not in changes
            and self.n_kv_heads == self.n_heads
        ):
            changes["n_kv_heads"] = None
        if (
            "hidden_size" in changes
            and "ffn_hidden_size" not in changes
            and self.ffn_hidden_size == 4 * self.hidden_size
        ):
            changes["ffn_hidden_size"] = None
        if (
            ("hidden_size" in changes or "n_heads" in changes)
            and "head_dim" not in changes
            and self.head_dim * self.n_heads == self.hidden_size
        ):
            changes["head_dim"] = None
        return dataclasses.replace(self, **changes)


def _in_units(n: int) -> str:
    """A parameter count to one decimal of its unit: ``30.5 B``, ``124.4 M``, ``8,192``."""
    if n >= 1e9:
        return f"{n / 1e9:,.1f} B"
    return f"{n / 1e6:,.1f} M" if n >= 1e6 else f"{n:,}"


# the state-space and linear-attention mixers: (field, pattern symbol, name)
_MIXER_SPECS = (
    ("mamba", "M", "Mamba-2"),
    ("gdn", "G", "Gated DeltaNet"),
    ("mamba1", "S", "Mamba-1"),
)
# the specs each mixer of the layer pattern is described by
_SPECS_OF = {
    "mamba": ("mamba",),
    "gdn": ("gdn",),
    "attention+mamba": ("mamba",),
    "mamba1": ("mamba1",),
}
_MIXER_FIELDS = {
    "mamba": "n_heads, head_dim, d_state, n_groups",
    "gdn": "n_k_heads, n_v_heads, head_k_dim, head_v_dim",
    "mamba1": "d_inner, d_state, dt_rank",
}


def unpriced(model: ModelSpec) -> list[str]:
    """What the analytic cost model cannot price yet in `model`, one phrase each (empty: all of
    it). `cost_models.AnalyticCostModel` refuses such a model; remove an entry here when the cost
    model gains its term. The term each needs is listed in docs/models.md. The cost model
    prices attention, Mamba-2 and Gated DeltaNet mixers, dense and MoE MLPs, and blocks with
    either alone (`cost_models.terms.layers`, `cost_models.terms.ssm`): nothing of a model's
    layers is left unpriced today; a new kind of block is refused here until its term exists."""
    priced = (
        "Mamba-2",
        "Gated DeltaNet",
        "attention and Mamba-2",
        "Mamba-1",
        "blocks without a mixer",
        "blocks without an MLP",
    )
    return [
        f"{what} ({model.pattern[:40]})"
        for what in _other_blocks(model)
        if not what.startswith(priced)
    ]


def _other_blocks(model: ModelSpec) -> list[str]:
    """The blocks of `model` that are not attention with a dense or MoE MLP, by kind."""
    names = {
        "mamba": "Mamba-2 mixers (M)",
        "gdn": "Gated DeltaNet mixers (G)",
        "attention+mamba": "attention and Mamba-2 mixers in parallel (P)",
        "mamba1": "Mamba-1 mixers (S)",
        "none": "blocks without a mixer (an MLP alone)",
    }
    out = []
    kinds = {layer.kind for layer in model.layers}
    for mixer in ("mamba", "gdn", "attention+mamba", "mamba1", "none"):
        if any(k[0] == mixer for k in kinds):
            out.append(names[mixer])
    if any(k[0] != "none" and k[1] == "none" for k in kinds):
        out.append("blocks without an MLP (a mixer alone)")
    return out


def check_priced(model: ModelSpec) -> None:
    """Raise a SpecError naming what `unpriced` finds in `model`, with what to do instead."""
    missing = unpriced(model)
    if missing:
        raise SpecError(
            f"model {model.name!r}: the cost model does not price {'; '.join(missing)} yet, so "
            "estimate, tune and sweep cannot score this model. Parameter counts and FLOPs are "
            "known (autosearch models, ModelSpec.n_params / n_active_params / flops_per_token); "
            "to plan anyway, describe a dense model without these features in a YAML file"
        )


def unbuilt(model: ModelSpec) -> list[str]:
    """What `autosearch.models.transformer.Transformer` (the reference model the Engine trains)
    does not build in `model`, one phrase each. It builds attention blocks (multi-head or
    grouped-query, any head size, sliding windows, soft-capped scores and logits, the output
    gate of Qwen3-Next) with a GELU,
    squared-ReLU, SwiGLU or GeGLU MLP, learned or rotary positions, dropless SwiGLU
    mixture-of-experts layers with an auxiliary loss or none, and the hybrid blocks of
    Megatron's layer pattern (Mamba-2 and Gated DeltaNet mixers, a mixer or an MLP alone;
    `autosearch.models.ssm`); not yet parallel attention + Mamba-2 (P), Mamba-1 (S) or Kimi
    Delta Attention blocks."""
    built = ("Mamba-2 mixers", "Gated DeltaNet mixers", "blocks without")
    out = [what for what in _other_blocks(model) if not what.startswith(built)]
    if model.gdn is not None and model.gdn.gate_rank is not None:
        out.append("Kimi Delta Attention mixers (a Gated DeltaNet with low-rank gates)")
    m = model.moe
    if m is not None and model.ffn_activation != "swiglu":
        out.append(f"mixture-of-experts layers of {model.ffn_activation} experts (SwiGLU only)")
    if m is not None and m.capacity_factor is not None:
        out.append(f"moe.capacity_factor {m.capacity_factor} (routing is dropless)")
    if m is not None and m.load_balancing == "aux_loss_free":
        out.append("moe.load_balancing aux_loss_free (the expert bias updates)")
    if model.mla is not None:
        out.append("multi-head latent attention (mla)")
    if model.position_embedding == "alibi":
        out.append("ALiBi position biases (position_embedding alibi)")
    if model.mtp_layers:
        out.append(f"multi-token prediction (mtp_layers {model.mtp_layers}; 0 trains without it)")
    return out


@functools.cache
def model_catalog() -> dict[str, ModelSpec]:
    """Every model of `autosearch/core/models.yaml`, by name (sources are cited in that file)."""
    text = resources.files("autosearch.core").joinpath("models.yaml").read_text(encoding="utf-8")
    entries = yaml.safe_load(text)["models"]
    return {
        name: ModelSpec.from_dict({"name": name, **fields}, what=f"catalog model {name!r}")
        for name, fields in entries.items()
    }
