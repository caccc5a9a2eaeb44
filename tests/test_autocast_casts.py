"""Autocast over fp32 parameters (the Engine: `autocast_fp32_params`): the casts of weights,
gradients and activations every micro-batch, and the casts autocast saves for backward, priced
only where the residual stream is fp32 (docs/runtimes.md [1.8]; measured in results/gpu/)."""

from __future__ import annotations

import pytest

from autosearch import Cluster, ModelSpec, Strategy
from cost_models import AnalyticCostModel
from cost_models.terms import compute, memory

MODEL = ModelSpec.load("llama3-8b").scaled(n_layers=4)  # gated MLP, hidden 4096
CLUSTER = Cluster.parse("h100-sxm:1x1")  # the terms are called with dp 8 too: not validated


def _model(runtime: str = "torch") -> AnalyticCostModel:
    return AnalyticCostModel(MODEL, CLUSTER, runtime=runtime)


def _casts(s: Strategy, runtime: str = "torch") -> float:
    cm = _model(runtime)
    psi = cm._params(s).total
    return compute.autocast_casts_s(s, cm._context, psi, None, (max(cm._ranks(s)), 0.0))


def test_the_casts_are_the_bytes_autocast_moves_at_the_achieved_bandwidth():
    s = Strategy(micro_batch_size=2, global_batch_size=8, amp="bf16")  # 4 micro-batches
    cm = _model()
    psi, bw = cm._params(s).total, cm.profile.achieved_memory_bandwidth_bytes_per_s
    weights = 4 * (6 + 6) * psi + 3 * 12 * psi  # casts and gradient casts; 3 accumulations
    th = 2 * MODEL.seq_len * MODEL.hidden_size  # tokens x hidden of one micro-batch
    per_layer = 5 * 6 + 5 * 6 + 3 * 12  # q, k, v, w1, w3: casts, casts back, fp32 sums
    activations = 4 * th * (MODEL.n_layers * per_layer + 12)  # + the output layer's
    assert _casts(s) == pytest.approx((weights + activations) / bw, rel=1e-12)
    # compiled: Inductor writes each activation once in the amp dtype, the weights still cast
    assert _casts(s.replace(compile=True)) == pytest.approx(weights / bw, rel=1e-12)
    # float8 linears cast their own fp32 weights: only the gradient casts remain of those
    fp8 = s.replace(compile=True, fp8="tensorwise")
    assert _casts(fp8) == pytest.approx((4 * 6 * psi + 3 * 12 * psi) / bw, rel=1e-12)


@pytest.mark.parametrize(
    "strategy, runtime",
    [
        (Strategy(dp=8, global_batch_size=16, amp="fp32"), "torch"),  # no autocast
        (Strategy(dp=8, global_batch_size=16, zero_stage=2, amp="bf16"), "torch"),  # FSDP2 bf16
        (Strategy(dp=8, global_batch_size=16, zero_stage=3, amp="bf16"), "torch"),
        (Strategy(dp=8, global_batch_size=16, amp="bf16"), "megatron-core"),  # bf16 params
        (Strategy(dp=8, global_batch_size=16, zero_stage=3, amp="bf16"), "torchtitan"),
    ],
)
def test_no_casts_where_the_stream_is_not_fp32(strategy, runtime):
    assert _casts(strategy, runtime) == 0.0


def test_zero_1_and_zero_3_at_dp_1_keep_the_fp32_stream():
    """At dp = 1 no FSDP2 wrapper applies (autosearch/engine/parallelize.py), and ZeRO-1 keeps
    fp32 parameters: the casts are priced (the H200 run's ZeRO-3 at dp 1 equalled no ZeRO)."""
    base = Strategy(micro_batch_size=2, global_batch_size=8, amp="bf16")
    assert _casts(base.replace(zero_stage=3)) == _casts(base) > 0
    assert _casts(Strategy(dp=8, global_batch_size=16, zero_stage=1, amp="bf16")) > 0


def test_the_step_time_includes_the_casts_as_compute():
    s = Strategy(micro_batch_size=2, global_batch_size=8, amp="bf16")
    eager, compiled = _model().estimate(s), _model().estimate(s.replace(compile=True))
    assert eager.time.compute_s > compiled.time.compute_s  # compile fuses the activation casts
    assert _casts(s) < eager.step_time_s


def test_the_memory_term_counts_the_casts_autocast_saves():
    """18 bytes per token per hidden unit per layer (16 without a gate) where the stream is fp32,
    eager, and the layer is not fully recomputed (results/gpu/h200/README.md)."""
    s = Strategy(micro_batch_size=2, global_batch_size=8, amp="bf16")
    ctx = _model()._context
    tokens_h = 2 * MODEL.seq_len * MODEL.hidden_size

    def kept(strategy: Strategy) -> float:
        return memory.layer_activations(strategy, ctx).kept_bytes

    assert kept(s) - kept(s.replace(compile=True)) >= 18 * tokens_h  # compile saves no casts
    fsdp = Strategy(dp=8, micro_batch_size=2, global_batch_size=16, zero_stage=3, amp="bf16")
    no_fsdp = fsdp.replace(zero_stage=1)
    assert kept(no_fsdp) - kept(fsdp) == pytest.approx(18 * tokens_h, rel=1e-12)
    full = s.replace(recompute="full")
    assert kept(full) == memory.layer_activations(full.replace(zero_stage=3), ctx).kept_bytes
    gelu = ModelSpec.load("gpt3-1.3b")
    gctx = AnalyticCostModel(gelu, CLUSTER, runtime="torch")._context
    g = Strategy(dp=8, global_batch_size=16, amp="bf16")
    extra = memory.layer_activations(g.replace(zero_stage=1), gctx).kept_bytes
    extra -= memory.layer_activations(g.replace(zero_stage=3), gctx).kept_bytes
    assert extra == pytest.approx(16 * gelu.seq_len * gelu.hidden_size, rel=1e-12)
