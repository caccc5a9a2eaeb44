"""Dated releases are runtime presets (cost_models/runtimes.yaml `base:` chains): a release
inherits what it does not set from the preset it refines, prices as that preset where it sets
nothing else, is chosen with `--runtime nemo-25.04`, and what one run of it switched on is
`RuntimeOptions.as_run` (issue 34 part 2)."""

from __future__ import annotations

import dataclasses

import pytest

from autosearch import Cluster
from autosearch.cli import main
from autosearch.core import RUNTIMES, ModelSpec, SpecError, Strategy
from autosearch.core import runtime as runtime_module
from autosearch.core.runtime import RuntimeOptions
from cost_models import AnalyticCostModel

RELEASES = [n for n in RUNTIMES if n.startswith(("nemo-", "megatron-bridge-"))]
# the fields that name a preset rather than price it
LABELS = {"name", "description", "base", "sources"}


def _priced(runtime: RuntimeOptions) -> dict:
    return {k: v for k, v in dataclasses.asdict(runtime).items() if k not in LABELS}


def test_every_release_names_its_framework_through_its_chain():
    assert {"nemo-25.04", "megatron-bridge-25.09", "megatron-bridge-26.08"} <= set(RELEASES)
    for name in RELEASES:
        assert RUNTIMES[name].framework == "megatron-core", name
    assert RUNTIMES["nemo-25.04"].base == "nemo" and RUNTIMES["nemo"].base == "megatron-core"
    assert RUNTIMES["torchtitan-2412"].framework == "torchtitan"
    assert RUNTIMES["torch"].framework == "torch"


def test_a_release_that_sets_nothing_prices_as_its_base():
    """Each Megatron-Bridge release sets no priced field of its own (its recipes' switches are
    the runs' columns): every field and every estimate equal megatron-core's; NeMo 25.04's
    equal nemo's (performance recipes: bf16 gradients), but for what its TransformerEngine's
    kernels take (`fused_attention_max_head_dim`: TE before 2.5 in NeMo up to 25.04) and how
    fast they ran on Blackwell (`kernel_efficiency`, NeMo 2's 25.02-25.07: chosen against
    their dense GB200 rows; `expert_kernel_efficiency`: their MoE experts on top, chosen
    against their Mixtral and Llama 4 rows, docs/runtimes.md [3.9])."""
    kernels = {"fused_attention_max_head_dim", "kernel_efficiency", "expert_kernel_efficiency"}
    for name in RELEASES:
        base = "nemo" if name.startswith("nemo-") else "megatron-core"
        mine, theirs = _priced(RUNTIMES[name]), _priced(RUNTIMES[base])
        assert {k for k in mine if mine[k] != theirs[k]} <= kernels, name
        if name.startswith("megatron-bridge-"):
            assert mine == theirs, name
    assert dict(RUNTIMES["nemo-25.04"].fused_attention_max_head_dim) == {"blackwell": 128}
    nemo2 = {n: dict(RUNTIMES[n].kernel_efficiency) for n in RELEASES if n.startswith("nemo-")}
    assert {n for n, k in nemo2.items() if k} == {"nemo-25.02", "nemo-25.04", "nemo-25.07"}
    assert all(set(k) <= {"blackwell"} for k in nemo2.values())  # not on their H100 rows
    experts = {n: dict(RUNTIMES[n].expert_kernel_efficiency) for n in nemo2}
    assert {n for n, k in experts.items() if k} == set(nemo2) - {"nemo-24.07", "nemo-24.09"}
    assert all(set(k) <= {"blackwell"} for k in experts.values())
    strategy = Strategy(dp=4, tp=2, global_batch_size=64, sequence_parallel=True)
    model, cluster = ModelSpec.load("llama3-8b"), Cluster.parse("h100-sxm:1x8")
    a = AnalyticCostModel(model, cluster, runtime="megatron-bridge-26.08")
    b = AnalyticCostModel(model, cluster, runtime="megatron-core")
    assert a.estimate(strategy).step_time_s == b.estimate(strategy).step_time_s


