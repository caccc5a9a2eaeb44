"""A reference decoder-only transformer built from a ModelSpec, with its parallel plan.

Two styles, chosen by ``spec.ffn_activation`` as in `autosearch.core.model_spec`:

* GPT style (``gelu``; Radford et al. 2019): LayerNorm with bias, biases in every linear layer,
  learned position embeddings, dropout (probability ``dropout``, 0 by default).
* Llama style (``swiglu``; Touvron et al. 2023): RMSNorm, no biases, rotary positions
  (Su et al. 2021), grouped-query attention (Ainslie et al. 2023), SwiGLU MLP (Shazeer 2020).
* Mixture of experts (a Llama-style spec with ``moe``; Mixtral, Qwen3-MoE, DeepSeek-V3): the
  layers `ModelSpec.moe_layers` names have a `autosearch.models.moe.MoE` (``moe``) in place of
  the dense ``feed_forward``; its load-balancing loss joins the training loss.
* Hybrids (a spec with ``layer_pattern``; Nemotron-H, Qwen3-Next): each block is what its
  `autosearch.core.layers.Layer` says, a mixer (attention, Mamba-2 or Gated DeltaNet,
  `autosearch.models.ssm`) and an MLP (dense, MoE), either of which may be absent.

The layout follows torchtitan so that the Engine can split and shard it by name: ``tok_embeddings``
(+ ``pos_embeddings``), ``layers`` (a ModuleDict keyed "0", "1", ... so that parameter names stay
the same when a pipeline stage keeps only some layers), ``norm`` and ``output``. `forward` skips
any of these that is ``None``, which is how a pipeline stage is made (`ParallelPlan`).

Example:
    >>> import torch
    >>> from autosearch import ModelSpec
    >>> from autosearch.models.transformer import Transformer
    >>> spec = ModelSpec.load("tiny-llama").scaled(n_layers=2, hidden_size=64, seq_len=16)
    >>> model = Transformer(spec)
    >>> model(torch.zeros(2, 16, dtype=torch.long)).shape
    torch.Size([2, 16, 1000])
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from autosearch.core.errors import SpecError
from autosearch.core.model_spec import ModelSpec, unbuilt
from autosearch.distributed.plan import ParallelPlan
from autosearch.models import attention
from autosearch.models.moe import AUX_LOSS_COEF, Experts, MoE, moe_of, sequence_parallel_style
from autosearch.models.ssm import GatedDeltaNet, Mamba2Mixer, ssm_strategy_problems, ssm_tp_plan

if TYPE_CHECKING:  # pragma: no cover
    from autosearch.distributed.context_parallel import ContextParallel

ROPE_THETA = 10000.0  # Su et al. 2021; Llama 2 uses 10,000 (Llama 3 uses 500,000)


def rope_table(seq_len: int, head_dim: int, theta: float = ROPE_THETA) -> torch.Tensor:
    """cos and sin of the rotary angles, shape (2, seq_len, head_dim) (Su et al. 2021, eq. 34)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return torch.stack([angles.cos(), angles.sin()])


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate (batch, seq, heads, head_dim) by the table; the "rotate half" form of
    GPT-NeoX/Llama."""
    seq = x.shape[1]
    cos = rope[0, :seq, None, :].to(x.dtype)
    sin = rope[1, :seq, None, :].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class CoreAttention(nn.Module):
    """softmax(QK^T / sqrt(d)) V with a causal mask: what selective recompute recomputes.

    Korthikanti et al. 2022, sec. 5: this part holds the 5as^2b bytes of activations per layer
    and is cheap to recompute, so it is the one to checkpoint. A sliding window (the keys a
    query attends to, Mistral and Gemma's local layers) or soft-capped scores (Gemma 2) take the
    masked path of `autosearch.models.attention`, exact under context parallel too.
    """

    # Under context parallel (set by the Engine): q, k, v hold this rank's tokens and the
    # attention runs over the whole sequence (`autosearch.distributed.context_parallel`).
    context_parallel: "ContextParallel | None" = None

    def __init__(
        self, dropout: float = 0.0, *, window: int | None = None, softcap: float | None = None
    ):
        super().__init__()
        self.dropout = dropout
        self.window = window
        self.softcap = softcap

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        dropout = self.dropout if self.training else 0.0
        if self.window is not None or self.softcap is not None:
            k, v, q_pos, k_pos = attention.positions(k, v, q.shape[2], self.context_parallel)
            return attention.masked_attention(
                q,
                k,
                v,
                attention.visible(q_pos, k_pos, self.window),
                scaling=q.shape[-1] ** -0.5,
                softcap=self.softcap,
                dropout_p=dropout,
            )
        if self.context_parallel is not None:
            return self.context_parallel.attention(q, k, v, dropout_p=dropout)
        # Heads come from the shapes, so the same code runs on the heads a tp rank holds.
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            is_causal=True,
            dropout_p=dropout,
            enable_gqa=k.shape[1] != q.shape[1],
        )


class Attention(nn.Module):
    context_parallel: "ContextParallel | None" = None  # rotary angles at global positions

    def __init__(self, spec: ModelSpec, dropout: float, keys: int | None = None):
        super().__init__()
        bias = spec.linear_bias
        h, q = spec.hidden_size, spec.attention_hidden_size
        self.head_dim = spec.head_dim
        # With the output gate (Qwen3-Next, Qwen3.5): wq gives each head's query and then its
        # gate, transformers' Qwen3NextAttention.q_proj layout, so that a column split by heads
        # (tp) gives each rank its heads' gates too.
        self.gated = spec.attention_output_gate
        self.wq = nn.Linear(h, q + spec.attention_gate_width, bias=bias)
        self.wk = nn.Linear(h, spec.kv_hidden_size, bias=bias)
        self.wv = nn.Linear(h, spec.kv_hidden_size, bias=bias)
        self.wo = nn.Linear(q, h, bias=bias)
        window = keys if keys is not None and keys < spec.seq_len else None
        self.core = CoreAttention(dropout, window=window, softcap=spec.attn_logit_softcapping)

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds n_heads / tp of them.
        gate = None
        if self.gated:  # Qwen3NextAttention.forward: per head, the query then the gate
            q, gate = self.wq(x).view(batch, seq, -1, 2 * self.head_dim).chunk(2, dim=-1)
        else:
            q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        if rope is not None:
            if self.context_parallel is not None:
                rope = rope[:, self.context_parallel.positions(seq, rope.device)]
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        out = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        out = out.transpose(1, 2).reshape(batch, seq, -1)
        if gate is not None:  # elementwise per token: under cp each rank gates its own tokens
            out = out * torch.sigmoid(gate.reshape(batch, seq, -1))
        return self.wo(out)


class FeedForward(nn.Module):
    """The dense MLP of `spec.ffn_activation`: GELU (w2(gelu(w1 x))), squared ReLU (relu2:
    w2(relu(w1 x)^2), Nemotron; So et al. 2021), or gated: SwiGLU (w2(silu(w1 x) * w3 x);
    Shazeer 2020) and GeGLU (the tanh GELU as the gate, Gemma)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        bias = spec.linear_bias
        self.activation = spec.ffn_activation
        self.w1 = nn.Linear(spec.hidden_size, spec.ffn_hidden_size, bias=bias)
        self.w2 = nn.Linear(spec.ffn_hidden_size, spec.hidden_size, bias=bias)
        self.w3 = (
            nn.Linear(spec.hidden_size, spec.ffn_hidden_size, bias=bias)
            if spec.ffn_gated
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is not None and self.activation == "swiglu":
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        if self.w3 is not None:  # geglu
            return self.w2(F.gelu(self.w1(x), approximate="tanh") * self.w3(x))
        if self.activation == "relu2":
            return self.w2(torch.square(F.relu(self.w1(x))))
        return self.w2(F.gelu(self.w1(x)))


def _norm(spec: ModelSpec) -> nn.Module:
    """LayerNorm in GPT style (with a bias where the linear layers have them), else RMSNorm."""
    if spec.is_gpt_style:
        return nn.LayerNorm(spec.hidden_size, bias=spec.linear_bias)
    return nn.RMSNorm(spec.hidden_size, eps=1e-5)


class Block(nn.Module):
    """Pre-norm block of one `autosearch.core.layers.Layer`: x + mixer(norm(x)), then
    x + mlp(norm(x)), each part absent when the layer has none (Megatron's hybrid layers: each
    mixer and each MLP has its own pre-norm and residual).

    The mixer is ``attention`` (with ``attention_norm``: the names of every attention block, as
    before hybrids) or a Mamba-2 / Gated DeltaNet ``mixer`` (with ``mixer_norm``;
    `autosearch.models.ssm`); the MLP is ``feed_forward``, or ``moe`` when `moe` is given.
    """

    def __init__(
        self,
        spec: ModelSpec,
        dropout: float,
        moe: MoE | None = None,
        keys: int | None = None,
        *,
        mixer: str = "attention",
        mlp: str = "dense",
    ):
        super().__init__()
        self.attention_norm = _norm(spec) if mixer == "attention" else None
        self.attention = Attention(spec, dropout, keys) if mixer == "attention" else None
        self.mixer_norm = _norm(spec) if mixer in ("mamba", "gdn") else None
        self.mixer: nn.Module | None = None
        if mixer == "mamba":
            assert spec.mamba is not None  # ModelSpec checks that M layers have their spec
            self.mixer = Mamba2Mixer(spec.mamba, spec.hidden_size)
        elif mixer == "gdn":
            assert spec.gdn is not None
            self.mixer = GatedDeltaNet(spec.gdn, spec.hidden_size)
        self.ffn_norm = _norm(spec) if mlp != "none" else None
        self.feed_forward = FeedForward(spec) if mlp == "dense" else None
        self.moe = moe
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None = None) -> torch.Tensor:
        # each part present is built with its norm
        if self.attention is not None and self.attention_norm is not None:
            x = x + self.dropout(self.attention(self.attention_norm(x), rope))
        elif self.mixer is not None and self.mixer_norm is not None:
            x = x + self.dropout(self.mixer(self.mixer_norm(x)))
        mlp = self.feed_forward if self.feed_forward is not None else self.moe
        if mlp is not None and self.ffn_norm is not None:
            x = x + self.dropout(mlp(self.ffn_norm(x)))
        return x


class Transformer(nn.Module):
    """A decoder-only transformer with the shape of `spec`; input token ids, output logits.

    Args:
        spec: the model shape (a catalog model, usually shrunk with ``spec.scaled(...)`` on a CPU).
        dropout: dropout probability of GPT-style models (Llama style has none). 0 by default,
            which keeps runs under different strategies comparable step for step.
        init_std: standard deviation of the normal weight initialisation (GPT-2: 0.02; residual
            output projections are scaled by 1/sqrt(2 n_layers), Radford et al. 2019).
        aux_loss_coef: weight of the MoE layers' load-balancing loss (`autosearch.models.moe`;
            used when ``spec.moe.load_balancing`` is ``aux_loss``).
    """

    rope: torch.Tensor | None  # a buffer (Llama style), or None (GPT style)
    context_parallel: "ContextParallel | None" = None  # learned positions at global positions

    def __init__(
        self,
        spec: ModelSpec,
        *,
        dropout: float = 0.0,
        init_std: float = 0.02,
        aux_loss_coef: float = AUX_LOSS_COEF,
    ):
        super().__init__()
        if unbuilt(spec):  # features of the ModelSpec this reference model does not build
            raise SpecError(
                f"model {spec.name!r}: Transformer does not build {'; '.join(unbuilt(spec))}"
            )
        if not spec.is_gpt_style:
            dropout = 0.0
        self.spec = spec
        self.tok_embeddings = nn.Embedding(spec.vocab_size, spec.hidden_size)
        learned = spec.position_embedding == "learned"
        self.pos_embeddings = nn.Embedding(spec.seq_len, spec.hidden_size) if learned else None
        self.dropout = nn.Dropout(dropout)
        self.layers = nn.ModuleDict(
            {
                str(i): Block(
                    spec,
                    dropout,
                    moe_of(spec, aux_loss_coef=aux_loss_coef) if layer.mlp == "moe" else None,
                    layer.keys,
                    mixer=layer.mixer,
                    mlp=layer.mlp,
                )
                for i, layer in enumerate(spec.layers)
            }
        )
        self.norm = _norm(spec)
        self.output = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tied_embeddings:  # one parameter, used by both modules (as transformers ties)
            self.output.weight = self.tok_embeddings.weight
        if spec.position_embedding == "rotary":
            self.register_buffer("rope", rope_table(spec.seq_len, spec.head_dim), persistent=False)
        else:
            self.rope = None
        self.init_std = init_std
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise every weight (and the rotary table), also after building on the meta device
        and ``to_empty``: the Engine calls it on each parallelized part with ``meta_init=True``."""
        std = self.init_std
        residual_std = std / math.sqrt(2 * self.spec.n_layers)
        done: set[int] = set()
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                if id(module.weight) in done:  # a tied weight, initialised once
                    continue
                done.add(id(module.weight))
                is_residual = name.endswith(
                    ("attention.wo", "feed_forward.w2", "shared_experts.w2", "mixer.out_proj")
                )
                nn.init.normal_(module.weight, mean=0.0, std=residual_std if is_residual else std)
                bias = getattr(module, "bias", None)
                if bias is not None:
                    nn.init.zeros_(bias)
            elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
                module.reset_parameters()
            elif isinstance(module, Experts):
                module.init_weights(std, residual_std)
            elif isinstance(module, (Mamba2Mixer, GatedDeltaNet)):
                module.init_ssm()  # its conv, decays, step sizes and gated norm
        rope = getattr(self, "rope", None)
        if rope is not None:
            self.rope = rope_table(self.spec.seq_len, self.spec.head_dim).to(rope.device)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (batch, seq, vocab) of token ids (batch, seq); a pipeline stage maps hidden to
        hidden."""
        h = tokens
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(tokens)
            if self.pos_embeddings is not None:
                if self.context_parallel is not None:
                    positions = self.context_parallel.positions(tokens.shape[1], tokens.device)
                else:
                    positions = torch.arange(tokens.shape[1], device=tokens.device)
                h = h + self.pos_embeddings(positions.unsqueeze(0))
            h = self.dropout(h)
        for layer in self.layers.values():
            h = layer(h, self.rope)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
            cap = self.spec.final_logit_softcapping
            if cap is not None:  # Gemma 2: logits c * tanh(logits / c)
                h = torch.tanh(h / cap) * cap
        return h

    def parallel_plan(self) -> ParallelPlan:
        """How the Engine shards this model: blocks, pipeline ends, tensor-parallel plan."""
        return ParallelPlan(
            blocks="layers",
            first_stage=("tok_embeddings", "pos_embeddings", "dropout"),
            last_stage=("norm", "output"),
            tp_plan=functools.partial(
                self.tp_plan,
                mixers={
                    name: layer.mixer
                    for name, layer in zip(self.layers, self.spec.layers)
                    if layer.mixer in ("mamba", "gdn")
                },
            ),
            attention_core="attention.core",
            check=self._check_strategy,
        )

    def _check_strategy(self, strategy) -> list[str]:
        return strategy.problems(self.spec) + ssm_strategy_problems(self.spec, strategy)

    @staticmethod
    def tp_plan(
        *, sequence_parallel: bool, loss_parallel: bool, mixers: dict[str, str] | None = None
    ) -> dict:
        """Megatron-style plan (Shoeybi et al. 2019) for `parallelize_module`, with sequence
        parallel (Korthikanti et al. 2022) as torchtitan writes it for Llama.

        Column-wise: wq, wk, wv, w1, w3 (each rank holds n_heads/tp heads and ffn/tp columns);
        row-wise: wo, w2 (one all-reduce, or reduce-scatter with sequence parallel, per sub-layer).
        Embeddings are split by vocabulary rows; the output projection by vocabulary columns.
        Mamba-2 and Gated DeltaNet mixers (`mixers`: {block name: ``mamba`` or ``gdn``}) split
        their groups or key heads over the ranks (`autosearch.models.ssm.ssm_tp_plan`).
        """
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            PrepareModuleInput,
            RowwiseParallel,
            SequenceParallel,
        )

        act = Shard(1) if sequence_parallel else Replicate()  # layout of the residual stream
        plan = {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=act),
            "pos_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=act),
            "output": ColwiseParallel(
                input_layouts=act,
                output_layouts=Shard(-1) if loss_parallel else Replicate(),
                use_local_output=not loss_parallel,
            ),
            "layers.*.attention.wq": ColwiseParallel(),
            "layers.*.attention.wk": ColwiseParallel(),
            "layers.*.attention.wv": ColwiseParallel(),
            "layers.*.attention.wo": RowwiseParallel(output_layouts=act),
            "layers.*.feed_forward.w1": ColwiseParallel(),
            "layers.*.feed_forward.w3": ColwiseParallel(),
            "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=act),
        }
        if sequence_parallel:
            plan.update(
                {
                    "norm": SequenceParallel(),
                    "layers.*.attention_norm": SequenceParallel(),
                    "layers.*.ffn_norm": SequenceParallel(),
                    "layers.*.attention": PrepareModuleInput(
                        input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
                    ),
                    "layers.*.feed_forward": PrepareModuleInput(
                        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                    ),
                    # each tp rank's MoE layers route its own shard (parallel folding)
                    "layers.*.moe": sequence_parallel_style(),
                    "layers.*.mixer_norm": SequenceParallel(),
                }
            )
        for name, kind in (mixers or {}).items():
            plan.update(
                ssm_tp_plan(f"layers.{name}.mixer", kind, sequence_parallel=sequence_parallel)
            )
        return plan


def build(spec: "ModelSpec | str", **kwargs) -> Transformer:
    """`Transformer(ModelSpec.load(spec), **kwargs)`: a catalog name, a YAML path or a
    ModelSpec."""
    if not isinstance(spec, (ModelSpec, str)):
        raise SpecError(f"build() takes a ModelSpec or a catalog name, got {type(spec).__name__}")
    return Transformer(ModelSpec.load(spec), **kwargs)
