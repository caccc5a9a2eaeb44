"""The cost model prices the dense fields of today's models (docs/models.md): head_dim,
squared ReLU, sliding windows, soft-capping and multi-head latent attention.

The golden numbers are the models' own counts: with a GEMM that runs every shape at its
ceiling (half_dim 0, no tiles, no launch), one layer's GEMM seconds are exactly 2 x tokens x the
layer's matmul parameters (`ModelSpec.layer_matmul_params`, checked against the published
counts and transformers in tests/test_models_moe.py) / the ceiling, so the cost model and the
parameter count agree to float rounding (rel 1e-12).
"""

from __future__ import annotations

import dataclasses

import pytest

from autosearch import Cluster, ModelSpec, Strategy
from autosearch.core.model_spec import unbuilt, unpriced
from cost_models import AnalyticCostModel
from cost_models.terms import Context, compute, memory
from cost_models.terms.compute import window_fraction

CLUSTER = Cluster.parse("h100-sxm:1x8")
STRATEGY = Strategy(dp=8, micro_batch_size=1, global_batch_size=8)


def _ideal_gemm_model(model: ModelSpec, runtime: str = "torchtitan") -> AnalyticCostModel:
    """A cost model whose GEMMs run every shape at the ceiling, so GEMM time = FLOPs / rate."""
    cm = AnalyticCostModel(model, CLUSTER, runtime=runtime)
    gemm = dataclasses.replace(cm.profile.gemm, half_dim=0.0, launch_s=0.0, tiles=(), sm_count=0)
    cm.profile = dataclasses.replace(cm.profile, gemm=gemm)
    cm._context = Context(model, cm.profile, cm.runtime, cm._link_for)
    return cm


def _gemm_s(model: ModelSpec) -> float:
    cm = _ideal_gemm_model(model)
    x = compute._Layer(
        T=float(model.seq_len),
        mb=1,
        t=1,
        cp=1,
        sp=False,
        ab=2,
        precision="bf16",
        peak=cm.profile.peak_flops["bf16"],
        fp8="none",
        compiled=False,
        n_up=2 if model.ffn_gated else 1,
        traffic=1.0,
    )
    return compute._block_gemms(cm._context, x)[0]


def _rate() -> float:
    prof = AnalyticCostModel(ModelSpec.load("llama3-8b"), CLUSTER, runtime="torchtitan").profile
    return prof.peak_flops["bf16"] * prof.gemm.max_efficiency["bf16"]


@pytest.mark.parametrize(
    "name,changes",
    [
        ("qwen3-8b", {}),  # head_dim 128 x 32 heads = 4096 = hidden: the plain case
        ("gemma2-9b", {}),  # head_dim 256 x 16 heads = 4096 != hidden 3584, GeGLU
        ("mistral-nemo-12b", {}),  # head_dim 128 x 32 = 4096 != hidden 5120
        ("llama3-8b", {"ffn_activation": "relu2", "ffn_hidden_size": 16384}),  # Nemotron style
        ("deepseek-v3", {"moe": None, "n_layers": 4}),  # MLA's five projections
        ("deepseek-v2", {"moe": None, "n_layers": 4}),  # MLA, 236B shape
    ],
)
def test_block_gemms_count_the_layers_matmul_parameters(name, changes):
    model = dataclasses.replace(ModelSpec.load(name), **changes)
    assert unpriced(model) == []
    expected = 2.0 * model.seq_len * model.layer_matmul_params / _rate()
    assert _gemm_s(model) == pytest.approx(expected, rel=1e-12)


def test_relu2_is_priced_as_two_matrices_and_four_activation_passes():
    gelu = ModelSpec.load("llama3-8b").scaled(ffn_activation="gelu", linear_bias=False)
    relu2 = dataclasses.replace(gelu, ffn_activation="relu2")
    swiglu = dataclasses.replace(gelu, ffn_activation="swiglu")
    assert _gemm_s(relu2) == _gemm_s(gelu) < _gemm_s(swiglu)
    assert compute.MLP_ACTIVATION_PASSES == {"gelu": 2, "swiglu": 3, "geglu": 3, "relu2": 4}
    r = {
        m.ffn_activation: AnalyticCostModel(m, CLUSTER, runtime="torchtitan").estimate(STRATEGY)
        for m in (gelu, relu2, swiglu)
    }
    # relu2 keeps what gelu keeps (input and output of the activation), not SwiGLU's four
    assert r["relu2"].memory.activations_bytes == r["gelu"].memory.activations_bytes
    assert r["relu2"].memory.activations_bytes < r["swiglu"].memory.activations_bytes
    assert r["gelu"].step_time_s < r["relu2"].step_time_s < r["swiglu"].step_time_s


