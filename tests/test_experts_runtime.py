"""What issue 19's fidelity work added to the MoE cost model: the experts' float8 scaling
(cost_models/terms/experts.py `_fp8_scaling_s`) and the `automodel` runtime preset's bf16
model states (`param_bytes`, cost_models/terms/data_parallel.py)."""

from __future__ import annotations

import pytest

from autosearch import Cluster, ModelSpec, Strategy
from autosearch.core import RUNTIMES
from cost_models import AnalyticCostModel
from cost_models.terms import experts
from cost_models.terms.compute import layer_shape, stream_s

H100_2 = Cluster.parse("h100-sxm:2x8")
QWEN = ModelSpec.load("qwen3-30b-a3b", seq_len=4096)  # h 2048, dense ffn 6144, 128 x 768, top-8


def test_experts_fp8_scaling_casts_the_routed_rows_instead_of_the_dense_mlp():
    """Forward: amax and cast (2 + 2 + 1 B per element, as compute._fp8_scaling) of every
    expert GEMM's input, the routed rows at h and f_e, in place of the dense MLP's T tokens at
    h and ffn (which compute._fp8_scaling counts); megatron-core gathers fp8 weights, so no
    weight cast."""
    cm = AnalyticCostModel(QWEN, H100_2, runtime="megatron-core")
    s = Strategy(dp=16, ep=8, global_batch_size=64, fp8="tensorwise")
    ctx = cm._context
    T, h, k = 4096, 2048, 8
    rows = T * k  # tp 1: every token of the micro-batch is routed to 8 experts
    inputs = rows * (h + 768) - T * (h + 6144)
    fwd, bwd = experts._fp8_scaling_s(s, ctx, rows, 768, 0.0)
    traffic = layer_shape(s, ctx).traffic
    assert fwd == pytest.approx(stream_s(ctx, inputs * 5 * traffic))
    grads = rows * (2 * 768 + h) - T * (2 * 6144 + h)
    # backward: each output gradient read (2 B) and cast in two layouts (2 x (2 + 1) B), each
    # input's cast read again for wgrad (2 + 1 B), as compute._fp8_scaling
    assert bwd == pytest.approx(stream_s(ctx, (grads * 8 + inputs * 3) * traffic))


def test_experts_fp8_scaling_is_zero_without_fp8_and_grows_with_the_routed_rows():
    cm = AnalyticCostModel(QWEN, H100_2, runtime="megatron-core")
    s = Strategy(dp=16, ep=8, global_batch_size=64, fp8="tensorwise")
    assert experts._fp8_scaling_s(s.replace(fp8="none"), cm._context, 32768, 768, 0) == (0, 0)
    few = experts._fp8_scaling_s(s, cm._context, 32768, 768, 0.0)
    more = experts._fp8_scaling_s(s, cm._context, 2 * 32768, 768, 0.0)
    assert more[0] > few[0] and more[1] > few[1]
    # and the MoE layer's forward carries it
    e = experts.layer(s, cm._context)
    e_bf16 = experts.layer(s.replace(fp8="none"), cm._context)
    assert e.fwd_s != e_bf16.fwd_s


@pytest.mark.parametrize("pp", [1, 2])
def test_automodel_keeps_bf16_parameters_gradients_and_adam_moments(pp):
    """The automodel preset: the model built in bf16 and trained by torch.optim.Adam keeps
    parameters, gradients and both moments in bf16 (2 + 2 + 4 bytes), half of torchtitan's
    fp32 (4 + 4 + 8). Under pipelining FSDP2 accumulates the micro-batches' gradients
    unsharded and upcasts them to its fp32 reduce_dtype, so there the gradients match."""
    model = ModelSpec.load("llama3-8b", seq_len=4096)
    d = 16 // pp
    s = Strategy(dp=d, pp=pp, zero_stage=3, global_batch_size=64)
    tt = AnalyticCostModel(model, H100_2, runtime="torchtitan").estimate(s).memory
    am = AnalyticCostModel(model, H100_2, runtime="automodel").estimate(s).memory
    assert am.optimizer_bytes == pytest.approx(tt.optimizer_bytes / 2)
    assert am.grads_bytes == pytest.approx(tt.grads_bytes / (2 if pp == 1 else 1))
    if pp == 1:  # the sharded parameters; the gathered copies are bf16 under both
        assert tt.params_bytes - am.params_bytes == pytest.approx(2 * model.n_params / d)


