"""The state-space and linear-attention mixers (autosearch/models/ssm.py) on CPU.

Each chunked scan equals its step-by-step recurrence, written here from the papers, in float64
to 1e-10 (the chunked forms reassociate the same sums; float64 rounding is ~1e-16 per op, and the
decays exp(sum of log-decays) are exact to that), on sequences that are not a multiple of the
chunk (the padded tail). Each mixer equals transformers' own torch path (its mixer module, the
same weights loaded into ours under the same names) in float32 to 2e-5 absolute on outputs of
order 0.1-1: transformers reduces in another order (a forward substitution row by row where we
solve the triangle, sums of broadcast products where we use einsum), each a few float32 ulps
(1.2e-7) per step over chunks of 8-16 tokens.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from autosearch.core._ssm import GatedDeltaNetSpec, MambaSpec  # noqa: E402
from autosearch.models.ssm import (  # noqa: E402
    GatedDeltaNet,
    Mamba2Mixer,
    chunk_gated_delta_rule,
    ssd_scan,
)

FP64_TOL = 1e-10
FP32_TOL = 2e-5


def _ssd_recurrence(x, dt, A, B, C):
    """h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T, y_t = h_t C_t (Dao & Gu 2024, eq. 1 with
    the zero-order-hold discretisation of Mamba-2: A_bar = exp(dt A), B_bar = dt B)."""
    batch, seq, heads, p = x.shape
    rep = heads // B.shape[2]
    B, C = B.repeat_interleave(rep, dim=2), C.repeat_interleave(rep, dim=2)
    h = x.new_zeros(batch, heads, p, B.shape[-1])
    ys = []
    for t in range(seq):
        decay = torch.exp(dt[:, t] * A)[..., None, None]
        h = decay * h + (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
        ys.append((h * C[:, t, :, None, :]).sum(-1))
    return torch.stack(ys, dim=1)


def _delta_rule_recurrence(q, k, v, g, beta):
    """S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - (exp(g_t) S_{t-1})^T k_t)^T, o_t = S_t^T q_t /
    sqrt(d_k) (Yang et al. 2024, eq. 10, S of shape d_k x d_v)."""
    batch, seq, heads, d_k = k.shape
    S = q.new_zeros(batch, heads, d_k, v.shape[-1])
    out = []
    for t in range(seq):
        S = S * torch.exp(g[:, t])[..., None, None]
        memory = (S * k[:, t, ..., None]).sum(-2)
        delta = (v[:, t] - memory) * beta[:, t, :, None]
        S = S + k[:, t, ..., None] * delta[..., None, :]
        out.append((S * q[:, t, ..., None]).sum(-2) * d_k**-0.5)
    return torch.stack(out, dim=1)


@pytest.mark.parametrize("seq,chunk", [(37, 8), (16, 16), (5, 8)])
def test_ssd_scan_equals_the_recurrence(seq, chunk):
    g = torch.Generator().manual_seed(0)
    batch, heads, groups, p, n = 2, 4, 2, 3, 5
    x = torch.randn(batch, seq, heads, p, dtype=torch.float64, generator=g)
    dt = torch.nn.functional.softplus(torch.randn(batch, seq, heads, generator=g)).double()
    A = -torch.rand(heads, generator=g).double() * 2
    B = torch.randn(batch, seq, groups, n, dtype=torch.float64, generator=g)
    C = torch.randn(batch, seq, groups, n, dtype=torch.float64, generator=g)
    want = _ssd_recurrence(x, dt, A, B, C)
    got = ssd_scan(x, dt, A, B, C, chunk_size=chunk)
    assert got.dtype == torch.float64 and (got - want).abs().max() < FP64_TOL


@pytest.mark.parametrize("seq,chunk", [(37, 8), (16, 16), (5, 8)])
def test_chunked_gated_delta_rule_equals_the_recurrence(seq, chunk):
    g = torch.Generator().manual_seed(1)
    batch, heads, d_k, d_v = 2, 3, 4, 6
    unit = lambda t: t / t.norm(dim=-1, keepdim=True)  # noqa: E731 - q, k l2-normalised
    q = unit(torch.randn(batch, seq, heads, d_k, dtype=torch.float64, generator=g))
    k = unit(torch.randn(batch, seq, heads, d_k, dtype=torch.float64, generator=g))
    v = torch.randn(batch, seq, heads, d_v, dtype=torch.float64, generator=g)
    decay = -torch.rand(batch, seq, heads, dtype=torch.float64, generator=g)
    beta = torch.rand(batch, seq, heads, dtype=torch.float64, generator=g)
    want = _delta_rule_recurrence(q, k, v, decay, beta)
    got = chunk_gated_delta_rule(q, k, v, decay, beta, chunk_size=chunk)
    assert got.dtype == torch.float64 and (got - want).abs().max() < FP64_TOL


# ---- against transformers' torch paths ---------------------------------------------------------
def _nemotron_h_mixer(spec: MambaSpec, hidden: int):
    transformers = pytest.importorskip("transformers")
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

    config = transformers.NemotronHConfig(
        hidden_size=hidden,
        mamba_num_heads=spec.n_heads,
        mamba_head_dim=spec.head_dim,
        ssm_state_size=spec.d_state,
        n_groups=spec.n_groups,
        conv_kernel=spec.conv_kernel,
        chunk_size=spec.chunk_size,
        use_conv_bias=spec.conv_bias,
        use_bias=spec.proj_bias,
        layer_norm_epsilon=1e-5,
        layers_block_type=["mamba"],
    )
    return NemotronHMamba2Mixer(config, layer_idx=0)


def test_mamba2_mixer_equals_transformers_nemotron_h():
    spec = MambaSpec(n_heads=8, head_dim=4, d_state=6, n_groups=2, chunk_size=8)
    hidden = 24
    theirs = _nemotron_h_mixer(spec, hidden)
    torch.manual_seed(0)
    ours = Mamba2Mixer(spec, hidden)
    with torch.no_grad():  # random values everywhere (transformers' init leaves D, dt_bias at 1)
        for p in ours.parameters():
            p.normal_(0, 0.3)
        ours.A_log.copy_(torch.log(torch.arange(1.0, 9.0)))
    assert sorted(ours.state_dict()) == sorted(theirs.state_dict())
    theirs.load_state_dict(ours.to_transformers(ours.state_dict()))
    back = ours.from_transformers(theirs.state_dict())
    assert all(torch.equal(back[k], v) for k, v in ours.state_dict().items())
    x = torch.randn(2, 29, hidden)
    for mode in (True, False):  # training (the fused-kernel branch falls back) and eval
        ours.train(mode), theirs.train(mode)
        got, want = ours(x), theirs(x)
        assert (got - want).abs().max() < FP32_TOL, (got - want).abs().max()
    grads = torch.autograd.grad(ours(x).square().sum(), list(ours.parameters()))
    assert all(torch.isfinite(g).all() for g in grads)


def _qwen3_next_mixer(spec: GatedDeltaNetSpec, hidden: int):
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    config = transformers.Qwen3NextConfig(
        hidden_size=hidden,
        linear_num_key_heads=spec.n_k_heads,
        linear_num_value_heads=spec.n_v_heads,
        linear_key_head_dim=spec.head_k_dim,
        linear_value_head_dim=spec.head_v_dim,
        linear_conv_kernel_dim=spec.conv_kernel,
        rms_norm_eps=1e-5,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
    )
    mixer = Qwen3NextGatedDeltaNet(config, layer_idx=0)
    return mixer


@pytest.mark.parametrize("chunk", [8, 64])
def test_gated_deltanet_equals_transformers_qwen3_next(chunk):
    import dataclasses

    spec = GatedDeltaNetSpec(n_k_heads=2, n_v_heads=4, head_k_dim=8, head_v_dim=6, chunk_size=64)
    hidden = 20
    theirs = _qwen3_next_mixer(spec, hidden)
    spec = dataclasses.replace(spec, chunk_size=chunk)
    torch.manual_seed(0)
    ours = GatedDeltaNet(spec, hidden)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if name != "A_log":
                p.normal_(0, 0.3)
    assert sorted(ours.state_dict()) == sorted(theirs.state_dict())
    theirs.load_state_dict(ours.to_transformers(ours.state_dict()))
    x = torch.randn(2, 29, hidden)
    got, want = ours(x), theirs(x)  # transformers runs chunks of 64, ours of `chunk`
    assert (got - want).abs().max() < FP32_TOL, (got - want).abs().max()