def test_sliding_windows_scale_the_attention_core_by_their_pairs():
    # Mistral 7B v0.1: every layer slides with w = 4096; at s = 8192 a sequence has
    # w s - w (w - 1) / 2 causal pairs of the s (s + 1) / 2 of full attention
    full = ModelSpec.load("mistral-7b-v0.1").scaled(seq_len=8192, sliding_window=None)
    window = full.scaled(sliding_window=4096)
    w, s = 4096, 8192
    assert window_fraction(window) == pytest.approx((w * s - w * (w - 1) / 2) / (s * (s + 1) / 2))
    assert window_fraction(full) == 1.0
    # Gemma 2: every second layer global; the fraction is the mean over layers
    gemma = ModelSpec.load("gemma2-9b").scaled(seq_len=8192)
    one = (w * s - w * (w - 1) / 2) / (s * (s + 1) / 2)
    assert window_fraction(gemma) == pytest.approx((1 + one) / 2)
    a, b = (AnalyticCostModel(m, CLUSTER, runtime="torchtitan") for m in (full, window))
    launch = a.profile.kernel_launch_s
    fa = compute.layer(STRATEGY, a._context).attention_fwd_s - launch
    fb = compute.layer(STRATEGY, b._context).attention_fwd_s - launch
    assert fb == pytest.approx(fa * window_fraction(window), rel=1e-12)


def test_soft_capping_adds_its_elementwise_work():
    plain = ModelSpec.load("gemma2-9b").scaled(
        seq_len=4096, attn_logit_softcapping=None, final_logit_softcapping=None
    )
    capped = plain.scaled(attn_logit_softcapping=50.0)
    a, b = (AnalyticCostModel(m, CLUSTER, runtime="torchtitan") for m in (plain, capped))
    launch = a.profile.kernel_launch_s
    fa = compute.layer(STRATEGY, a._context).attention_fwd_s - launch
    fb = compute.layer(STRATEGY, b._context).attention_fwd_s - launch
    # 3 FLOPs per score against 4 d_h per score of QK^T and PV: 3 / (4 x 256)
    assert fb / fa == pytest.approx(1 + 3 / (4 * plain.head_dim), rel=1e-12)
    final = plain.scaled(final_logit_softcapping=30.0)
    c = AnalyticCostModel(final, CLUSTER, runtime="torchtitan")
    assert (
        compute.layer(STRATEGY, c._context).logits_s > compute.layer(STRATEGY, a._context).logits_s
    )
    # without flash attention, capping reads and writes the scores once more
    sc21 = AnalyticCostModel(capped, CLUSTER, runtime="megatron-sc21")
    sc21_plain = AnalyticCostModel(plain, CLUSTER, runtime="megatron-sc21")
    s = Strategy(dp=8, micro_batch_size=1, global_batch_size=8, amp="fp16")
    assert (
        compute.layer(s, sc21._context).attention_recompute_s
        > compute.layer(s, sc21_plain._context).attention_recompute_s
    )


def test_mla_attention_core_uses_d_qk_for_scores_and_d_v_for_values():
    ds = ModelSpec.load("deepseek-v3").scaled(moe=None, n_layers=4, seq_len=4096)
    mla = ds.mla
    cm = AnalyticCostModel(ds, CLUSTER, runtime="megatron-core")
    c = compute.layer(STRATEGY, cm._context)
    s = ds.seq_len
    pairs = s * (s + 1) / 2  # causal query-key pairs
    flops = 2.0 * pairs * ds.n_heads * (mla.qk_head_dim + mla.v_head_dim)
    # cuDNN's fused kernel by shape: s / 2 keys per query, 192-wide scores (MLA's d_qk)
    eff = cm.profile.attention_shapes["cudnn"].fwd.efficiency(pairs / s, True, mla.qk_head_dim)
    rate = cm.profile.peak_flops["bf16"] * eff
    assert c.attention_fwd_s - cm.profile.kernel_launch_s == pytest.approx(flops / rate)
    # activations kept per token (bf16, tp 1, no dropout, fused attention): the two norm
    # inputs and two linear inputs (4 h), Q and the per-head K and V rebuilt from the latent
    # (a d_qk + a d_qk + a d_v), the output projection's input (a d_v), TE's fused
    # SwiGLU (3 f: megatron-core's fused_swiglu), the log-sum-exp (4 bytes a head), and the
    # latents with the rotary key, normed and not (2 (r_q + r_kv + d_rope)); Korthikanti et
    # al. 2022 per stored tensor
    a, h, f = ds.n_heads, ds.hidden_size, ds.ffn_hidden_size
    widths = 4 * h + a * (2 * mla.qk_head_dim + mla.v_head_dim) + a * mla.v_head_dim + 3 * f
    latent = 2 * (mla.q_lora_rank + mla.kv_lora_rank + mla.qk_rope_head_dim)
    expected = s * (2 * (widths + latent) + 4 * a)
    assert memory.layer_activations(STRATEGY, cm._context).none_bytes == pytest.approx(expected)


def test_every_dense_catalog_model_is_priced_and_only_moe_is_refused():
    from autosearch.core.model_spec import model_catalog

    for name, model in model_catalog().items():
        if model.moe is None:
            assert unpriced(model) == [], name
            # hybrids under the runtime that trains their Mamba-2 layers (runtimes.yaml)
            hybrid = any(layer.mixer != "attention" for layer in model.layers)
            AnalyticCostModel(model, CLUSTER, runtime="megatron-core" if hybrid else None)
    # priced and built (the reference transformer: GeGLU, head_dim, windows, soft-capping)
    assert unbuilt(ModelSpec.load("gemma2-9b")) == []
    assert unbuilt(ModelSpec.load("deepseek-v3"))  # MLA, MTP, aux-loss-free: priced, not built
