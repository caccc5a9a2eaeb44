"""Today's hardware (B200, B300, GB200/GB300 NVL72, H800, MI300X): every profile loads, cites its
sources, and the NVLink domain of an NVL72 rack (72 GPUs on 18 hosts of 4) is what decides
whether a collective runs on NVLink or the network."""

import pytest

from autosearch import ModelSpec, Strategy
from autosearch.cli import main
from autosearch.core.errors import SpecError
from autosearch.core.hardware import Cluster, HardwareProfile, profile_for_device
from cost_models import AnalyticCostModel
from search_spaces import SearchSpace

NEW = ("b200-sxm", "b300-sxm", "gb200-nvl72", "gb300-nvl72", "h800-sxm", "mi300x")


@pytest.mark.parametrize("name", NEW)
def test_each_new_profile_loads_and_cites_its_sources(name):
    import re

    from autosearch.core.hardware import _profiles_dir

    p = HardwareProfile.load(name)
    assert all(p.peak_flops[k] > 0 for k in ("fp32", "bf16", "fp8"))
    assert any(s.startswith("[datasheet]") for s in p.sources)
    assert p.device_names and profile_for_device(p.device_names[0]) is p
    # every [tag] a value's comment cites is one of the profile's sources
    text = (_profiles_dir() / f"{name}.yaml").read_text()
    cited = set(re.findall(r"^[^#\n]*#.*?(\[[a-z0-9-]+\])", text, flags=re.M))
    assert cited and cited <= {s.split("]")[0] + "]" for s in p.sources}


def test_the_nvl72_domain_spans_hosts():
    rack = Cluster.parse("gb200-nvl72:18x4")
    assert (rack.world_size, rack.gpus_per_node, rack.nvlink_domain) == (72, 4, 72)
    assert Cluster.parse("gb200-nvl72:36x4").nvlink_domain == 72  # two racks, two domains
    assert Cluster.parse("h100-sxm:4x8").nvlink_domain == 8  # a node, as before
    nvl36 = Cluster.from_dict(
        {"gpu": "gb200-nvl72", "n_nodes": 18, "gpus_per_node": 4, "nvlink_domain": 36}
    )
    assert nvl36.nvlink_domain == 36 and nvl36.to_dict()["nvlink_domain"] == 36
    with pytest.raises(SpecError, match="= 72 is not a whole number of nodes of 5 devices"):
        Cluster(gpu="gb200-nvl72", n_nodes=9, gpus_per_node=5)


def test_tensor_parallel_over_the_rack_stays_on_nvlink():
    model = ModelSpec.load("llama3-70b")
    rack = Cluster.parse("gb200-nvl72:36x4")
    cm = AnalyticCostModel(model, rack)
    profile = rack.profile
    nvlink = profile.intra_node.achieved_bandwidth_bytes_per_s
    assert cm.group_link(16, 1)[1] == nvlink  # 16 GPUs on 4 hosts: NVLink
    network = profile.inter_node.achieved_bandwidth_bytes_per_s
    assert cm.group_link(2, 72)[1] == network  # one GPU in each of two racks: the network
    assert cm.group_link(144, 1)[0] == profile.inter_node.latency_s
    s = Strategy(dp=18, tp=8, global_batch_size=576, micro_batch_size=1, sequence_parallel=True)
    hosts_only = Cluster(gpu="gb200-nvl72", n_nodes=36, gpus_per_node=4, nvlink_domain=4)
    on_rack, on_hosts = cm.estimate(s), AnalyticCostModel(model, hosts_only).estimate(s)
    # tp=8 on two hosts of 4: NVLink's 720 GB/s achieved against 4 NICs x 45 GB/s = 180 GB/s
    assert on_rack.time.tp_comm_s < on_hosts.time.tp_comm_s / 3
    assert not on_rack.notes and "over the network" in on_hosts.notes[0]
    space = SearchSpace(model, rack, global_batch_size=576)
    assert 8 in space.tps and rack.gpus_per_node == 4  # tp beyond the host, inside the domain


def test_the_sweep_and_the_search_accept_them(tmp_path, capsys):
    out = tmp_path / "sweep.csv"
    code = main(
        ["sweep", "--models", "llama3-8b", "--gpus", "b200,gb200,h800,mi300x", "--nodes", "2"]
        + ["--global-batch-sizes", "64", "--n-trials", "30", "--out", str(out)]
    )
    assert code == 0, capsys.readouterr()
    text = out.read_text()
    for name in ("b200-sxm:2x8", "gb200-nvl72:2x4", "h800-sxm:2x8", "mi300x:2x8"):
        assert name in text
    code = main(
        ["tune", "--model", "llama3-8b", "--cluster", "gb300-nvl72:18x4"]
        + ["--global-batch-size", "144", "--dry-run"]
    )
    assert code == 0
