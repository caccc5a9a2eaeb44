"""The cost model's mixture-of-experts terms (cost_models/terms/experts.py): the all-to-all,
where the MoE layers and the experts' parameters live, grouped GEMMs at the per-expert token
count, routing imbalance, DeepEP, and that model FLOPs count active parameters."""

from __future__ import annotations

import dataclasses

import pytest

from autosearch import Cluster, ModelSpec, SpecError, Strategy
from autosearch.core import RUNTIMES
from cost_models import AnalyticCostModel
from cost_models.formulas import all_to_all_time_s
from cost_models.terms import experts
from cost_models.terms._base import all_to_all_s

H100_4 = Cluster.parse("h100-sxm:4x8")
QWEN = ModelSpec.load("qwen3-30b-a3b", seq_len=4096)


def test_all_to_all_is_pairwise_exchange():
    # (n-1) alpha + (n-1)/n S / beta (Thakur et al. 2005): 8 ranks, 1 GB each, 1 us, 100 GB/s
    assert all_to_all_time_s(1e9, 8, 1e-6, 1e11) == pytest.approx(7e-6 + 7 / 8 * 1e-2)
    assert all_to_all_time_s(1e9, 1, 1e-6, 1e11) == 0.0


def test_all_to_all_across_nodes_shares_the_nics_as_the_dense_collectives():
    cm = AnalyticCostModel(QWEN, H100_4, runtime="megatron-core")
    ctx, S = cm._context, 1e8
    # within a node: NVLink
    lat, bw = cm.group_link(8, 1)
    assert all_to_all_s(ctx, S, 8, 1) == pytest.approx(7 * lat + 7 / 8 * S / bw)
    # 16 ranks over 2 nodes: half the bytes leave the node, 8 members sharing 8 NICs
    lat, bw = cm.group_link(16, 1)
    inter = 8 * lat + 8 / 16 * S * 8 / bw
    assert all_to_all_s(ctx, S, 16, 1) == pytest.approx(inter)
    assert bw == pytest.approx(8 * cm.profile.inter_node.achieved_bandwidth_bytes_per_s)


def test_deepep_crosses_the_network_once_per_node():
    # Qwen3-235B: 128 experts, top-8; ep 32 over 4 nodes: a token reaches 3 (1 - C(96,8)/C(128,8))
    # other nodes, not 8 x 24/32 = 6 copies as a plain all-to-all sends
    model = ModelSpec.load("qwen3-235b-a22b", seq_len=4096)
    deepep = dataclasses.replace(RUNTIMES["megatron-core"], moe_dispatcher="deepep")
    cm = AnalyticCostModel(model, H100_4, runtime=deepep)
    away = 1.0
    for i in range(8):
        away *= (96 - i) / (128 - i)
    lat, bw = cm.group_link(32, 1)
    expected = 3 * lat + 1e8 * 3 * (1 - away) * 8 / bw
    assert experts._deepep_s(cm._context, 1e8, 32, 1) == pytest.approx(expected)
    assert experts._deepep_s(cm._context, 1e8, 32, 1) < all_to_all_s(cm._context, 8e8, 32, 1)


def test_moe_layers_per_pipeline_rank_follow_the_model():
    maverick = ModelSpec.load("llama4-maverick")  # every second layer a MoE layer
    cm = AnalyticCostModel(maverick, H100_4, runtime="megatron-core")
    s = Strategy(dp=8, pp=4, global_batch_size=64)
    assert experts.rank_moe_layers(s, cm._context) == (6, 6, 6, 6)
    ds = ModelSpec.load("deepseek-v3")  # 3 leading dense layers
    cm = AnalyticCostModel(ds, H100_4, runtime="megatron-core")
    split = Strategy(dp=8, pp=4, global_batch_size=64, pipeline_split=(13, 16, 16, 16))
    # the last rank also runs the MTP module, a MoE layer (megatron-core trains it)
    assert experts.rank_moe_layers(split, cm._context) == (10, 16, 16, 17)


def test_routed_experts_are_split_over_ep_and_etp():
    cm = AnalyticCostModel(QWEN, H100_4, runtime="megatron-core")
    ranks = (QWEN.n_layers,)
    base = Strategy(dp=16, tp=2, global_batch_size=64, sequence_parallel=True)
    rest, routed = experts.stage_params(base, cm._context, ranks, (QWEN.n_layers,))
    _, routed8 = experts.stage_params(base.replace(ep=8), cm._context, ranks, ranks)
    _, routed_etp = experts.stage_params(base.replace(ep=8, etp=2), cm._context, ranks, ranks)
    assert routed8.total == pytest.approx(routed.total / 8)
    assert routed_etp.total == pytest.approx(routed.total / 16)
    # the whole model is the rest on every tp rank plus the routed experts
    per_tp = rest.total * 2 + routed.total
    assert per_tp == pytest.approx(QWEN.n_params, rel=1e-9)


