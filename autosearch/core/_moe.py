"""Mixture-of-experts and multi-head latent attention: the nested parts of a ModelSpec.

`MoESpec` describes the expert MLP of a block (Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3, Llama 4,
gpt-oss); `MLASpec` describes DeepSeek's multi-head latent attention (DeepSeek-V2 tech report,
sec. 2.1). Both are frozen, checked on construction, and read from YAML as nested mappings::

    moe: {n_experts: 8, top_k: 2}
    mla: {q_lora_rank: 1536, kv_lora_rank: 512, qk_nope_head_dim: 128, qk_rope_head_dim: 64,
          v_head_dim: 128}

Which layers hold experts follows Hugging Face (Llama 4 ``interleave_moe_layer_step``, Qwen2-MoE
``decoder_sparse_step``, DeepSeek ``first_k_dense_replace``): layer ``i`` (from 0) is a MoE
layer when ``i >= first_dense_layers`` and ``(i + 1) % layer_step == 0``. Megatron-LM's
``--moe-layer-freq N`` puts experts on layers 0, N, 2N, ... instead; an exporter writes
Megatron's explicit list form (``--moe-layer-freq "([0]*3+[1]*58)"``) from
`ModelSpec.moe_layers`, which is the same for every convention.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from autosearch.core._io import check_keys, positive_int
from autosearch.core.errors import SpecError

ROUTERS = ("softmax", "sigmoid")  # scores before top-k: Mixtral/Qwen softmax, DeepSeek-V3 sigmoid
LOAD_BALANCING = ("aux_loss", "aux_loss_free", "none")
_WIDTH = 1 << 22  # same limit as ffn_hidden_size (`_io.INT_LIMITS`)
_COUNT = 1 << 16


def _int(value: Any, name: str, problems: list[str], *, minimum: int = 1, maximum: int) -> Any:
    try:
        return positive_int(value, name, minimum=minimum, maximum=maximum)
    except SpecError as exc:
        problems.append(str(exc))
        return value


@dataclass(frozen=True, kw_only=True)
class MoESpec:
    """The expert MLP of the MoE layers (routed experts, shared experts, router).

    Args:
        n_experts: routed experts per MoE layer (Mixtral 8, DeepSeek-V3 256).
        top_k: routed experts each token goes to (Mixtral 2, DeepSeek-V3 8, Llama 4 1).
        ffn_hidden_size: width of one expert's MLP; default the model's ``ffn_hidden_size``
            (Mixtral's experts are its ``intermediate_size``).
        n_shared_experts: experts every token goes to (DeepSeek 1-2, Llama 4 1, Qwen2-MoE 1).
        shared_ffn_hidden_size: width of one shared expert; default ``ffn_hidden_size``
            (Qwen2-MoE's single shared expert is wider: ``shared_expert_intermediate_size``).
        first_dense_layers: leading layers with a dense MLP (DeepSeek ``first_k_dense_replace``).
        layer_step: every ``layer_step``-th layer after those is a MoE layer, the others dense
            (Llama 4 Maverick 2; ``interleave_moe_layer_step``, ``decoder_sparse_step``).
        router: ``softmax`` or ``sigmoid`` scores before the top-k.
        load_balancing: ``aux_loss`` (Switch/GShard auxiliary loss), ``aux_loss_free``
            (DeepSeek-V3's bias on the scores, Wang et al. 2024) or ``none``.
        capacity_factor: tokens an expert takes, as a multiple of its even share; None is
            dropless (every routed token is computed, Megatron-Core's default).
    """

    n_experts: int
    top_k: int
    ffn_hidden_size: int = None  # type: ignore[assignment]  # None: the model's ffn_hidden_size
    n_shared_experts: int = 0
    shared_ffn_hidden_size: int = None  # type: ignore[assignment]  # None: ffn_hidden_size
    first_dense_layers: int = 0
    layer_step: int = 1
    router: str = "softmax"
    load_balancing: str = "aux_loss"
    capacity_factor: float | None = None

    def check(self, *, n_layers: int, ffn_hidden_size: int) -> "MoESpec":
        """This spec with its defaults filled from the model, or a SpecError naming every
        problem and what to do about it."""
        p: list[str] = []
        n = _int(self.n_experts, "moe.n_experts", p, maximum=_COUNT)
        if self.n_experts == 0:
            p[-1] = (
                "moe.n_experts must be >= 1, got 0; a model without experts is dense: "
                "drop the moe block"
            )
        k = _int(self.top_k, "moe.top_k", p, maximum=_COUNT)
        width = self.ffn_hidden_size if self.ffn_hidden_size is not None else ffn_hidden_size
        width = _int(width, "moe.ffn_hidden_size", p, maximum=_WIDTH)
        shared = _int(self.n_shared_experts, "moe.n_shared_experts", p, minimum=0, maximum=_COUNT)
        shared_width = self.shared_ffn_hidden_size
        shared_width = _int(
            width if shared_width is None else shared_width,
            "moe.shared_ffn_hidden_size",
            p,
            maximum=_WIDTH,
        )
        dense = _int(
            self.first_dense_layers, "moe.first_dense_layers", p, minimum=0, maximum=_COUNT
        )
        step = _int(self.layer_step, "moe.layer_step", p, maximum=_COUNT)
        if self.router not in ROUTERS:
            p.append(f"moe.router must be one of {', '.join(ROUTERS)}, got {self.router!r}")
        if self.load_balancing not in LOAD_BALANCING:
            p.append(
                f"moe.load_balancing must be one of {', '.join(LOAD_BALANCING)}, "
                f"got {self.load_balancing!r}"
            )
        cf = self.capacity_factor
        if cf is not None and (
            isinstance(cf, bool)
            or not isinstance(cf, (int, float))
            or not math.isfinite(cf)
            or cf <= 0
        ):
            p.append(
                f"moe.capacity_factor must be a number > 0 (1.0 = each expert takes its even "
                f"share of tokens), or null for dropless routing; got {cf!r}"
            )
        if not p:
            if k > n:
                p.append(
                    f"moe.top_k = {k} is above moe.n_experts = {n}: a token cannot go to more "
                    f"experts than there are; use top_k <= {n}"
                )
            if dense >= n_layers:
                p.append(
                    f"moe.first_dense_layers = {dense} leaves no MoE layer of {n_layers}; use "
                    f"fewer than {n_layers} dense layers, or drop the moe block for a dense model"
                )
            elif not any((i + 1) % step == 0 for i in range(dense, n_layers)):
                p.append(
                    f"moe.layer_step = {step} puts no MoE layer among layers {dense}..."
                    f"{n_layers - 1}; use a step <= {n_layers}"
                )
        if p:
            raise SpecError(p)
        return dataclasses.replace(
            self,
            n_experts=n,
            top_k=k,
            ffn_hidden_size=width,
            n_shared_experts=shared,
            shared_ffn_hidden_size=shared_width,
            first_dense_layers=dense,
            layer_step=step,
            capacity_factor=None if cf is None else float(cf),
        )

    @classmethod
    def from_value(cls, value: Any, *, what: str) -> "MoESpec":
        if isinstance(value, MoESpec):
            return value
        if not isinstance(value, dict):
            raise SpecError(
                f"{what}: moe must be a mapping such as {{n_experts: 8, top_k: 2}}, "
                f"got {type(value).__name__}"
            )
        kwargs = check_keys(value, cls, what=f"{what}: moe")
        missing = [k for k in ("n_experts", "top_k") if k not in kwargs]
        if missing:
            raise SpecError(f"{what}: moe lacks {' and '.join(missing)}")
        return cls(**kwargs)


@dataclass(frozen=True, kw_only=True)
class MLASpec:
    """DeepSeek's multi-head latent attention (DeepSeek-V2 tech report, sec. 2.1, eqs. 9-19).

    Queries go through a low-rank bottleneck (``q_lora_rank``; None: a full projection, as in
    DeepSeek-V2-Lite); keys and values are rebuilt from a shared latent of ``kv_lora_rank`` plus
    one rotary key of ``qk_rope_head_dim`` shared by all heads. A head's query/key has
    ``qk_nope_head_dim + qk_rope_head_dim`` channels, its value ``v_head_dim``.
    """

    q_lora_rank: int | None = None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    def check(self) -> "MLASpec":
        p: list[str] = []
        if self.q_lora_rank is not None:
            _int(self.q_lora_rank, "mla.q_lora_rank", p, maximum=_WIDTH)
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            _int(getattr(self, name), f"mla.{name}", p, maximum=_WIDTH)
        if p:
            raise SpecError(p)
        return self

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def matmul_params(self, hidden: int, n_heads: int) -> int:
        """Weights of the attention's projections (DeepSeek-V2 eqs. 9-19; Hugging Face
        ``DeepseekV3Attention``: q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj)."""
        h, r = hidden, self.q_lora_rank
        q = h * n_heads * self.qk_head_dim if r is None else h * r + r * n_heads * self.qk_head_dim
        kv_a = h * (self.kv_lora_rank + self.qk_rope_head_dim)
        kv_b = self.kv_lora_rank * n_heads * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv_a + kv_b + n_heads * self.v_head_dim * h

    @property
    def norm_params(self) -> int:
        """RMSNorm weights on the two latents (q_a_layernorm, kv_a_layernorm)."""
        return (self.q_lora_rank or 0) + self.kv_lora_rank

    @classmethod
    def from_value(cls, value: Any, *, what: str) -> "MLASpec":
        if isinstance(value, MLASpec):
            return value
        if not isinstance(value, dict):
            raise SpecError(
                f"{what}: mla must be a mapping of q_lora_rank, kv_lora_rank, qk_nope_head_dim, "
                f"qk_rope_head_dim and v_head_dim; got {type(value).__name__}"
            )
        kwargs = check_keys(value, cls, what=f"{what}: mla")
        missing = [
            k
            for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
            if k not in kwargs
        ]
        if missing:
            raise SpecError(f"{what}: mla lacks {', '.join(missing)}")
        return cls(**kwargs)
