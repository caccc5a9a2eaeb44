"""Fused attention priced from its shape (issue 34, part 1): keys per query, causality, head
size (`autosearch.core.attention_kernels`), anchored to cudnn-frontend's measured SDPA training
table (cost_models/data/cudnn_sdpa_training.csv); and the unfused core a release falls back to
where its fused kernels do not take the model's heads."""

from __future__ import annotations

import importlib.util
import pathlib

import numpy as np
import pandas as pd
import pytest
import yaml

from autosearch import Cluster, ModelSpec, Strategy
from autosearch.core.attention_kernels import PassShape, head_factor
from autosearch.core.errors import SpecError
from autosearch.core.hardware import HardwareProfile
from autosearch.core.runtime import RuntimeOptions
from cost_models import AnalyticCostModel
from cost_models.terms import compute, memory

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHAPED = {  # profile -> the GPU of the table its constants were fitted on
    "h100-sxm": "h200",
    "h100-sxm-96gb-500w": "h200",
    "h200-sxm": "h200",
    "h800-sxm": "h200",
    "b200-sxm": "gb200",
    "gb200-nvl72": "gb200",
    "b300-sxm": "gb300",
    "gb300-nvl72": "gb300",
}
FITTED_ON = {"h200": "h200-sxm", "gb200": "gb200-nvl72", "gb300": "gb300-nvl72"}


