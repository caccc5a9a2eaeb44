"""Issue 30 item 3: a cluster's GPU is named before its node shape is asked for, and a node
holds at most the GPUs of the profile's node (fewer is a partial node)."""

import pytest

from autosearch import Cluster, SpecError
from autosearch.cli import main


def test_an_unknown_gpu_is_named_before_the_node_shape():
    with pytest.raises(SpecError, match="unknown GPU 'banana'") as exc:
        Cluster.parse("banana", strict=True, what="--cluster")
    assert "banana:1x8" not in str(exc.value) and "`autosearch hardware`" in str(exc.value)


def test_a_near_miss_gets_a_did_you_mean():
    with pytest.raises(SpecError, match="Did you mean 'h100-sxm'"):
        Cluster.parse("h100sxm:1x8", strict=True)
    with pytest.raises(SpecError, match="unknown GPU 'banana'") as exc:
        Cluster.parse("banana:1x8")
    assert "Did you mean" not in str(exc.value)


def test_a_known_gpu_without_a_shape_is_still_asked_for_it():
    with pytest.raises(SpecError, match="h100-sxm:1x8"):
        Cluster.parse("h100-sxm", strict=True)


@pytest.mark.parametrize(
    "text,expect",
    [
        ("h100-sxm:8x9", ("holds 8", "h100-sxm:9x8 for the same 72 GPUs", "partial node")),
        ("h100-sxm:1x12", ("holds 8", "h100-sxm:NODESx8")),
        # GB200 NVL72: a node (host) holds 4 GPUs; the rack of 72 is 18 nodes (the profile's
        # nvlink_domain), written gb200-nvl72:18x4
        ("gb200-nvl72:1x72", ("holds 4", "18 nodes", "gb200-nvl72:18x4")),
    ],
)
def test_more_gpus_per_node_than_the_profile_holds_are_refused(text, expect):
    with pytest.raises(SpecError) as exc:
        Cluster.parse(text, what="--cluster")
    assert all(e in str(exc.value) for e in expect), str(exc.value)


def test_the_same_rule_holds_for_a_mapping_and_a_file(tmp_path):
    with pytest.raises(SpecError, match="holds 8"):
        Cluster.parse({"gpu": "h100-sxm", "n_nodes": 1, "gpus_per_node": 16})
    f = tmp_path / "c.yaml"
    f.write_text("gpu: h100-sxm\nn_nodes: 2\ngpus_per_node: 9\n")
    with pytest.raises(SpecError, match="holds 8"):
        Cluster.parse(str(f))


def test_a_partial_node_and_a_whole_one_are_fine():
    assert Cluster.parse("h100-sxm:2x4").world_size == 8
    assert Cluster.parse("gb200-nvl72:18x4").nvlink_domain == 72
    assert Cluster.parse("h100-sxm:1x8").world_size == 8


def test_the_cli_says_it_with_exit_status_2(capsys):
    argv = ["estimate", "--model", "llama3-8b", "--cluster", "h100-sxm:8x9"]
    code = main([*argv, "--strategy", "dp=72", "--global-batch-size", "72"])
    err = capsys.readouterr().err
    assert code == 2 and "--cluster h100-sxm:8x9" in err and "h100-sxm:9x8" in err