def test_small_per_expert_token_counts_run_below_the_ceiling():
    cm = AnalyticCostModel(QWEN, H100_4, runtime="megatron-core")
    one = experts.layer(Strategy(dp=32, ep=8, global_batch_size=64), cm._context)
    eight = experts.layer(
        Strategy(dp=32, ep=8, micro_batch_size=8, global_batch_size=256), cm._context
    )
    # 8x the rows at the same width: less than 8x the time (better GEMM efficiency per row)
    assert eight.rows == 8 * one.rows
    assert eight.fwd_s < 8 * one.fwd_s


def test_load_imbalance_slows_the_experts_and_the_all_to_all():
    s = Strategy(dp=32, ep=32, global_batch_size=64)
    balanced = dataclasses.replace(RUNTIMES["megatron-core"], moe_load_imbalance=1.0)
    skewed = dataclasses.replace(RUNTIMES["megatron-core"], moe_load_imbalance=1.3)
    a, b = (
        experts.layer(s, AnalyticCostModel(QWEN, H100_4, runtime=rt)._context)
        for rt in (balanced, skewed)
    )
    assert b.comm_fwd_s == pytest.approx(1.3 * a.comm_fwd_s)
    assert b.fwd_s > a.fwd_s
    capped = dataclasses.replace(QWEN, moe=dataclasses.replace(QWEN.moe, capacity_factor=1.0))
    c = experts.layer(s, AnalyticCostModel(capped, H100_4, runtime=skewed)._context)
    assert c.comm_fwd_s == pytest.approx(a.comm_fwd_s)  # capacity 1: never above the share
    # without expert parallelism each rank computes its own tokens' rows on every expert:
    # no busier rank to wait for, whatever the routing
    alone = s.replace(ep=1)
    a, b = (
        experts.layer(alone, AnalyticCostModel(QWEN, H100_4, runtime=rt)._context)
        for rt in (balanced, skewed)
    )
    assert (a.fwd_s, a.bwd_s) == (b.fwd_s, b.bwd_s)


def test_model_flops_count_active_parameters_and_ep_is_priced():
    cm = AnalyticCostModel(QWEN, H100_4, runtime="megatron-core")
    s = Strategy(dp=32, ep=8, global_batch_size=256)
    r = cm.estimate(s)
    assert r.model_flops_per_step == pytest.approx(QWEN.flops_per_token() * 4096 * 256)
    assert QWEN.flops_per_token() < 6.2 * QWEN.n_active_params + 1e11  # active, not total
    assert cm.estimate(Strategy(dp=32, ep=1, global_batch_size=256)).step_time_s != (r.step_time_s)
    # every runtime with experts runs ep and etp; torchtitan with etp 1 or etp = tp only,
    # megatron-core and the Engine (torch) also below tp (the `etp_below_tp` feature)
    for name in ("megatron-core", "torchtitan", "torch"):
        assert {"ep", "etp"} <= set(RUNTIMES[name].supports)
    assert AnalyticCostModel(QWEN, H100_4).estimate(s).step_time_s > 0
    etp_tp = Strategy(dp=16, tp=2, ep=8, etp=2, global_batch_size=256)
    assert AnalyticCostModel(QWEN, H100_4).estimate(etp_tp).step_time_s > 0
    below = Strategy(dp=8, tp=4, ep=8, etp=2, global_batch_size=256)
    with pytest.raises(SpecError, match="cannot run etp=2 below tp=4"):
        AnalyticCostModel(QWEN, H100_4, runtime="torchtitan").estimate(below)
    assert AnalyticCostModel(QWEN, H100_4, runtime="megatron-core").estimate(below).step_time_s > 0


def test_expert_data_parallel_group():
    s = Strategy(dp=16, tp=2, ep=8, etp=1, global_batch_size=64)
    assert experts.expert_data_parallel(s) == (4, 8)


# ---- Megatron-Core per-module recompute (recompute_modules) ------------------------------------
def _estimate(model, strategy, runtime="megatron-core"):
    return AnalyticCostModel(model, H100_4, runtime=runtime).estimate(strategy)


