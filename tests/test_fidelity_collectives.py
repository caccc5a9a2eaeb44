"""Collectives at scale: NCCL's protocol choice and ring structure (formulas.nccl_ring_time_s,
from NVIDIA/nccl src/graph/tuning.cc), and the data-parallel mechanisms of runtimes that issue
many collectives (DeepSpeed ZeRO-2's per-partition reduces, ZeRO-3's per-submodule gathers,
the runtime's own cost per collective; docs/runtimes.md [5.1], [7])."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pandas as pd
import pytest

from autosearch import Cluster, ModelSpec, Strategy
from autosearch.core import RUNTIMES
from cost_models import AnalyticCostModel
from cost_models.formulas import (
    NCCL_BASE_LATENCY_S,
    nccl_ring_time_s,
    nccl_tree_all_reduce_time_s,
)
from cost_models.terms._base import all_reduce_s, reduce_s

US = 1e-6
REFERENCE = Path(__file__).resolve().parents[1] / "benchmarks" / "reference"


def test_small_messages_take_nccls_low_latency_protocol():
    # 8 ranks in a node, alpha 3 us (Simple), 360 GB/s: 4 KB is latency-bound, so LL (0.6/3.4 of
    # the step latency, half the bandwidth) wins; tuning.cc's constants give the number exactly.
    t = nccl_ring_time_s(4096, 8, 1, 3 * US, 5 * US, 360e9)
    ll = 6.6 * US + 7 * 3 * US * 0.6 / 3.4 + 7 / 8 * 4096 / (0.5 * 360e9)
    assert t == pytest.approx(ll, rel=1e-12)
    # 1 GB is bandwidth-bound: Simple, the whole bus bandwidth
    big = nccl_ring_time_s(1e9, 8, 1, 3 * US, 5 * US, 360e9)
    assert big == pytest.approx(8.4 * US + 7 * 3 * US + 7 / 8 * 1e9 / 360e9, rel=1e-12)


def test_a_ring_over_nodes_crosses_the_network_once_per_node():
    # 1,024 ranks on 128 nodes: 127 of the 1,023 steps cross the network (tuning.cc nInterSteps
    # = nNodes - 1), the other 896 stay on NVLink; zero bytes isolate the latency (LL).
    t = nccl_ring_time_s(0.0, 1024, 128, 3 * US, 5 * US, 50e9)
    expected = 6.6 * US + 896 * 3 * US * 0.6 / 3.4 + 127 * 5 * US * 2.7 / 14
    assert t == pytest.approx(expected, rel=1e-12)
    # all-reduce: twice the steps and the volume
    ar = nccl_ring_time_s(0.0, 1024, 128, 3 * US, 5 * US, 50e9, passes=2)
    assert ar - 6.6 * US == pytest.approx(2 * (t - 6.6 * US), rel=1e-12)


def test_tree_all_reduce_latency_grows_with_log_nodes():
    one = nccl_tree_all_reduce_time_s(0.0, 1024, 128, 3 * US, 5 * US, 50e9)
    assert one == pytest.approx(8.4 * US + 2 * (7 * 3 * US + 7 * 5 * US), rel=1e-12)
    ring = nccl_ring_time_s(0.0, 1024, 128, 3 * US, 5 * US, 50e9, passes=2)
    assert one < ring


def _deepspeed_7b(overhead: float | None = None, nodes: int = 128):
    runtime = RUNTIMES["deepspeed"]
    if overhead is not None:
        runtime = dataclasses.replace(runtime, collective_overhead_s=overhead)
    model = ModelSpec.load("llama2-7b")
    cluster = Cluster.parse(f"a100-sxm4-80gb:{nodes}x8")
    return AnalyticCostModel(model, cluster, runtime=runtime)


def test_deepspeed_zero2_reduces_each_bucket_partition_by_partition():
    """DeepSpeed's comm-opt blog (blogs/comm-opt/README.md, Table 1): a dense 7B with ZeRO-1/2 on
    1,024 A100s spends 1.2 s in gradient reduction with one reduce per partition owner and
    bucket, 0.36 s with one all-reduce per bucket. The preset's per-collective overhead (50 us)
    was chosen against the difference of the two (0.84 s: it cancels what both share, such as
    the cluster's achieved bandwidth); the model's difference lands within 5% of it (the
    rounding to 50 us is 2%). The levels themselves come out lower than published (0.98 and
    0.17 s: the model's network runs faster than that cluster's)."""
    cm = _deepspeed_7b()
    ctx = cm._context
    s = Strategy(dp=1024, micro_batch_size=1, global_batch_size=1024, zero_stage=2)
    psi = cm._params(s).total
    buckets = math.ceil(psi / 5e8)
    size = 2 * psi / buckets
    per_partition = buckets * 1024 * (reduce_s(ctx, size / 1024, 1024, 1) + 50 * US)
    per_bucket = buckets * (all_reduce_s(ctx, size, 1024, 1) + 50 * US)
    rows = pd.read_csv(REFERENCE / "sharded_dp_runs.csv").set_index("id").published
    published = rows["DSCOMM-7B-1024-PERPARTITION"] - rows["DSCOMM-7B-1024-PERBUCKET"]
    assert published == pytest.approx(0.84)
    assert per_partition - per_bucket == pytest.approx(published, rel=0.05)
    assert per_partition == pytest.approx(0.98, rel=0.02)
    # and the estimate exposes the per-partition reduction (stage 2: no overlap by default)
    exposed = cm.estimate(s).time.dp_comm_exposed_s
    assert exposed > per_partition
    # without the runtime's own overhead, NCCL's latencies alone give a quarter of it
    bare = _deepspeed_7b(overhead=0.0).estimate(s).time.dp_comm_exposed_s
    assert bare < exposed - 0.6


def test_per_partition_reduction_grows_with_the_number_of_ranks():
    times = [
        _deepspeed_7b(nodes=n // 8)
        .estimate(Strategy(dp=n, micro_batch_size=1, global_batch_size=n, zero_stage=2))
        .time.dp_comm_exposed_s
        for n in (64, 256, 1024)
    ]
    assert times[0] < times[1] < times[2]
    assert times[2] > 3 * times[0]


def test_zero3_pays_a_gather_per_fetched_submodule():
    """DeepSpeed ZeRO-3 gathers submodule by submodule (4 per GPT block): without overlap, each
    gather pays the ring's latency, so at 1,024 ranks it costs more than FSDP's one per block."""
    model = ModelSpec.load("gpt3-13b")
    cluster = Cluster.parse("a100-sxm4-80gb:128x8")
    base = dataclasses.replace(RUNTIMES["deepspeed"], zero3_overlap=0.0, collective_overhead_s=0.0)
    s = Strategy(dp=1024, micro_batch_size=1, global_batch_size=1024, zero_stage=3)
    times = {
        k: AnalyticCostModel(
            model, cluster, runtime=dataclasses.replace(base, zero3_gathers_per_layer=k)
        )
        .estimate(s)
        .time.dp_comm_exposed_s
        for k in (1, 4)
    }
    layers = model.n_layers
    ring_latency = nccl_ring_time_s(0.0, 1024, 128, 3 * US, 6 * US, 25e9) - min(
        NCCL_BASE_LATENCY_S.values()
    )
    # two gather passes, (4 - 1) more gathers per layer, each at least the ring's latency
    assert times[4] - times[1] > 2 * 3 * layers * ring_latency