def test_only_the_automodel_preset_changes_the_parameter_bytes():
    """The presets the cost model's fingerprint covers keep fp32 states (param_bytes 4)."""
    assert RUNTIMES["automodel"].param_bytes == 2
    assert RUNTIMES["automodel"].framework == "torchtitan"
    assert all(r.param_bytes == 4 for n, r in RUNTIMES.items() if n != "automodel")


@pytest.mark.parametrize("ep", [4, 8, 16])
def test_a_moe_layers_host_time_is_its_own_and_one_share_per_local_expert(ep):
    """megatron-core's host time of a MoE layer without CUDA graphs: `moe_layer_host_s` plus
    `moe_expert_host_s` for each of the E / ep experts the rank holds (TE's grouped linear
    launches per expert); a full-iteration CUDA graph removes both."""
    rt = RUNTIMES["megatron-core"]
    s = Strategy(dp=16, ep=ep, global_batch_size=64, fp8="tensorwise")
    e = experts.layer(s, AnalyticCostModel(QWEN, H100_2, runtime=rt)._context)
    assert e.host_s == pytest.approx(rt.moe_layer_host_s + rt.moe_expert_host_s * 128 / ep)
    graphed = rt.as_run(full_iteration_cuda_graph=True)
    assert experts.layer(s, AnalyticCostModel(QWEN, H100_2, runtime=graphed)._context).host_s == 0


@pytest.mark.parametrize("mb", [1, 8])
def test_a_moe_layers_host_time_adds_to_its_gpu_work_at_any_micro_batch(mb):
    """The host time after the dispatcher's tokens-per-expert sync is exposed in full
    (experts.rank_s): one host time per MoE layer and micro-batch, whether the layer's GPU
    work is shorter (1 sequence) or longer (8) than it."""
    s = Strategy(dp=16, ep=8, micro_batch_size=mb, global_batch_size=128, fp8="tensorwise")
    rt = RUNTIMES["megatron-core"]
    without = rt.as_run(full_iteration_cuda_graph=True)
    shipped_cm = AnalyticCostModel(QWEN, H100_2, runtime=rt)
    host = experts.layer(s, shipped_cm._context).host_s
    extra = (
        shipped_cm.estimate(s).time.compute_s
        - AnalyticCostModel(QWEN, H100_2, runtime=without).estimate(s).time.compute_s
    )
    assert extra == pytest.approx(QWEN.n_layers * s.grad_accum_steps * host)


def test_a_releases_expert_kernel_factor_slows_only_the_routed_experts_and_only_there():
    """NeMo 2's `expert_kernel_efficiency` (Blackwell 0.64, runtimes.yaml): the MoE layer's
    forward and backward grow by the routed experts' GEMM time x (1/0.64 - 1), nothing else
    of the layer moves, and on Hopper (not listed) nothing changes."""
    import dataclasses

    rt = RUNTIMES["nemo-25.04"]
    (factor,) = [v for a, v in rt.expert_kernel_efficiency if a == "blackwell"]
    plain = dataclasses.replace(rt, expert_kernel_efficiency=())
    s = Strategy(dp=8, ep=8, global_batch_size=64)
    gb200 = Cluster.parse("gb200-nvl72:2x4")
    slow = experts.layer(s, AnalyticCostModel(QWEN, gb200, runtime=rt)._context)
    fast = experts.layer(s, AnalyticCostModel(QWEN, gb200, runtime=plain)._context)
    assert slow.fwd_s > fast.fwd_s and slow.comm_fwd_s == fast.comm_fwd_s
    # the forward's added time is the experts' GEMMs x (1/f - 1) (what op recompute repeats of
    # them moves by the same), the backward's twice it
    added = slow.fwd_s - fast.fwd_s
    assert slow.bwd_s - fast.bwd_s == pytest.approx(2 * added, rel=1e-9)
    assert slow.op_recompute_s - fast.op_recompute_s == pytest.approx(added, rel=1e-9)
    h100 = Cluster.parse("h100-sxm:1x8")
    same = [
        experts.layer(s, AnalyticCostModel(QWEN, h100, runtime=r)._context) for r in (rt, plain)
    ]
    assert same[0] == same[1]
    assert 0 < factor < 1
