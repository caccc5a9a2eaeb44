"""How the link model prices collectives over groups that span nodes (issue 19 item 8: the
Qwen3-235B picks were suspected of giving an expert-parallel group the bandwidth of 8 NICs).

Ranks of an 8-GPU H100 node share its 8 NICs, one per GPU (h100-sxm.yaml, rail-optimized).
- An all-to-all sends every byte bound for another node through the sender's own NIC: each GPU
  sends its own data, so the node's 8 NICs carry 8 GPUs' traffic and a GPU gets one NIC's
  bandwidth, whatever the group's size or stride.
- A ring all-gather (reduce-scatter) brings each remote shard into a node once and forwards it
  over NVLink: the node's inbound traffic is the remote data, over its 8 NICs (NCCL runs one
  ring per NIC), so a group with k members per node moves at k NICs' bandwidth.
Both follow from the bytes each link must carry; the second is what multi-node nccl-tests
report (all_reduce bus bandwidth on H100 nodes with 8 NDR NICs: 400-450 GB/s, i.e. the node's 8
NICs, Saturn Cloud "Validating Multi-Node GPU Clusters with NCCL Tests"). Tolerances at 1 GB:
the all-to-all within 10% (one latency per peer), the ring up to 1.3x its bandwidth term
(NCCL's protocol and per-step latency, `formulas.nccl_ring_time_s`: 1.24x for 256 ranks).
"""

from __future__ import annotations

import pytest

from autosearch import Cluster, ModelSpec
from cost_models import AnalyticCostModel
from cost_models.terms._base import all_gather_s, all_to_all_s

NBYTES = 1e9


@pytest.fixture(scope="module")
def ctx():
    model = ModelSpec.load("qwen3-235b-a22b", seq_len=4096)
    cost = AnalyticCostModel(model, Cluster.parse("h100-sxm:32x8"), runtime="megatron-core")
    return cost._context


@pytest.mark.parametrize("group,stride", [(32, 1), (32, 2), (64, 1), (256, 1), (32, 8)])
def test_all_to_all_across_nodes_gets_one_nic_per_gpu(ctx, group, stride):
    nic = ctx.profile.inter_node.achieved_bandwidth_bytes_per_s
    members = min(group, 8 // stride) if stride < 8 else 1  # of the group on one node
    remote = (group - members) / group * NBYTES  # what leaves the sender's node
    assert all_to_all_s(ctx, NBYTES, group, stride) == pytest.approx(remote / nic, rel=0.1)


@pytest.mark.parametrize("group,stride,members", [(256, 1, 8), (64, 2, 4), (32, 8, 1)])
def test_ring_all_gather_across_nodes_gets_the_members_nics(ctx, group, stride, members):
    nic = ctx.profile.inter_node.achieved_bandwidth_bytes_per_s
    factor = ctx.profile.inter_node.op_factor("all_gather")
    ideal = (group - 1) / group * NBYTES / (members * nic * factor)
    # NCCL's protocol and per-step latency on top of the bandwidth term (formulas.nccl_ring_time_s)
    assert ideal <= all_gather_s(ctx, NBYTES, group, stride) <= 1.3 * ideal