def _table() -> pd.DataFrame:
    """The measured passes as benchmarks/attention_shapes.py reads them (keys, FLOPs)."""
    spec = importlib.util.spec_from_file_location(
        "attention_shapes", ROOT / "benchmarks" / "attention_shapes.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench.read_table()


@pytest.mark.parametrize("name", sorted(SHAPED))
def test_every_hopper_and_blackwell_profile_prices_cudnn_attention_by_shape(name):
    p = HardwareProfile.load(name)
    assert "cudnn" in p.attention_shapes
    assert any(s.startswith("[sdpa]") for s in p.sources)


@pytest.mark.parametrize("gpu", sorted(FITTED_ON))
def test_the_shipped_constants_read_the_measured_table(gpu):
    """The time of every measured pass within 6% on average (the fit's 1.8-4.8%, rounded
    constants), where one flat efficiency (the profiles' 0.50 / 0.55 before) was 20-41% off."""
    prof = HardwareProfile.load(FITTED_ON[gpu])
    shapes, peak = prof.attention_shapes["cudnn"], prof.peak_flops["bf16"]
    rows = _table()
    rows = rows[rows.gpu == gpu]
    for pas, part in rows.groupby("pass"):
        shape = getattr(shapes, pas)
        eff = [
            shape.efficiency(k, bool(c), int(d))
            for k, c, d in zip(part["keys"], part.causal, part.d_qk)
        ]
        predicted = part.flops / (peak * np.array(eff))
        err = np.abs(predicted / (part.time_ms * 1e-3) - 1.0)
        flat = np.abs(
            part.flops / (peak * prof.attention_kernels["cudnn"]) / (part.time_ms * 1e-3) - 1
        )
        assert err.mean() < 0.06, (gpu, pas, err.mean())
        assert err.mean() < flat.mean() / 3


def test_efficiency_rises_with_the_keys_and_a_causal_mask_costs_more():
    shape = HardwareProfile.load("h100-sxm").attention_shapes["cudnn"].fwd
    effs = [shape.efficiency(k, True, 128) for k in (512, 1024, 2048, 4096, 8192)]
    assert effs == sorted(effs) and effs[-1] < shape.peak
    assert shape.efficiency(2048, True, 128) < shape.efficiency(2048, False, 128)
    # measured on the H200: 4,096 tokens causal forward at 0.598 of peak, 8,192 at 0.651
    assert shape.efficiency(2048, True, 128) == pytest.approx(0.598, abs=0.02)
    assert shape.efficiency(4096, True, 128) == pytest.approx(0.651, abs=0.02)


def test_head_sizes_between_the_listed_ones_interpolate():
    points = ((64, 0.5), (192, 1.1))
    assert head_factor(points, 128) == 1.0
    assert head_factor(points, 160) == pytest.approx(1.05)
    assert head_factor(points, 96) == pytest.approx(0.75)
    assert head_factor(points, 32) == 0.5 and head_factor(points, 256) == 1.1
    assert PassShape(0.6, 100.0, 100.0).efficiency(100.0, False, 96) == pytest.approx(0.3)


CLUSTER = Cluster.parse("h100-sxm:1x8")


def _attention(model: ModelSpec, runtime: str, cluster: Cluster = CLUSTER, **strategy):
    cm = AnalyticCostModel(model, cluster, runtime=runtime)
    s = Strategy(**{"dp": 8, "micro_batch_size": 1, "global_batch_size": 8, **strategy})
    return cm, compute.layer(s, cm._context)


def test_short_sequences_cost_more_per_flop_than_long_ones():
    """The same model at 2k and 8k tokens: the attention FLOPs grow 16x, its time less (the
    kernel reaches 0.50 of peak at 2k causal forward, 0.65 at 8k); one flat efficiency made
    it exactly 16x."""
    llama = ModelSpec.load("llama3-8b")
    _, short = _attention(llama.scaled(seq_len=2048), "megatron-core")
    _, long = _attention(llama.scaled(seq_len=8192), "megatron-core")
    ratio = (long.attention_fwd_s + long.attention_bwd_s) / (
        short.attention_fwd_s + short.attention_bwd_s
    )
    assert 11.0 < ratio < 14.5


def test_context_parallel_keeps_the_flat_efficiency():
    llama = ModelSpec.load("llama3-8b").scaled(seq_len=16384)
    cm, c = _attention(llama, "megatron-core", dp=4, cp=2)
    s = llama.seq_len
    flops = 4.0 * s * s * llama.attention_hidden_size * 0.5 / 2
    rate = cm.profile.peak_flops["bf16"] * cm.profile.attention_kernels["cudnn"]
    assert c.attention_fwd_s - cm.profile.kernel_launch_s == pytest.approx(flops / rate)


def test_a_runtime_without_a_shape_table_keeps_its_flat_kernel():
    llama = ModelSpec.load("llama3-8b")
    cm, c = _attention(llama, "torchtitan")  # SDPA's FlashAttention-2: no measured table
    assert "fa2" not in cm.profile.attention_shapes
    s = llama.seq_len
    flops = 4.0 * s * s * llama.attention_hidden_size * 0.5
    rate = cm.profile.peak_flops["bf16"] * compute.attention_efficiency(cm._context, "bf16")
    assert c.attention_fwd_s - cm.profile.kernel_launch_s == pytest.approx(flops / rate)


# ---- the unfused fallback: TransformerEngine before 2.5 on Blackwell ---------------------------
GB200 = Cluster.parse("gb200-nvl72:2x4")
DSV3 = ModelSpec.load("deepseek-v3").scaled(moe=None, n_layers=4, seq_len=4096)


@pytest.mark.parametrize(
    ("runtime", "cluster", "model", "fused"),
    [
        ("nemo-25.04", GB200, DSV3, False),  # MLA's 192-wide scores: no fused kernel there
        ("nemo-25.04", CLUSTER, DSV3, True),  # Hopper takes heads up to 256
        ("nemo-25.04", GB200, ModelSpec.load("llama3-8b"), True),  # 128-wide heads
        ("megatron-bridge-25.09", GB200, DSV3, True),  # TransformerEngine 2.5+
        ("megatron-sc21", CLUSTER, ModelSpec.load("llama3-8b"), False),  # never fused
    ],
)
def test_which_runs_fuse_their_attention(runtime, cluster, model, fused):
    cm = AnalyticCostModel(model, cluster, runtime=runtime)
    assert cm.runtime.fused_attention(model, cm.profile) is fused


def test_the_unfused_core_costs_its_scores_in_time_and_memory():
    s = Strategy(dp=8, micro_batch_size=1, global_batch_size=8)
    old, new = (
        AnalyticCostModel(DSV3, GB200, runtime=r) for r in ("nemo-25.04", "megatron-bridge-25.09")
    )
    slow, fast = compute.layer(s, old._context), compute.layer(s, new._context)
    assert slow.attention_fwd_s > 1.5 * fast.attention_fwd_s
    # without recompute it keeps the 128 heads' s x s softmax output (bf16) for backward
    kept = memory.layer_activations(s, old._context).none_bytes
    fused = memory.layer_activations(s, new._context).none_bytes
    scores = DSV3.n_heads * DSV3.seq_len * DSV3.seq_len * 2
    assert kept - fused == pytest.approx(scores - 4.0 * DSV3.n_heads * DSV3.seq_len, rel=1e-9)


def _profile_with(**attention) -> dict:
    data = yaml.safe_load((ROOT / "cost_models" / "profiles" / "h100-sxm.yaml").read_text())
    data["attention"].update(attention)
    return data


@pytest.mark.parametrize(
    ("shapes", "message"),
    [
        (
            {"cudnn": {"fwd": {"peak": 0.7, "keys_half": 200, "causal_keys_half": 400}}},
            "missing: bwd",
        ),
        (
            {"cudnn": {p: {"peak": 0.7, "keys_half": 200} for p in ("fwd", "bwd")}},
            "missing causal_keys_half",
        ),
        (
            {
                "cudnn": {
                    p: {"peak": 1.7, "keys_half": 200, "causal_keys_half": 9}
                    for p in ("fwd", "bwd")
                }
            },
            "peak = 1.7; give a number in (0, 1]",
        ),
        (
            {
                "cudnn": {
                    p: {"peak": 0.7, "keys_half": 2, "causal_keys_half": 9, "slope": 1}
                    for p in ("fwd", "bwd")
                }
            },
            "unknown field(s) slope",
        ),
    ],
)
def test_a_bad_shape_table_says_what_to_write(shapes, message):
    with pytest.raises(SpecError, match=message.replace("(", r"\(").replace(")", r"\)")):
        HardwareProfile.from_dict(_profile_with(shapes=shapes))


def test_the_shapes_survive_a_round_trip_through_yaml():
    p = HardwareProfile.load("gb300-nvl72")
    again = HardwareProfile.from_dict(yaml.safe_load(p.to_yaml()))
    assert again.attention_shapes == p.attention_shapes


def test_a_bad_head_limit_says_what_to_write():
    with pytest.raises(SpecError, match="fused_attention_max_head_dim must map architectures"):
        RuntimeOptions.from_dict(
            {"name": "mine", "fused_attention_max_head_dim": {"blackwell": "128"}}, what="mine"
        )
