"""Mamba-2: the state-space mixer of a hybrid model, a nested part of a ModelSpec.

A Mamba-2 mixer (Dao & Gu 2024, "Transformers are SSMs", sec. 7; Megatron-Core
``megatron/core/ssm/mamba_mixer.py`` ``MambaMixer``; Hugging Face ``NemotronHMamba2Mixer`` and
``Mamba2Mixer``) projects the hidden state h to x, z (``d_inner = n_heads * head_dim`` each),
B and C (``n_groups * d_state`` each) and one dt per head; runs a causal depthwise conv1d of
``conv_kernel`` taps over x, B and C; scans the state (n_heads x head_dim x d_state, fp32) in
chunks of ``chunk_size`` (``mamba_ssm`` ``ssd_combined.mamba_chunk_scan_combined``); gates the
output with z through an RMSNorm per group, and projects d_inner back to h. Read from YAML as::

    mamba: {n_heads: 128, head_dim: 64, d_state: 128, n_groups: 8}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from autosearch.core._io import check_keys, positive_int
from autosearch.core.errors import SpecError

_WIDTH = 1 << 22
_COUNT = 1 << 16
# FLOPs of the selective scan per channel of d_inner and per state channel (Megatron-LM
# ``training.py`` ``num_floating_point_operations``, ``mamba_layer_flops``: 7 * d_in * d_state)
SCAN_FLOPS_PER_STATE = 7


class SSDKernel(NamedTuple):
    """One kernel of the chunked SSD scan: its name, FLOPs and bytes moved per token."""

    name: str
    flops_per_token: float
    bytes_per_token: float


class TorchOp(NamedTuple):
    """One eager PyTorch op (or a group of the same op) of a plain-PyTorch scan
    (autosearch/models/ssm.py), forward: its FLOPs and the fp32 elements it reads and writes
    per token, whether it is a (batched) GEMM, and how many kernels it launches per micro-batch
    (a Python loop over chunks launches once per chunk), and a GEMM's shape per matrix of the
    batch (its efficiency: `GemmEfficiency`; its backward's two GEMMs have the same three
    dims). Under bf16 / fp16 autocast a bmm (``torch.einsum``, ``@``) casts its two fp32
    operands and runs in the 16-bit dtype (autocast's lower-precision op list);
    ``linalg_solve_triangular`` is not on it and stays fp32 (`autocast` False)."""

    name: str
    flops_per_token: float
    elements_per_token: float
    gemm: bool = False
    launches: float = 1.0
    shape: tuple[float, float, float] = (0.0, 0.0, 0.0)  # a GEMM's (m, n, k) per matrix
    autocast: bool = True  # a GEMM autocast runs in the 16-bit dtype (bmm; not the solve)


class TorchScan(NamedTuple):
    """A plain-PyTorch scan as the cost model prices it: its forward ops, its backward ops
    (autograd's, `backward_of`) and the fp32 elements per token autograd saves for backward."""

    forward: tuple[TorchOp, ...]
    backward: tuple[TorchOp, ...]
    saved_elements_per_token: float


# Backward of an eager op by autograd's formulas (PyTorch tools/autograd/derivatives.yaml):
# a bmm's two input gradients are two bmms of the forward's FLOPs (grad @ mat2^T,
# self^T @ grad), each reading the output gradient and one saved input and writing one
# gradient, as many elements as the forward moves; an elementwise op's gradient reads the
# output gradient and what it saved and writes each input's gradient, about one and a half
# times the forward's elements (a unary op: 3 passes for 2; a binary op: 6 for 3, less its
# broadcast operands). tests/test_torch_scan_costs.py checks the sums against a census of the
# aten ops autograd runs.
BACKWARD_ELEMENTWISE_TRAFFIC = 1.5


def backward_of(forward: tuple[TorchOp, ...]) -> tuple[TorchOp, ...]:
    """The backward ops of `forward` (`BACKWARD_ELEMENTWISE_TRAFFIC`, derivatives.yaml)."""
    out: list[TorchOp] = []
    for op in forward:
        if op.gemm:
            out += [TorchOp(f"{op.name} grad {i}", *op[1:]) for i in (1, 2)]
        else:
            out.append(
                TorchOp(
                    f"{op.name} grad",
                    0.0,
                    BACKWARD_ELEMENTWISE_TRAFFIC * op.elements_per_token,
                    False,
                    op.launches,
                )
            )
    return tuple(out)


@dataclass(frozen=True, kw_only=True)
class MambaSpec:
    """The Mamba-2 mixer of the ``M`` layers.

    Args:
        n_heads: SSM heads (Hugging Face ``mamba_num_heads``; Megatron ``--mamba-num-heads``).
        head_dim: channels per head (``mamba_head_dim``; Megatron ``--mamba-head-dim``).
        d_state: state channels per head (``ssm_state_size``; Megatron ``--mamba-state-dim``).
        n_groups: groups sharing B and C (``n_groups``; Megatron ``--mamba-num-groups``); a
            tensor-parallel degree must divide it and n_heads.
        conv_kernel: taps of the causal conv1d (``conv_kernel``, 4).
        chunk_size: tokens per chunk of the scan (``chunk_size``, 128).
        conv_bias: the conv1d has a bias (``use_conv_bias``).
        proj_bias: the in / out projections have biases (``use_bias``).
        gated_norm: the output goes through the gated RMSNorm (its d_inner weights) before
            out_proj (Megatron-Core and Nemotron-H always; Falcon-H1 where ``mamba_rms_norm``,
            else z gates y without a norm: ``FalconH1Mixer``).
    """

    n_heads: int
    head_dim: int
    d_state: int = 128
    n_groups: int = 8
    conv_kernel: int = 4
    chunk_size: int = 128
    conv_bias: bool = True
    proj_bias: bool = False
    gated_norm: bool = True

    def check(self) -> "MambaSpec":
        """This spec, or a SpecError naming every problem and what to do about it."""
        p: list[str] = []
        for name, limit in (
            ("n_heads", _COUNT),
            ("head_dim", _WIDTH),
            ("d_state", _WIDTH),
            ("n_groups", _COUNT),
            ("conv_kernel", 1 << 10),
            ("chunk_size", 1 << 20),
        ):
            try:
                positive_int(getattr(self, name), f"mamba.{name}", maximum=limit)
            except SpecError as exc:
                p.append(str(exc))
        for name in ("conv_bias", "proj_bias", "gated_norm"):
            if not isinstance(getattr(self, name), bool):
                p.append(f"mamba.{name} must be true or false, got {getattr(self, name)!r}")
        if not p and self.n_heads % self.n_groups:
            p.append(
                f"mamba.n_heads {self.n_heads} must be a multiple of mamba.n_groups "
                f"{self.n_groups} (each group of B and C serves whole heads)"
            )
        if p:
            raise SpecError(p)
        return self

    @property
    def d_inner(self) -> int:
        """Width of x and z: n_heads * head_dim."""
        return self.n_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels the conv1d runs over: x, B and C."""
        return self.d_inner + 2 * self.n_groups * self.d_state

    @property
    def in_proj_width(self) -> int:
        """Outputs of in_proj: z, x, B, C and dt (``mamba_mixer.py``: d_inner * 2 + 2 *
        ngroups * d_state + nheads)."""
        return self.d_inner + self.conv_dim + self.n_heads

    def matmul_params(self, hidden: int) -> int:
        """Weights of in_proj and out_proj."""
        return hidden * self.in_proj_width + self.d_inner * hidden

    def other_params(self, hidden: int) -> int:
        """The conv1d (depthwise: conv_kernel taps per channel, and its bias), dt_bias, A_log
        and D (one per head), the gated RMSNorm's weight (d_inner) and projection biases."""
        conv = self.conv_dim * (self.conv_kernel + int(self.conv_bias))
        bias = (self.in_proj_width + hidden) if self.proj_bias else 0
        norm = self.d_inner if self.gated_norm else 0
        return conv + 3 * self.n_heads + norm + bias

    def params(self, hidden: int) -> int:
        """All parameters of the mixer (its layer's pre-norm apart)."""
        return self.matmul_params(hidden) + self.other_params(hidden)

    @property
    def scan_flops_per_token(self) -> int:
        """Forward FLOPs of the selective scan per token, as Megatron-LM counts them for MFU
        (``mamba_layer_flops``: 7 * d_in * d_state)."""
        return SCAN_FLOPS_PER_STATE * self.d_inner * self.d_state

    @property
    def conv_flops_per_token(self) -> int:
        """Forward FLOPs of the depthwise conv1d per token: a multiply-add per tap and channel."""
        return 2 * self.conv_kernel * self.conv_dim

    def ssd_flops_per_token(self) -> int:
        """Forward FLOPs per token of the chunked SSD scan as ``mamba_ssm``'s kernels run it
        (``ssd_combined``: Dao & Gu 2024, sec. 6, the four steps): the intra-chunk C B^T
        (2 * Q * G * N per token and group, Q = chunk_size), its product with x (2 * Q * d_inner),
        the chunk states B^T x (2 * d_inner * N) and their outputs C h (2 * d_inner * N). On
        tensor cores as batched GEMMs."""
        q, n = self.chunk_size, self.d_state
        return 2 * q * self.n_groups * n + 2 * q * self.d_inner + 4 * self.d_inner * n

    def ssd_kernels(self, act_bytes: int) -> tuple[tuple[SSDKernel, ...], tuple[SSDKernel, ...]]:
        """The chunked SSD scan as ``mamba_ssm`` runs it (``ops/triton/ssd_combined.py``
        ``_mamba_chunk_scan_combined_fwd`` / ``_bwd``; Megatron-Core's MambaMixer calls it
        through ``mamba_split_conv1d_scan_combined``): each Triton kernel's FLOPs and the bytes
        it reads and writes per token, over all heads (divide by tp for the local heads), for
        (forward, backward). Activations (x, B, C, dout, the outputs) are `act_bytes` wide;
        dt and its cumulative sums, the chunk states in their fp32 passes, C B^T and the
        gradients the kernels accumulate are fp32 (the kernels' ``tl.float32`` buffers). A chunk
        state, n_heads x head_dim x d_state per chunk of Q tokens, is d_inner x d_state / Q per
        token. FLOPs count each product of two matrices as 2 m n k, C B^T and its use over the
        whole Q x Q chunk (the intra-chunk products the kernels tile), as
        `ssd_flops_per_token`; the elementwise decay and cumsum work is left out (bytes
        dominate those kernels).

        Forward: ``_chunk_cumsum_fwd`` (dt -> dt, dA cumsum), ``_chunk_state_fwd`` (B^T x per
        chunk, fp32 states), ``_state_passing_fwd`` (states across chunks, written in the
        activation dtype), ``_bmm_chunk_fwd`` (C B^T, fp32), ``_chunk_scan_fwd`` (C B^T x within
        the chunk and C h from the states). Backward recomputes the first four (its
        ``_state_passing_fwd`` keeps fp32), then ``_chunk_scan_bwd_dstates``,
        ``_state_passing_bwd``, ``_chunk_scan_chunk_state_bwd_dx``, ``_chunk_state_bwd_db``,
        ``_chunk_scan_bwd_dC``, ``_chunk_scan_bwd_dcb``, ``_bmm_chunk_bwd`` for dB and dC,
        ``_chunk_scan_bwd_ddAcs_stable`` and ``_chunk_cumsum_bwd``."""
        a, f = act_bytes, 4
        d, n, q = self.d_inner, self.d_state, self.chunk_size
        h, gn, gq = self.n_heads, self.n_groups * self.d_state, self.n_groups * self.chunk_size
        state = d * n / q  # chunk-state elements per token
        cumsum = SSDKernel("chunk_cumsum", 0, h * a + 2 * h * f)
        chunk_state = SSDKernel("chunk_state", 2 * d * n, d * a + gn * a + 2 * h * f + state * f)
        bmm = SSDKernel("bmm_chunk", 2 * q * gn, 2 * gn * a + gq * f)
        forward = (
            cumsum,
            chunk_state,
            SSDKernel("state_passing", 0, state * (f + a)),
            bmm,
            SSDKernel(
                "chunk_scan",
                2 * q * d + 2 * d * n,
                gq * f + 2 * d * a + gn * a + state * a + 2 * h * f,
            ),
        )
        backward = (
            cumsum,
            bmm,
            chunk_state,
            SSDKernel("state_passing (fp32)", 0, 2 * state * f),
            SSDKernel("chunk_scan_bwd_dstates", 2 * d * n, gn * a + d * a + h * f + state * f),
            SSDKernel("state_passing_bwd", 0, 2 * state * f + 2 * state * a),
            SSDKernel(
                "chunk_scan_chunk_state_bwd_dx",
                2 * q * d + 2 * d * n,
                gq * f + 3 * d * a + gn * a + state * a + 3 * h * f,
            ),
            SSDKernel(
                "chunk_state_bwd_db", 2 * d * n, d * a + state * a + gn * a + gn * f + 2 * h * f
            ),
            SSDKernel("chunk_scan_bwd_dC", 2 * d * n, state * a + d * a + gn * a + gn * f + h * f),
            SSDKernel("chunk_scan_bwd_dcb", 2 * q * d, 2 * d * a + 2 * h * f + gq * f),
            SSDKernel("bmm_chunk_bwd", 4 * q * gn, 2 * gq * f + 2 * gn * a + 2 * gn * a),
            SSDKernel("chunk_scan_bwd_ddAcs", 2 * q * d, 2 * d * a + gq * f + 3 * h * f),
            SSDKernel("chunk_cumsum_bwd", 0, 4 * h * f),
        )
        return forward, backward

    def torch_scan(self, *, seq_len: int, tp: int = 1) -> TorchScan:
        """The chunked SSD scan as the Engine runs it in plain PyTorch
        (autosearch/models/ssm.py ``ssd_scan``, mamba_ssm's ``ssd_minimal_discrete``), on the
        n_heads / tp local heads of a sequence of `seq_len` tokens: each eager op in the order
        of the code, fp32. Where mamba_ssm's kernels (`ssd_kernels`) keep a chunk's Q x Q
        decays and C B^T in registers, this materialises them per chunk and head (``L``, the
        masked segment sums, their product with C B^T): Q elements per token and head, several
        passes each. ``torch.einsum`` contracts its operands left to right (no opt_einsum) as
        bmm's over copies laid out for them (``clone``). Per token: d = local heads x head_dim,
        hn = local heads x d_state (B and C repeated per head), hq = local heads x Q, the chunk
        states s = d x d_state / Q, and the state passing across c chunks of a sequence (its
        c x c decays)."""
        h = self.n_heads / tp
        p, n, q = self.head_dim, self.d_state, self.chunk_size
        g = max(self.n_groups / tp, 1.0)
        c = -(-seq_len // q)
        d, hn, hq, gn = h * p, h * n, h * q, g * n
        s = d * n / q
        cc = (c + 1) ** 2 / (c * q)  # state passing's (c+1) x (c+1) decays, per token and head
        ops = (
            TorchOp("repeat_interleave B, C", 0, 2 * (gn + hn), launches=2),
            TorchOp("x * dt", 0, 2 * d + h),
            TorchOp("A * dt", 0, 2 * h),
            TorchOp("pad x, dt, B, C", 0, 2 * d + 2 * h + 4 * hn, launches=4),
            TorchOp("causal masks: ones, tril, bitwise_not", 0, 0, launches=12),
            TorchOp("cumsum dA", 0, 2 * h),
            TorchOp("segment sum: masked_fill, cumsum, masked_fill, exp", 0, 8 * hq, launches=4),
            TorchOp("clone C, B for bmm", 0, 4 * hn, launches=2),
            TorchOp("bmm C B^T", 2 * q * hn, 2 * hn + hq, True, 1, (q, q, n)),
            TorchOp("mul by L", 0, 3 * hq),
            TorchOp("clone x for bmm", 0, 2 * d),
            TorchOp("bmm (C B^T L) x", 2 * q * d, hq + 2 * d, True, 1, (q, p, q)),
            TorchOp("decay_states: sub, exp", 0, 4 * h, launches=2),
            TorchOp("mul B by decay", 0, 2 * hn + h),
            TorchOp("clone x, B for bmm", 0, 2 * d + 2 * hn, launches=2),
            TorchOp("bmm states", 2 * d * n, d + hn + s, True, 1, (p, n, q)),
            TorchOp("zeros, cat states", 0, 3 * s, launches=2),
            TorchOp("chunk decays: pad, segment sum", 0, 10 * h * cc, launches=5),
            TorchOp(
                "bmm state passing",
                2 * cc * h * p * n,
                h * cc + 2 * (c + 1) * s / c,
                True,
                1,
                (c + 1, p * n, c + 1),
            ),
            TorchOp("exp A_cumsum", 0, 2 * h),
            TorchOp("clone C, states for bmm", 0, 2 * hn + 2 * s, launches=2),
            TorchOp("bmm C states", 2 * d * n, hn + s + d, True, 1, (q, p, n)),
            TorchOp("mul by decay, add, clone", 0, 7 * d + h, launches=3),
        )
        # saved for backward (each storage once): the decays L and C B^T and their product,
        # the bmm's operand copies, x dt, B, C, the states and the decays' exps
        saved = 3 * hq + 5 * hn + 4 * d + 2 * s + 5 * h
        return TorchScan(ops, backward_of(ops), saved)

    @classmethod
    def from_value(cls, value: Any, *, what: str) -> "MambaSpec":
        if isinstance(value, MambaSpec):
            return value
        if not isinstance(value, dict):
            raise SpecError(
                f"{what}: mamba must be a mapping such as {{n_heads: 128, head_dim: 64, "
                f"d_state: 128, n_groups: 8}}, got {type(value).__name__}"
            )
        kwargs = check_keys(value, cls, what=f"{what}: mamba")
        missing = [k for k in ("n_heads", "head_dim") if k not in kwargs]
        if missing:
            raise SpecError(f"{what}: mamba lacks {' and '.join(missing)}")
        return cls(**kwargs)


@dataclass(frozen=True, kw_only=True)
class GatedDeltaNetSpec:
    """The Gated DeltaNet mixer of the ``G`` layers (Yang, Kautz and Hatamizadeh 2024, "Gated
    Delta Networks"; Megatron-Core ``megatron/core/ssm/gated_delta_net.py``; Hugging Face
    ``Qwen3NextGatedDeltaNet``): in_proj to q, k (n_k_heads x head_k_dim each), v and the output
    gate z (n_v_heads x head_v_dim each) and to b and a (one per value head); a causal depthwise
    conv1d over q, k and v without bias; the gated delta rule scanned in chunks of
    ``chunk_size`` (flash-linear-attention ``chunk_gated_delta_rule``) on a fp32 state of
    head_k_dim x head_v_dim per value head; a gated RMSNorm of head_v_dim; out_proj back to h.
    Read from YAML as ``gdn: {n_k_heads: 16, n_v_heads: 32, head_k_dim: 128, head_v_dim: 128}``.

    Args:
        n_k_heads: query / key heads (``linear_num_key_heads``); tp must divide it.
        n_v_heads: value heads (``linear_num_value_heads``), a multiple of n_k_heads.
        head_k_dim: channels of a query / key head (``linear_key_head_dim``).
        head_v_dim: channels of a value head (``linear_value_head_dim``).
        conv_kernel: taps of the causal conv1d (``linear_conv_kernel_dim``, 4).
        chunk_size: tokens per chunk of the scan (flash-linear-attention's 64).
        gate_rank: Kimi Delta Attention (Kimi Team 2025, "Kimi Linear"; transformers
            ``KimiLinearDeltaAttention``): the decay is per channel, not per head, and both it
            and the output gate come through low-rank projections h -> gate_rank -> value_dim
            (``f_a_proj`` / ``f_b_proj``, ``g_a_proj`` / ``g_b_proj``; gate_rank is the head
            size), with a dt_bias per channel and A_log per head; None: Gated DeltaNet's full
            z projection and one decay per head. The chunked delta rule has the same products.
    """

    n_k_heads: int
    n_v_heads: int
    head_k_dim: int = 128
    head_v_dim: int = 128
    conv_kernel: int = 4
    chunk_size: int = 64
    gate_rank: int | None = None

    def check(self) -> "GatedDeltaNetSpec":
        p: list[str] = []
        for name, limit in (
            ("n_k_heads", _COUNT),
            ("n_v_heads", _COUNT),
            ("head_k_dim", _WIDTH),
            ("head_v_dim", _WIDTH),
            ("conv_kernel", 1 << 10),
            ("chunk_size", 1 << 20),
            ("gate_rank", _WIDTH),
        ):
            if name == "gate_rank" and self.gate_rank is None:
                continue
            try:
                positive_int(getattr(self, name), f"gdn.{name}", maximum=limit)
            except SpecError as exc:
                p.append(str(exc))
        if not p and self.n_v_heads % self.n_k_heads:
            p.append(
                f"gdn.n_v_heads {self.n_v_heads} must be a multiple of gdn.n_k_heads "
                f"{self.n_k_heads} (each key head serves whole value heads)"
            )
        if p:
            raise SpecError(p)
        return self

    @property
    def key_dim(self) -> int:
        return self.n_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.n_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """Channels the conv1d runs over: q, k and v."""
        return 2 * self.key_dim + self.value_dim

    @property
    def in_proj_width(self) -> int:
        """Outputs of the projections from h: Gated DeltaNet's in_proj_qkvz and in_proj_ba (q,
        k, v, z, then b and a); Kimi Delta Attention's q, k, v, b and the two low-rank
        down-projections of the gate and the decay."""
        if self.gate_rank is not None:
            return 2 * self.key_dim + self.value_dim + self.n_v_heads + 2 * self.gate_rank
        return 2 * self.key_dim + 2 * self.value_dim + 2 * self.n_v_heads

    @property
    def gate_up_width(self) -> int:
        """Outputs of Kimi Delta Attention's low-rank up-projections (gate and decay, value_dim
        each, from gate_rank); 0 for Gated DeltaNet."""
        return 0 if self.gate_rank is None else 2 * self.value_dim

    def matmul_params(self, hidden: int) -> int:
        """Weights of the in and out projections (and KDA's low-rank up-projections)."""
        up = self.gate_up_width * (self.gate_rank or 0)
        return hidden * self.in_proj_width + up + self.value_dim * hidden

    def other_params(self, hidden: int) -> int:
        """The conv1d (no bias), dt_bias and A_log (one per value head; KDA: dt_bias per
        channel), the gated norm."""
        conv = self.conv_dim * self.conv_kernel + self.head_v_dim
        if self.gate_rank is not None:
            return conv + self.value_dim + self.n_v_heads
        return conv + 2 * self.n_v_heads

    def params(self, hidden: int) -> int:
        """All parameters of the mixer (its layer's pre-norm apart)."""
        return self.matmul_params(hidden) + self.other_params(hidden)

    @property
    def scan_flops_per_token(self) -> int:
        """Forward FLOPs per token besides the projections, as Megatron-Bridge counts them for
        MFU (``flop_utils.py`` ``gdn_layer_flops``: the conv1d, 2 K (2 qk_dim + v_dim), and the
        delta rule, 8 n_v_heads head_v_dim^2)."""
        return 2 * self.conv_kernel * self.conv_dim + 8 * self.n_v_heads * self.head_v_dim**2

    def chunk_flops_per_token(self) -> int:
        """Forward FLOPs per token of the chunked gated delta rule as flash-linear-attention
        runs it (Yang et al. 2024, sec. 3.3, the WY form per chunk of C tokens), per value head:
        the intra-chunk K K^T and Q K^T (2 x 2 C d_k), their products with the values and the
        pseudo-values (2 x 2 C d_v), and the state's update and read-out (2 x 2 d_k d_v)."""
        c, dk, dv = self.chunk_size, self.head_k_dim, self.head_v_dim
        return self.n_v_heads * (4 * c * dk + 4 * c * dv + 4 * dk * dv)

    def torch_scan(self, *, seq_len: int, tp: int = 1) -> TorchScan:
        """The chunked gated delta rule as the Engine runs it in plain PyTorch
        (autosearch/models/ssm.py ``chunk_gated_delta_rule``, the WY form as transformers'
        ``torch_chunk_gated_delta_rule``), on the n_v_heads / tp local value heads (q and k
        repeated to them) of a sequence of `seq_len` tokens, fp32: the vectorised ops over all
        chunks (pads, the chunk's decays, K K^T, the triangular solve, u and w), then a Python
        loop over the c chunks, twelve ops each (`TorchOp.launches`). Per token: hk, hv = local
        heads x head_k_dim, x head_v_dim; hc = local heads x C (a chunk's C x C matrices);
        the state, hk x head_v_dim, once per chunk."""
        h = self.n_v_heads / tp
        k, v, q = self.head_k_dim, self.head_v_dim, self.chunk_size
        c = -(-seq_len // q)
        hk, hv, hc = h * k, h * v, h * q
        st = hk * v / q  # the state's elements per token (one per chunk)
        ops = (
            TorchOp("pad q, k, v, g, beta", 0, 4 * hk + 2 * hv + 4 * h, launches=5),
            TorchOp("q * scale", 0, 2 * hk),
            TorchOp("k * beta, v * beta", 0, 2 * hk + 2 * hv + 2 * h, launches=2),
            TorchOp("cumsum g", 0, 2 * h),
            TorchOp("masks: ones, tril, eye, bitwise_not", 0, 0, launches=6),
            TorchOp("decay: sub, masked_fill, exp", 0, 5 * hc, launches=3),
            TorchOp("clone k_beta, k^T for bmm", 0, 4 * hk, launches=2),
            TorchOp("bmm K K^T", 2 * q * hk, 2 * hk + hc, True, 1, (q, q, k)),
            TorchOp("mul decay, masked_fill, add eye", 0, 7 * hc, launches=3),
            TorchOp("solve_triangular", q * hc, 3 * hc, True, 1, (q, q, q), False),
            TorchOp("clone v_beta for bmm", 0, 2 * hv),
            TorchOp("bmm u = T v_beta", 2 * q * hv, hc + 2 * hv, True, 1, (q, v, q)),
            TorchOp("exp g, k_beta * exp g, clone", 0, 2 * h + 4 * hk + h, launches=3),
            TorchOp("bmm w = T k_beta", 2 * q * hk, hc + 2 * hk, True, 1, (q, k, q)),
            TorchOp("loop: bmm q k^T", 2 * q * hk, 2 * hk + hc, True, c, (q, q, k)),
            TorchOp("loop: mul decay, masked_fill", 0, 5 * hc, launches=2 * c),
            TorchOp("loop: bmm w state", 2 * hk * v, hk + st + hv, True, c, (q, v, k)),
            TorchOp("loop: sub", 0, 3 * hv, launches=c),
            TorchOp("loop: exp g, q * exp g", 0, 2 * hk + 3 * h, launches=2 * c),
            TorchOp("loop: bmm q state", 2 * hk * v, hk + st + hv, True, c, (q, v, k)),
            TorchOp("loop: bmm scores v_new", 2 * q * hv, hc + 2 * hv, True, c, (q, v, q)),
            TorchOp("loop: add", 0, 3 * hv, launches=c),
            TorchOp(
                "loop: exp, mul state, sub, exp, k * exp",
                0,
                2 * st + 2 * hk + 5 * h,
                launches=5 * c,
            ),
            TorchOp("loop: bmm k^T v_new", 2 * hk * v, hk + hv + st, True, c, (k, v, q)),
            TorchOp("loop: add state", 0, 3 * st, launches=c),
            TorchOp("stack", 0, 2 * hv),
        )
        # saved: the decays, K K^T, the solve's matrix and T, q k^T and the masked scores
        # (six C x C per chunk and head), q, k, k_beta and the bmm copies, v, v_beta, v_new,
        # the state of each chunk and the gates' exps
        saved = 6 * hc + 8 * hk + 3 * hv + st + 8 * h
        # the loop indexes six tensors by chunk (q, k, w: hk; u: hv; the decays: hc; g: h); the
        # gradient of each index is a zero tensor of the whole size with the chunk's gradient
        # copied in (derivatives.yaml: ``select_backward``), summed into the tensor's gradient
        # (autograd's accumulation, an add of the whole size): about four passes of the whole
        # tensor per chunk, so this backward grows with the chunks of a sequence
        indexed = 3 * hk + hv + hc + h
        select = TorchOp("loop: select_backward, accumulate", 0, 4 * c * indexed, launches=12 * c)
        return TorchScan(ops, (*backward_of(ops), select), saved)

    @classmethod
    def from_value(cls, value: Any, *, what: str) -> "GatedDeltaNetSpec":
        if isinstance(value, GatedDeltaNetSpec):
            return value
        if not isinstance(value, dict):
            raise SpecError(
                f"{what}: gdn must be a mapping such as {{n_k_heads: 16, n_v_heads: 32, "
                f"head_k_dim: 128, head_v_dim: 128}}, got {type(value).__name__}"
            )
        kwargs = check_keys(value, cls, what=f"{what}: gdn")
        missing = [k for k in ("n_k_heads", "n_v_heads") if k not in kwargs]
        if missing:
            raise SpecError(f"{what}: gdn lacks {' and '.join(missing)}")
        return cls(**kwargs)


# FLOPs of Mamba-1's selective scan per channel and state channel, forward: the recurrence of
# Gu & Dao 2023 (eqs. 2a, 4: zero-order hold) as mamba_ssm's selective_scan kernel computes it
# per (token, channel, state): exp(delta A) (a multiply and an exp), delta B x (two
# multiplies), h = dA h + dBx (a multiply-add, two) and its part of y = C h (a multiply-add,
# two). The paper gives the scan's cost as O(B L D N) without a constant (sec. 3.3.2); this is
# the count of those operations, not a fitted number.
SELECTIVE_SCAN_FLOPS_PER_STATE = 9


@dataclass(frozen=True, kw_only=True)
class Mamba1Spec:
    """The Mamba-1 mixer of the ``S`` layers (Gu & Dao 2023, "Mamba: Linear-Time Sequence
    Modeling with Selective State Spaces", sec. 3; mamba_ssm ``modules/mamba_simple.py``; Hugging
    Face ``JambaMambaMixer``): in_proj to x and z (d_inner each), a causal depthwise conv1d over
    x, x_proj from x to dt (dt_rank), B and C (d_state each, shared by all channels), dt_proj from
    dt_rank back to d_inner, the selective scan over a diagonal state of d_inner x d_state
    (A_log, D per channel), the output gated by silu(z), out_proj back to h. Jamba adds RMSNorms
    on dt, B and C (``dt_layernorm``, ``b_layernorm``, ``c_layernorm``). Read from YAML as
    ``mamba1: {d_inner: 8192, d_state: 16, dt_rank: 256}``.

    Args:
        d_inner: channels of x and z (``mamba_expand`` x hidden).
        d_state: state channels per channel (``mamba_d_state``, 16).
        dt_rank: width of the low-rank dt projection (``mamba_dt_rank``; "auto": hidden / 16).
        conv_kernel: taps of the causal conv1d (``mamba_d_conv``, 4).
        conv_bias: the conv1d has a bias (``mamba_conv_bias``).
        proj_bias: in_proj and out_proj have biases (``mamba_proj_bias``).
        inner_norms: RMSNorms on dt, B and C (Jamba's; not in mamba_ssm's Mamba).
    """

    d_inner: int
    d_state: int = 16
    dt_rank: int = 256
    conv_kernel: int = 4
    conv_bias: bool = True
    proj_bias: bool = False
    inner_norms: bool = True

    def check(self) -> "Mamba1Spec":
        p: list[str] = []
        for name, limit in (
            ("d_inner", _WIDTH),
            ("d_state", _WIDTH),
            ("dt_rank", _WIDTH),
            ("conv_kernel", 1 << 10),
        ):
            try:
                positive_int(getattr(self, name), f"mamba1.{name}", maximum=limit)
            except SpecError as exc:
                p.append(str(exc))
        for name in ("conv_bias", "proj_bias", "inner_norms"):
            if not isinstance(getattr(self, name), bool):
                p.append(f"mamba1.{name} must be true or false, got {getattr(self, name)!r}")
        if p:
            raise SpecError(p)
        return self

    @property
    def x_proj_width(self) -> int:
        """Outputs of x_proj: dt (dt_rank), B and C (d_state each)."""
        return self.dt_rank + 2 * self.d_state

    def matmul_params(self, hidden: int) -> int:
        """Weights of in_proj (h -> 2 d_inner), x_proj, dt_proj and out_proj."""
        d = self.d_inner
        return hidden * 2 * d + d * self.x_proj_width + self.dt_rank * d + d * hidden

    def other_params(self, hidden: int) -> int:
        """The conv1d (conv_kernel taps per channel, and its bias), dt_proj's bias, A_log
        (d_inner x d_state), D, the projection biases and Jamba's dt / B / C norms."""
        d = self.d_inner
        conv = d * (self.conv_kernel + int(self.conv_bias))
        bias = (2 * d + hidden) if self.proj_bias else 0
        norms = self.x_proj_width if self.inner_norms else 0
        return conv + d + d * self.d_state + d + bias + norms

    def params(self, hidden: int) -> int:
        """All parameters of the mixer (its layer's pre-norm apart)."""
        return self.matmul_params(hidden) + self.other_params(hidden)

    @property
    def scan_flops_per_token(self) -> int:
        """Forward FLOPs of the selective scan per token (`SELECTIVE_SCAN_FLOPS_PER_STATE` per
        channel and state channel), on CUDA cores: no matrix product in it."""
        return SELECTIVE_SCAN_FLOPS_PER_STATE * self.d_inner * self.d_state

    def scan_bytes_per_token(self, act_bytes: int) -> tuple[float, float]:
        """Bytes the fused selective-scan kernels move through HBM per token, over all channels
        (forward, backward). Gu & Dao 2023, sec. 3.3.2: the kernel loads delta, A, B, C from HBM
        into SRAM, discretizes and scans there, and writes only the output; the d_inner x
        d_state state never reaches HBM, and backward recomputes it. Forward
        (``selective_scan_fwd``, z and D fused): reads x, delta, z (d_inner each) and B, C
        (d_state each), writes y (d_inner). Backward (``selective_scan_bwd``): reads those and
        dy, writes dx, ddelta, dz (d_inner each) and dB, dC in fp32 (their sums over
        channels)."""
        a, d, n = act_bytes, self.d_inner, self.d_state
        forward = a * (3 * d + 2 * n) + a * d
        backward = a * (4 * d + 2 * n) + a * 3 * d + 4 * 2 * n
        return forward, backward

    @classmethod
    def from_value(cls, value: Any, *, what: str) -> "Mamba1Spec":
        if isinstance(value, Mamba1Spec):
            return value
        if not isinstance(value, dict):
            raise SpecError(
                f"{what}: mamba1 must be a mapping such as {{d_inner: 8192, d_state: 16, "
                f"dt_rank: 256}}, got {type(value).__name__}"
            )
        kwargs = check_keys(value, cls, what=f"{what}: mamba1")
        if "d_inner" not in kwargs:
            raise SpecError(f"{what}: mamba1 lacks d_inner")
        return cls(**kwargs)