def test_as_run_maps_each_switch_to_the_presets_behaviour():
    mcore = RUNTIMES["megatron-core"]
    assert mcore.as_run() is mcore
    bf16 = mcore.as_run(grad_reduce_in_fp32=False)
    assert (bf16.main_grad_fp32, bf16.grad_reduce_bytes) == (False, 2)
    assert _priced(bf16) == _priced(RUNTIMES["nemo"])  # what NeMo's performance mode sets
    te24 = _priced(RUNTIMES["nemo-25.04"].as_run(grad_reduce_in_fp32=True))
    assert te24 == {
        **_priced(mcore),
        "fused_attention_max_head_dim": (("blackwell", 128),),
        "kernel_efficiency": RUNTIMES["nemo-25.04"].kernel_efficiency,
        "expert_kernel_efficiency": RUNTIMES["nemo-25.04"].expert_kernel_efficiency,
    }
    on = mcore.as_run(moe_a2a_overlap=True, moe_dispatcher="deepep")
    assert on.moe_a2a_overlap == mcore.moe_a2a_overlap_when_on > 0
    assert on.moe_dispatcher == "deepep"
    assert on.as_run(moe_a2a_overlap=False).moe_a2a_overlap == 0.0
    graphed = mcore.as_run(full_iteration_cuda_graph=True, balanced_routing=True)
    assert graphed.moe_layer_host_s == 0.0 and mcore.moe_layer_host_s > 0
    assert graphed.moe_expert_host_s == 0.0 and mcore.moe_expert_host_s > 0
    assert graphed.moe_load_imbalance == 1.0 < mcore.moe_load_imbalance
    assert mcore.as_run(moe_shared_expert_overlap=True).moe_shared_expert_overlap
    # per-layer CUDA graphs capture a MoE layer whole only when it drops and pads to capacity
    layered = mcore.as_run(layer_cuda_graph=True, balanced_routing=True)
    assert (layered.moe_layer_host_s, layered.moe_expert_host_s) == (0.0, 0.0)
    with pytest.raises(SpecError, match="layer_cuda_graph.*drops and pads"):
        mcore.as_run(layer_cuda_graph=True)
    with pytest.raises(SpecError, match="moe_dispatcher 'nccl'.*alltoall, deepep"):
        mcore.as_run(moe_dispatcher="nccl")


def test_a_base_chain_that_loops_or_names_no_preset_is_refused(monkeypatch):
    presets = {
        "a": {"base": "b", "description": "x"},
        "b": {"base": "a", "description": "y"},
    }
    monkeypatch.setattr(runtime_module.data, "read_data", lambda *a, **k: {"runtimes": presets})
    with pytest.raises(SpecError, match="runtime 'b': base 'a'.*a -> b -> a"):
        runtime_module._load_runtimes()
    presets = {"a": {"base": "nemo-25.99"}}
    monkeypatch.setattr(runtime_module.data, "read_data", lambda *a, **k: {"runtimes": presets})
    with pytest.raises(SpecError, match="base 'nemo-25.99' must be another preset"):
        runtime_module._load_runtimes()


@pytest.mark.parametrize("field", ["kernel_efficiency", "expert_kernel_efficiency"])
@pytest.mark.parametrize("bad", [{"blackwell": 1.2}, {"blackwell": 0}, [0.7], {"hopper": True}])
def test_a_kernel_factor_outside_zero_to_one_is_refused_by_name(field, bad):
    from autosearch.core.runtime import RuntimeOptions

    with pytest.raises(SpecError, match=rf"my preset: {field} must map architectures"):
        RuntimeOptions.from_dict({"name": "x", field: bad}, what="my preset")
    ok = RuntimeOptions.from_dict({"name": "x", field: {"blackwell": 0.5}}, what="my preset")
    assert getattr(ok, field) == (("blackwell", 0.5),)


def test_tune_runs_a_release_from_the_command_line(capsys, tmp_path):
    out = tmp_path / "o"
    argv = ["tune", "--model", "tiny-gpt", "--cluster", "h100-sxm:1x8"]
    argv += ["--global-batch-size", "64", "--n-trials", "3", "--quiet", "--out", str(out)]
    assert main([*argv, "--runtime", "nemo-25.04"]) == 0
    text = capsys.readouterr().out
    assert "this plan is for nemo-25.04" in text
    assert "runtime: nemo-25.04" in (out / "best_strategy.yaml").read_text()


def test_an_unknown_release_is_refused_naming_the_known_ones(capsys, tmp_path):
    argv = ["tune", "--model", "tiny-gpt", "--cluster", "h100-sxm:1x8"]
    argv += ["--global-batch-size", "64", "--n-trials", "3", "--quiet"]
    argv += ["--out", str(tmp_path / "o"), "--runtime", "megatron-bridge-26.05"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "unknown runtime 'megatron-bridge-26.05'" in err and "Traceback" not in err
    assert "releases of megatron-bridge with a preset are megatron-bridge-25.09" in err
    assert "megatron-bridge-26.08" in err and "torchtitan-2412" in err