def test_recompute_modules_trade_memory_for_recompute_time():
    """Each module set keeps less than the one before and repeats more: moe keeps only the
    MoE layer's input and runs its forward (all-to-all included) again; layernorm + moe_act
    drop the norms' outputs and the experts' activation (elementwise recompute only)."""
    base = Strategy(dp=32, ep=8, global_batch_size=256, zero_stage=1)
    reports = [
        _estimate(QWEN, base.replace(recompute_modules=m))
        for m in ("none", "layernorm+moe_act", "layernorm+moe")
    ]
    activations = [r.memory.activations_bytes for r in reports]
    recompute = [r.time.recompute_s for r in reports]
    assert activations[0] > activations[1] > activations[2]
    assert recompute[0] == 0.0 < recompute[1] < recompute[2]
    # moe_act drops the experts' activation output: rows = T k (top-8 of a 4,096-token
    # micro-batch) x the preset's dropless imbalance, width 768, bf16; layernorm two norm
    # outputs of T x h; on 48 layers, less the one layer being recomputed, which holds its
    # activation output once
    ctx = AnalyticCostModel(QWEN, H100_4, runtime="megatron-core")._context
    e = experts.layer(base, ctx)
    act = e.rows * ctx.runtime.moe_load_imbalance * 768 * 2
    norms = 2 * 4096 * QWEN.hidden_size * 2
    assert activations[0] - activations[1] == pytest.approx(48 * (act + norms) - act, rel=1e-9)
    # the moe set repeats the MoE forward: more than the elementwise work of moe_act, and the
    # all-to-all with it (tp_comm carries the MoE traffic)
    assert reports[2].time.tp_comm_s > reports[0].time.tp_comm_s


def test_recompute_modules_follow_megatron_and_the_model():
    """Under full recompute a module list changes nothing (Megatron takes modules with
    selective granularity only); a dense model, or modules the model lacks, are refused."""
    full = Strategy(dp=32, ep=8, global_batch_size=256, recompute="full")
    a = _estimate(QWEN, full)
    b = _estimate(QWEN, full.replace(recompute_modules="layernorm+moe"))
    assert (a.step_time_s, a.peak_memory_bytes) == (b.step_time_s, b.peak_memory_bytes)
    with pytest.raises(SpecError, match="modelled for mixture-of-experts models only"):
        Strategy(dp=8, recompute_modules="layernorm+moe_act").validate(ModelSpec.load("llama3-8b"))
    with pytest.raises(SpecError, match="mla_up_proj .it has no multi-head latent attention"):
        Strategy(dp=8, recompute_modules="mla_up_proj").validate(QWEN)
    with pytest.raises(SpecError, match="recompute_modules must be one of none, layernorm"):
        Strategy(dp=8, recompute_modules="layernorm+attention")


def test_recompute_modules_need_a_runtime_that_runs_them():
    s = Strategy(dp=32, ep=8, global_batch_size=256, recompute_modules="layernorm+moe_act")
    assert "recompute_modules" in RUNTIMES["torchtitan"].unsupported(s)
    assert not RUNTIMES["megatron-core"].unsupported(s) and not RUNTIMES["nemo"].unsupported(s)


def test_mla_up_proj_and_dense_mlp_recompute_on_deepseek():
    """DeepSeek-V3's Megatron-Bridge H100 recipe recomputes the MLA up-projections and the
    dense layers' MLP: both lower the activations and add recompute time."""
    dsv3 = ModelSpec.load("deepseek-v3").scaled(n_layers=8)  # 3 dense + 5 MoE layers
    base = Strategy(dp=16, tp=2, ep=8, global_batch_size=64, sequence_parallel=True, zero_stage=1)
    none = _estimate(dsv3, base)
    up = _estimate(dsv3, base.replace(recompute_modules="mla_up_proj"))
    both = _estimate(dsv3, base.replace(recompute_modules="mla_up_proj+mlp"))
    assert none.memory.activations_bytes > up.memory.activations_bytes
    assert up.memory.activations_bytes > both.memory.activations_bytes
    assert 0.0 == none.time.recompute_s < up.time.recompute_s < both.time.recompute_s


def test_megatron_core_keeps_no_expert_output():
    """Megatron-Core applies the routing probabilities in the experts' activation
    (`moe_probs_in_activation`), so its combine keeps no copy of the experts' output: T k rows
    x hidden x 2 bytes less per MoE layer and micro-batch than a runtime that weights the
    output at the combine (megatron-core 0.16 experts.py `activation_func_with_probs`)."""
    s = Strategy(dp=32, ep=8, global_batch_size=256, zero_stage=1)
    mc = RUNTIMES["megatron-core"]
    other = dataclasses.replace(mc, name="mc-probs-at-combine", moe_probs_in_activation=False)
    a = _estimate(QWEN, s, runtime=mc).memory.activations_bytes
    b = _estimate(QWEN, s, runtime=other).memory.activations_bytes
    # one micro-batch's routed rows on one rank, times the preset's dropless imbalance
    rows = 4096 * 8 * mc.moe_load_imbalance
    assert b - a == pytest.approx(48 * rows * QWEN.hidden_size * 2, rel=1e-9)
