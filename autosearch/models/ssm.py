"""The state-space and linear-attention mixers of hybrid models, in plain PyTorch.

* `Mamba2Mixer`, the ``M`` layers (Dao & Gu 2024, "Transformers are SSMs", Mamba-2): in_proj to
  z, x, B, C and dt; a causal depthwise conv1d over x, B and C; the selective state-space scan
  run as the chunked SSD algorithm (`ssd_scan`); a gated RMSNorm over groups of channels; out_proj.
* `GatedDeltaNet`, the ``G`` layers (Yang, Kautz and Hatamizadeh 2024, "Gated Delta Networks"):
  in_proj to q, k, v, the output gate z and to b, a; a causal depthwise conv1d over q, k and v;
  the gated delta rule run chunk by chunk in its WY form (`chunk_gated_delta_rule`); a gated
  RMSNorm per value head; out_proj.

Written by hand because no maintained library ships these scans importable on a machine
without their GPU builds: ``mamba_ssm`` keeps its torch reference in
``mamba_ssm/modules/ssd_minimal.py`` and flash-linear-attention its chunked form in Triton
(``fla/ops/gated_delta_rule/chunk.py``), and both packages install only with their CUDA /
Triton builds; transformers keeps its torch paths inside the model files
(``modeling_nemotron_h.mamba2_chunk_scan``, ``modeling_qwen3_next.torch_chunk_gated_delta_rule``).
Parameter names are transformers' (``in_proj``, ``conv1d``, ``dt_bias``, ``A_log``, ``D``,
``norm``, ``out_proj``; ``in_proj_qkvz``, ``in_proj_ba``); the packed rows are laid out group
by group for tensor parallel (`grouped_order`), and `from_transformers` / `to_transformers`
convert a mixer's state dict (tests/test_ssm.py checks the outputs against transformers' own
torch path on the same weights).

Both scans take their inputs in float32 whatever the input dtype, as transformers' torch paths
do; under an autocast region their einsums and matmuls are on autocast's lower-precision list,
so they run in bf16 / fp16 there, as transformers' torch paths do too (the fused mamba_ssm and
flash-linear-attention kernels accumulate in fp32 instead). The `torch` runtime prices them so
(`ssm_scan: torch_chunked`, docs/runtimes.md [1.10]). Their step-by-step recurrences are in
tests/test_ssm.py, which checks the chunked forms against them in float64.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from autosearch.core._ssm import GatedDeltaNetSpec, MambaSpec

if TYPE_CHECKING:  # pragma: no cover
    from autosearch.core.model_spec import ModelSpec

# Mamba-2's initial step sizes span [DT_MIN, DT_MAX] (mamba_ssm ``Mamba2``: dt_min=0.001,
# dt_max=0.1, the defaults of transformers' Mamba2 / NemotronH configs ``time_step_min/max``).
DT_MIN, DT_MAX = 1e-3, 1e-1
# Gated DeltaNet's decay rates A = exp(A_log) span (0, GDN_A_MAX] (transformers
# ``Qwen3NextGatedDeltaNet``: A_log = log(uniform(0, 16))).
GDN_A_MAX = 16.0
# The eps of transformers' l2norm of q and k in the gated delta rule (``use_qk_l2norm_in_kernel``).
L2NORM_EPS = 1e-6


def _at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    """`t` in float32, or float64 if it is (the tests' exact runs)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _segment_sum(x: torch.Tensor) -> torch.Tensor:
    """out[..., i, j] = x[..., j+1] + ... + x[..., i] for j <= i, -inf above the diagonal:
    the log-decay from position j to i (mamba_ssm ``ssd_minimal.segsum``, the stable form that
    sums the masked values instead of subtracting two cumulative sums)."""
    t = x.shape[-1]
    x = x[..., None].expand(*x.shape, t)
    strict = torch.tril(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=-1)
    x = x.masked_fill(~strict, 0)
    out = torch.cumsum(x, dim=-2)
    lower = torch.tril(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=0)
    return out.masked_fill(~lower, -torch.inf)


def ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    chunk_size: int,
) -> torch.Tensor:
    """Mamba-2's selective scan h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T, y_t = h_t C_t from
    h_0 = 0, in chunks (Dao & Gu 2024, sec. 6, the SSD algorithm; mamba_ssm
    ``ssd_minimal_discrete``): the outputs within each chunk as a masked quadratic form, each
    chunk's final state, the states passed from chunk to chunk, and their outputs.

    Args:
        x: (batch, seq, heads, head_dim).
        dt: (batch, seq, heads), the step sizes after softplus.
        A: (heads,), negative.
        B, C: (batch, seq, groups, d_state); each group serves heads / groups heads.
        chunk_size: tokens per chunk; a sequence is padded to a multiple of it (zero steps,
            which change no earlier output).

    Returns:
        y (batch, seq, heads, head_dim) in float32, float64 for float64 inputs (the D skip
        is the caller's).
    """
    batch, seq, heads, _ = x.shape
    rep = heads // B.shape[2]
    x, dt, B, C = (_at_least_fp32(t) for t in (x, dt, B, C))
    B = B.repeat_interleave(rep, dim=2)
    C = C.repeat_interleave(rep, dim=2)
    pad = (chunk_size - seq % chunk_size) % chunk_size
    xd = F.pad(x * dt[..., None], (0, 0, 0, 0, 0, pad))
    Ad = F.pad(A.to(dt.dtype) * dt, (0, 0, 0, pad))
    B, C = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (B, C))
    # (batch, chunks, chunk, heads, ...): "b (c l) ... -> b c l ..."
    xd, Ad, B, C = (t.reshape(batch, -1, chunk_size, *t.shape[2:]) for t in (xd, Ad, B, C))
    Ad = Ad.permute(0, 3, 1, 2)  # b h c l
    A_cumsum = torch.cumsum(Ad, dim=-1)
    # 1. outputs within each chunk (the diagonal blocks)
    L = torch.exp(_segment_sum(Ad))
    y_diag = torch.einsum("bclhn,bcshn,bhcls,bcshp->bclhp", C, B, L, xd)
    # 2. the state each chunk ends with, from its own tokens
    decay_states = torch.exp(A_cumsum[..., -1:] - A_cumsum)
    states = torch.einsum("bclhn,bhcl,bclhp->bchpn", B, decay_states, xd)
    # 3. the states entering each chunk, passed across chunks
    states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)
    decay_chunk = torch.exp(_segment_sum(F.pad(A_cumsum[..., -1], (1, 0))))
    states = torch.einsum("bhzc,bchpn->bzhpn", decay_chunk, states)[:, :-1]
    # 4. the outputs of the entering states
    y_off = torch.einsum("bclhn,bchpn,bhcl->bclhp", C, states, torch.exp(A_cumsum))
    y = (y_diag + y_off).reshape(batch, -1, heads, x.shape[-1])
    return y[:, :seq]


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (transformers' ``l2norm`` of qwen3_next,
    flash-linear-attention's ``l2norm_fwd``)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    chunk_size: int,
) -> torch.Tensor:
    """The gated delta rule S_t = exp(g_t) S_{t-1} (I - beta_t k_t k_t^T) + beta_t k_t v_t^T,
    o_t = S_t^T q_t / sqrt(d_k), from S_0 = 0 (Yang et al. 2024, eq. 10), in chunks: within a
    chunk the WY form (sec. 3.3; flash-linear-attention ``chunk_gated_delta_rule``,
    transformers ``torch_chunk_gated_delta_rule``), the state carried from chunk to chunk.

    The chunk's (I + strictly-lower(beta K K^T * decay))^-1 is a triangular solve here, where
    transformers runs the forward substitution row by row in place.

    Args:
        q, k: (batch, seq, heads, d_k), already l2-normalised if the model does so.
        v: (batch, seq, heads, d_v).
        g: (batch, seq, heads), the log decay (<= 0).
        beta: (batch, seq, heads), the write strength in (0, 1).
        chunk_size: tokens per chunk; a sequence is padded to a multiple of it.

    Returns:
        o (batch, seq, heads, d_v) in float32, float64 for float64 inputs.
    """
    seq = q.shape[1]
    q, k, v, g, beta = (_at_least_fp32(t.transpose(1, 2)) for t in (q, k, v, g, beta))  # b h s ...
    batch, heads, _, d_k = k.shape
    pad = (chunk_size - seq % chunk_size) % chunk_size
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    q = q * d_k**-0.5
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    q, k, v, k_beta, v_beta = (
        t.reshape(batch, heads, -1, chunk_size, t.shape[-1]) for t in (q, k, v, k_beta, v_beta)
    )
    g = g.reshape(batch, heads, -1, chunk_size).cumsum(dim=-1)
    lower = torch.tril(torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device))
    # decay[i, j] = exp(g_i - g_j) for j <= i (masked before exp: no overflow above)
    decay = torch.exp((g[..., :, None] - g[..., None, :]).masked_fill(~lower, -torch.inf))
    strict = torch.tril(lower, diagonal=-1)
    eye = torch.eye(chunk_size, dtype=q.dtype, device=q.device)
    # T = (I + strictly-lower(diag(beta) K K^T * decay))^-1, the UT transform of the chunk
    tri = eye + ((k_beta @ k.transpose(-1, -2)) * decay).masked_fill(~strict, 0)
    T = torch.linalg.solve_triangular(tri, eye.expand_as(tri), upper=False, unitriangular=True)
    u = T @ v_beta  # the pseudo-values
    w = T @ (k_beta * g.exp()[..., None])  # the keys' decayed cumulative writes
    state = q.new_zeros(batch, heads, d_k, v.shape[-1])
    out = []
    for c in range(q.shape[2]):
        q_c, k_c, g_c = q[:, :, c], k[:, :, c], g[:, :, c]
        scores = (q_c @ k_c.transpose(-1, -2) * decay[:, :, c]).masked_fill(~lower, 0)
        v_new = u[:, :, c] - w[:, :, c] @ state
        out.append((q_c * g_c.exp()[..., None]) @ state + scores @ v_new)
        last = g_c[..., -1:]
        state = (
            state * last.exp()[..., None]
            + (k_c * (last - g_c).exp()[..., None]).transpose(-1, -2) @ v_new
        )
    o = torch.stack(out, dim=2).reshape(batch, heads, -1, v.shape[-1])[:, :, :seq]
    return o.transpose(1, 2)


class GatedRMSNorm(nn.Module):
    """Mamba-2's gated RMSNorm over groups of `group_size` channels: weight * rmsnorm(x *
    silu(z)) per group (Nemotron-H, mamba_ssm ``RMSNormGated(norm_before_gate=False)``), in
    float32. A tensor-parallel rank holding whole groups normalises its own channels with its
    rows of the weight (Megatron's ``mamba_mixer``: the group size is the same on every rank).
    """

    def __init__(self, width: int, *, group_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.group_size = group_size
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float() * F.silu(z.float())
        grouped = x.unflatten(-1, (-1, self.group_size))
        x = (grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        return _local(self.weight) * x.to(dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class HeadRMSNorm(nn.Module):
    """Gated DeltaNet's RMSNorm of each value head, weight * rmsnorm(x) (the gate is the
    mixer's; transformers ``Qwen3NextRMSNormGated`` computes the same product in the same order).
    One module input, so that under tensor parallel `SequenceParallel` over the head dim keeps
    the shared weight replicated and sums its gradient over the ranks' heads."""

    def __init__(self, width: int, *, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def _depthwise_conv(channels: int, kernel: int, *, bias: bool) -> nn.Conv1d:
    """A causal depthwise conv1d (padded by kernel - 1; the caller keeps the first seq outputs)."""
    return nn.Conv1d(channels, channels, kernel, groups=channels, padding=kernel - 1, bias=bias)


def _assign(param: torch.Tensor, values: torch.Tensor) -> None:
    """Copy the whole parameter's `values` into `param`, or into the shard of them a DTensor
    parameter holds (FSDP2, tensor parallel), without communication."""
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(
            param.shape, param.device_mesh, param.placements
        )
        window = tuple(slice(o, o + n) for o, n in zip(offset, shape))
        param.to_local().copy_(values[window])
    else:
        param.copy_(values)


def _init_conv(conv: nn.Conv1d) -> None:
    """Normal weights with the standard deviation of PyTorch's default uniform init
    (bound 1 / sqrt(fan_in), fan_in = the taps of a depthwise channel), zero bias: normal
    draws are what the Engine reproduces on any sharding
    (`autosearch.engine.build.WholeWeightNormal`)."""
    nn.init.normal_(conv.weight, std=1.0 / math.sqrt(3 * conv.kernel_size[0]))
    if conv.bias is not None:
        nn.init.zeros_(conv.bias)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor-parallel parameter (a DTensor), else the tensor."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _causal_conv(conv: nn.Conv1d, x: torch.Tensor) -> torch.Tensor:
    """silu(depthwise causal conv1d) of (batch, seq, channels) on this rank's channels."""
    seq, bias = x.shape[1], conv.bias
    weight = _local(conv.weight)
    y = F.conv1d(
        x.transpose(1, 2),
        weight,
        None if bias is None else _local(bias),
        padding=conv.padding,
        groups=weight.shape[0],
    )
    return F.silu(y[..., :seq].transpose(1, 2))


def grouped_order(widths: "list[int]", groups: int) -> torch.Tensor:
    """Where each row of the grouped layout comes from in the concatenated one: parts of
    `widths` side by side (transformers' ``[z | x | B | C | dt]``) regrouped as, for each of
    `groups` groups, that group's slice of every part (``[z_0 x_0 B_0 C_0 dt_0 | z_1 ...]``).
    A contiguous block of 1/tp of the rows is then whole groups for any tp dividing `groups`,
    which is what DTensor's ``Shard(0)`` gives a rank (Phi-3's fused rows are re-laid for the
    same reason, `autosearch.models.hf.phi3`)."""
    starts = [sum(widths[:i]) for i in range(len(widths))]
    return torch.cat(
        [
            torch.arange(start + j * (w // groups), start + (j + 1) * (w // groups))
            for j in range(groups)
            for start, w in zip(starts, widths)
        ]
    )


class _GroupedLayout(nn.Module):
    """A mixer whose packed rows are laid out group by group (`grouped_order`), convertible to
    and from transformers' layout (parameter names are the same)."""

    def _orders(self) -> dict[str, torch.Tensor]:  # parameter name -> `grouped_order`
        raise NotImplementedError

    def from_transformers(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """transformers' state dict of this mixer in this module's layout."""
        orders = self._orders()
        return {k: v[orders[k]] if k in orders else v for k, v in state.items()}

    def to_transformers(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This module's state dict in transformers' layout."""
        out = dict(state)
        for name, order in self._orders().items():
            if name in state:
                out[name] = torch.empty_like(state[name])
                out[name][order] = state[name]
        return out


class Mamba2Mixer(_GroupedLayout):
    """The Mamba-2 mixer (transformers ``NemotronHMamba2Mixer`` / ``Mamba2Mixer`` torch path,
    Megatron-Core ``MambaMixer``), without inference caches.

    Laid out for tensor parallel: the rows of in_proj and the channels of the conv1d go group
    by group of B and C (`grouped_order`: for each group its heads' z and x, its B and C, its
    heads' dt), the heads' dt_bias, A_log, D and the norm's channels in head order (already by
    group), so that with in_proj column-parallel, out_proj row-parallel and the rest split by
    rows, each tp rank holds n_groups / tp whole groups and computes them on its own (the
    forward reads its shapes from the local tensors). `from_transformers` / `to_transformers`
    convert state dicts.

    Args:
        spec: the mixer's shape (`autosearch.core._ssm.MambaSpec`).
        hidden_size: the model width.
        eps: the gated norm's epsilon.
    """

    def __init__(self, spec: MambaSpec, hidden_size: int, *, eps: float = 1e-5):
        super().__init__()
        self.spec = spec
        self.in_proj = nn.Linear(hidden_size, spec.in_proj_width, bias=spec.proj_bias)
        self.conv1d = _depthwise_conv(spec.conv_dim, spec.conv_kernel, bias=spec.conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(spec.n_heads))
        self.A_log = nn.Parameter(torch.empty(spec.n_heads))
        self.D = nn.Parameter(torch.empty(spec.n_heads))
        self.norm = GatedRMSNorm(spec.d_inner, group_size=spec.d_inner // spec.n_groups, eps=eps)
        self.out_proj = nn.Linear(spec.d_inner, hidden_size, bias=spec.proj_bias)
        self.init_ssm()

    def _orders(self) -> dict[str, torch.Tensor]:
        s = self.spec
        bc = s.n_groups * s.d_state
        rows = grouped_order([s.d_inner, s.d_inner, bc, bc, s.n_heads], s.n_groups)
        channels = grouped_order([s.d_inner, bc, bc], s.n_groups)
        return {
            "in_proj.weight": rows,
            "in_proj.bias": rows,
            "conv1d.weight": channels,
            "conv1d.bias": channels,
        }

    @torch.no_grad()
    def init_ssm(self) -> None:
        """A_log = log(1..heads) and D = 1 (mamba_ssm ``Mamba2``); dt_bias the inverse softplus
        of step sizes log-spaced over [DT_MIN, DT_MAX] (mamba_ssm draws them log-uniformly on
        that range; a fixed grid starts every layout the same); the conv as `_init_conv`. The
        projections are the model's to initialise."""
        n = self.spec.n_heads
        dev = self.A_log.device
        _assign(self.A_log, torch.log(torch.arange(1, n + 1, dtype=torch.float32, device=dev)))
        self.D.fill_(1.0)
        dt = torch.exp(torch.linspace(math.log(DT_MIN), math.log(DT_MAX), n, device=dev))
        _assign(self.dt_bias, dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) = dt
        _init_conv(self.conv1d)
        self.norm.reset_parameters()

    def forward(self, hidden_states: torch.Tensor, **_: Any) -> torch.Tensor:
        """The mixer's output; keyword arguments (transformers' cache and mask, None when
        training) are ignored."""
        s = self.spec
        rep, width, n = s.n_heads // s.n_groups, s.head_dim, s.d_state
        per_head = rep * width  # channels of z (and of x) per group
        hidden = hidden_states
        proj = self.in_proj(hidden)  # this rank's groups, (batch, seq, groups * per group)
        batch, seq = proj.shape[:2]
        proj = proj.unflatten(-1, (-1, 2 * per_head + 2 * n + rep))
        groups = proj.shape[2]
        z, xbc, dt = proj.split([per_head, per_head + 2 * n, rep], dim=-1)
        xbc = _causal_conv(self.conv1d, xbc.flatten(2)).unflatten(-1, (groups, -1))
        x, B, C = xbc.split([per_head, n, n], dim=-1)
        x = x.reshape(batch, seq, groups * rep, width)
        dt = F.softplus(dt.flatten(2).float() + _local(self.dt_bias).float())
        y = ssd_scan(x, dt, -torch.exp(_local(self.A_log).float()), B, C, chunk_size=s.chunk_size)
        y = y + x.float() * _local(self.D).float()[:, None]  # the skip connection D x
        y = self.norm(y.flatten(2), z.flatten(2))
        return self.out_proj(y.to(hidden.dtype))


class GatedDeltaNet(_GroupedLayout):
    """The Gated DeltaNet mixer (transformers ``Qwen3NextGatedDeltaNet`` torch path,
    Megatron-Core ``GatedDeltaNet``), without inference caches: q and k l2-normalised,
    beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias), o = norm(o) * silu(z).

    Laid out for tensor parallel as transformers lays in_proj_qkvz and in_proj_ba out (by key
    head: its q, k, its value heads' v and z; its value heads' b and a) and the conv1d's
    channels the same way (transformers: all q, all k, all v; `grouped_order`), so that each tp
    rank holds n_k_heads / tp whole key heads with their value heads. The norm's weight, shared
    by every head, stays whole (its gradient summed over tp: `Transformer.tp_plan`).

    Args:
        spec: the mixer's shape (`autosearch.core._ssm.GatedDeltaNetSpec`).
        hidden_size: the model width.
        eps: the norm's epsilon.
    """

    def __init__(self, spec: GatedDeltaNetSpec, hidden_size: int, *, eps: float = 1e-5):
        super().__init__()
        self.spec = spec
        self.in_proj_qkvz = nn.Linear(
            hidden_size, 2 * spec.key_dim + 2 * spec.value_dim, bias=False
        )
        self.in_proj_ba = nn.Linear(hidden_size, 2 * spec.n_v_heads, bias=False)
        self.conv1d = _depthwise_conv(spec.conv_dim, spec.conv_kernel, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(spec.n_v_heads))
        self.A_log = nn.Parameter(torch.empty(spec.n_v_heads))
        self.norm = HeadRMSNorm(spec.head_v_dim, eps=eps)
        self.out_proj = nn.Linear(spec.value_dim, hidden_size, bias=False)
        self.init_ssm()

    def _orders(self) -> dict[str, torch.Tensor]:
        s = self.spec
        return {"conv1d.weight": grouped_order([s.key_dim, s.key_dim, s.value_dim], s.n_k_heads)}

    @torch.no_grad()
    def init_ssm(self) -> None:
        """dt_bias = 1 (transformers); A = exp(A_log) evenly spaced over (0, GDN_A_MAX]
        (transformers draws it uniformly on that range; a fixed grid starts every layout the
        same); the conv as `_init_conv`."""
        n = self.spec.n_v_heads
        dev = self.A_log.device
        self.dt_bias.fill_(1.0)
        grid = torch.arange(1, n + 1, dtype=torch.float32, device=dev) * (GDN_A_MAX / n)
        _assign(self.A_log, torch.log(grid))
        _init_conv(self.conv1d)
        self.norm.reset_parameters()

    def forward(self, hidden_states: torch.Tensor, **_: Any) -> torch.Tensor:
        """The mixer's output; keyword arguments (transformers' cache and mask) are ignored."""
        s = self.spec
        hidden = hidden_states
        r, dk, dv = s.n_v_heads // s.n_k_heads, s.head_k_dim, s.head_v_dim
        qkvz = self.in_proj_qkvz(hidden)  # this rank's key heads
        batch, seq = qkvz.shape[:2]
        qkvz = qkvz.unflatten(-1, (-1, 2 * dk + 2 * r * dv))
        k_heads = qkvz.shape[2]
        qkv, z = qkvz.split([2 * dk + r * dv, r * dv], dim=-1)
        b, a = self.in_proj_ba(hidden).unflatten(-1, (k_heads, 2 * r)).split(r, dim=-1)
        qkv = _causal_conv(self.conv1d, qkv.flatten(2)).unflatten(-1, (k_heads, -1))
        q, k, v = qkv.split([dk, dk, r * dv], dim=-1)
        q, k = (t.repeat_interleave(r, dim=2) for t in (q, k))  # each key head's value heads
        v = v.reshape(batch, seq, k_heads * r, dv)
        beta = b.flatten(2).sigmoid()
        g = -_local(self.A_log).float().exp() * F.softplus(
            a.flatten(2).float() + _local(self.dt_bias).float()
        )
        o = chunk_gated_delta_rule(
            l2norm(q.float()), l2norm(k.float()), v, g, beta, chunk_size=s.chunk_size
        )
        o = self.norm(o.to(hidden.dtype))
        o = (o * F.silu(z.reshape(batch, seq, -1, dv).float())).to(hidden.dtype)
        return self.out_proj(o.flatten(2))


# ---- tensor parallel ----------------------------------------------------------------------------
def _rows_style(children: tuple[str, ...], *, gather_input: bool):
    """A DTensor parallel style for a mixer that splits by rows over tp (``Shard(0)``) its own
    parameters (per head: dt_bias, A_log, D) and those of `children` (the conv1d's channels,
    Mamba's norm channels), which it reads as local tensors (`_local`). Its projections have
    their own styles (applied before: DTensor parameters are left alone). With `gather_input`
    its input, this rank's shard of the sequence under sequence parallel, is gathered whole
    first (as ``PrepareModuleInput`` does for an attention layer)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
    from torch.distributed.tensor import distribute_tensor as distribute
    from torch.distributed.tensor.parallel.style import ParallelStyle

    def partition(name: str, module: nn.Module, mesh) -> None:
        if name and name not in children:
            return
        for key, p in list(module.named_parameters(recurse=False)):
            if not isinstance(p, DTensor):
                sharded = distribute(p, mesh, [Shard(0)])
                module.register_parameter(key, nn.Parameter(sharded, p.requires_grad))

    def whole(x: torch.Tensor, mesh) -> torch.Tensor:
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, (Shard(1),), run_check=False)
        return x.redistribute(placements=(Replicate(),))

    class ShardRows(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
            distribute_module(module, device_mesh, partition)
            if gather_input:  # the input by position or as transformers passes it, by keyword

                def hook(_module: nn.Module, args: tuple, kwargs: dict) -> tuple:
                    if args:
                        return (whole(args[0], device_mesh), *args[1:]), kwargs
                    return args, {
                        **kwargs,
                        "hidden_states": whole(kwargs["hidden_states"], device_mesh),
                    }

                module.register_forward_pre_hook(hook, with_kwargs=True)
            return module

    return ShardRows()


def ssm_tp_plan(prefix: str, mixer: str, *, sequence_parallel: bool) -> dict:
    """The tensor-parallel plan of one Mamba-2 (`mixer` ``mamba``) or Gated DeltaNet (``gdn``)
    mixer at `prefix` (``layers.3.mixer``), as Megatron-Core splits them (``mamba_mixer.py``,
    ``gated_delta_net.py``): the in projections column-parallel (whole groups, or key heads,
    per rank: the layouts of `Mamba2Mixer` / `GatedDeltaNet`), out_proj row-parallel (an
    all-reduce, or a reduce-scatter with sequence parallel), the conv1d and the per-head
    parameters split with their channels and heads; Gated DeltaNet's norm, shared by the heads,
    replicated with its gradient summed over tp (`SequenceParallel` over the head dim, as
    torchtitan's Qwen3 q/k norms)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )

    act = Shard(1) if sequence_parallel else Replicate()
    ins = ("in_proj",) if mixer == "mamba" else ("in_proj_qkvz", "in_proj_ba")
    plan: dict = {f"{prefix}.{name}": ColwiseParallel() for name in ins}
    plan[f"{prefix}.out_proj"] = RowwiseParallel(output_layouts=act)
    if mixer == "gdn":
        plan[f"{prefix}.norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    children = ("conv1d", "norm") if mixer == "mamba" else ("conv1d",)
    plan[prefix] = _rows_style(children, gather_input=sequence_parallel)  # last: the rest
    return plan


def ssm_strategy_problems(spec: "ModelSpec", strategy: Any) -> list[str]:
    """What the Engine's Mamba-2 and Gated DeltaNet mixers cannot run of `strategy`, beyond the
    rules every runtime shares (`Strategy.problems`): context parallel over Mamba-2 layers is a
    rule the planner knows (Megatron-Core's head-wise all-to-all,
    `autosearch.core.rules.context_parallel_problem`) but these mixers scan the whole sequence
    on one rank, so the Engine refuses it (Gated DeltaNet's cp is refused by the rules)."""
    if strategy.cp > 1 and spec.mamba is not None:
        return [
            f"cp={strategy.cp} with Mamba-2 layers: the Engine's mixers do not run "
            "Megatron-Core's head-wise all-to-all context parallel; use cp=1, or plan and "
            "export for --runtime megatron-core"
        ]
    return []
