"""Offload to host memory (issue 36): the rules, the cost terms (cost_models/terms/offload.py),
the hardware profiles' hosts, and the search opening offload only where nothing fits without it.

The numbers asserted are closed forms of the term's own accounting (bytes per parameter, the
profile's host figures), so a tolerance of 1e-9 is float rounding only."""

from __future__ import annotations

import itertools

import optuna
import pytest

from autosearch import Cluster, ModelSpec, Strategy
from autosearch.core.errors import SpecError
from autosearch.tuning._advice import offload_needed
from cost_models import AnalyticCostModel
from cost_models.terms.compute import ADAM_BYTES_PER_PARAM
from search_spaces import SearchSpace, SpaceConfig

GiB = float(1 << 30)
MODEL_70B = ModelSpec.load("llama3-70b", seq_len=4096)
NODE = Cluster.parse("h100-sxm:1x8")
BASE = "dp=8,global_batch_size=32,zero_stage=3,recompute=full"
OFFLOADED = BASE + ",offload_optimizer=true,offload_params=true"


def _estimate(strategy: str, *, model=MODEL_70B, cluster=NODE, runtime=None):
    return AnalyticCostModel(model, cluster, runtime=runtime).estimate(Strategy.parse(strategy))


# ---- rules -------------------------------------------------------------------------------------
def test_parameter_offload_needs_zero3_and_the_optimizer_on_the_host():
    with pytest.raises(SpecError, match="offload_params needs zero_stage=3"):
        Strategy.parse("dp=8,zero_stage=2,offload_optimizer=true,offload_params=true").validate(
            MODEL_70B, NODE
        )
    with pytest.raises(SpecError, match="offload_params needs offload_optimizer=true"):
        Strategy.parse("dp=8,zero_stage=3,offload_params=true").validate(MODEL_70B, NODE)
    Strategy.parse(OFFLOADED).validate(MODEL_70B, NODE)


def test_labels_show_offload_and_stay_unchanged_without_it():
    assert Strategy.parse(BASE).short() == "dp8-tp1-pp1-mb1-gbs32-rc-full-z3-bf16"
    assert (
        Strategy.parse(OFFLOADED + ",offload_activations=layers")
        .short()
        .endswith("-z3-bf16-offopt-offparam-offact-layers")
    )


# ---- the cost terms ----------------------------------------------------------------------------
def test_the_70b_case_fits_one_node_only_with_offload():
    """llama3-70b on one 8 x H100 node at global batch 32: 16 bytes of model state per
    parameter under the Engine (fp32 weights, gradients, two Adam moments) cannot fit 8 x 80 GB;
    the optimizer states and the ZeRO-3 shards on the host can."""
    before, after = _estimate(BASE), _estimate(OFFLOADED)
    assert not before.fits and after.fits
    psi = before.memory.optimizer_bytes / 8.0  # this device's stepped parameters (2 x fp32)
    assert after.memory.optimizer_bytes == 0.0 and after.memory.grads_bytes == 0.0
    # the fp32 shard leaves the device: 4 bytes per stepped parameter
    assert before.memory.params_bytes - after.memory.params_bytes == pytest.approx(4 * psi)
    # the host keeps per parameter: two moments 8, the gradient 4, the fp32 master 4 and the
    # shard 4 = 20 bytes, for each of the node's 8 GPUs
    assert after.host_memory_bytes == pytest.approx(8 * 20 * psi, rel=1e-9)
    host = NODE.profile.host
    assert after.host_memory_capacity_bytes == host.memory_bytes - host.reserved_bytes
    # Adam on the host: memory-bound at 28 bytes per parameter over the node's bandwidth / 8
    # (112 cores / 8 x 0.8e9 parameters/s per core is faster)
    assert after.time.optimizer_s == pytest.approx(
        psi * ADAM_BYTES_PER_PARAM / (host.memory_bandwidth_bytes_per_s / 8), rel=1e-9
    )
    assert after.step_time_s > before.step_time_s  # offload costs time


def test_activation_offload_frees_device_memory_and_costs_copies_by_platform():
    """Activation offload keeps two layers on the device; the copies are exposed under the
    Engine's save_on_cpu and cost less over NVLink-C2C (GB200) than over PCIe 5 (H100)."""
    s = OFFLOADED + ",offload_activations=layers"
    h100, base = _estimate(s), _estimate(OFFLOADED)
    assert h100.memory.activations_bytes < base.memory.activations_bytes
    assert h100.host_memory_bytes > base.host_memory_bytes
    assert h100.time.offload_s > 0
    gb200 = _estimate(s, cluster=Cluster.parse("gb200-nvl72:2x4"))
    pcie, c2c = NODE.profile.host, Cluster.parse("gb200-nvl72:2x4").profile.host
    ratio = c2c.achieved_bandwidth_bytes_per_s / pcie.achieved_bandwidth_bytes_per_s
    assert ratio > 3 and gb200.time.offload_s < h100.time.offload_s


def test_the_host_running_out_is_a_clear_refusal():
    """llama3.1-405b on one node: 20 bytes per parameter on the host is 8.1 TB, over 2 TB."""
    r = _estimate(OFFLOADED + ",tp=1", model=ModelSpec.load("llama3.1-405b", seq_len=4096))
    assert not r.fits and not r.host_fits
    if r.memory_excess_bytes == 0:
        assert "GiB of host memory per node" in r.infeasible_reason
    assert r.with_margin(0.0).fits is False  # the margin rule keeps the host's refusal


def test_a_profile_without_a_host_refuses_offload():
    import dataclasses

    from autosearch.core.hardware import Cluster as C

    cluster = C(gpu=dataclasses.replace(NODE.profile, host=None), n_nodes=1)
    with pytest.raises(SpecError, match="describes no host"):
        _estimate(OFFLOADED, cluster=cluster)


def test_runtimes_without_offload_refuse_it():
    with pytest.raises(SpecError, match="cannot run offload_params=true"):
        _estimate(OFFLOADED, runtime="megatron-core")
    _estimate(OFFLOADED, runtime="deepspeed")


# ---- the search --------------------------------------------------------------------------------
def test_offload_is_opened_only_where_nothing_fits_without_it():
    assert offload_needed(MODEL_70B, NODE)
    assert not offload_needed(ModelSpec.load("llama3-8b"), NODE)
    closed = SearchSpace(MODEL_70B, NODE, global_batch_size=32)
    assert closed.plain_choices()["offload_optimizer"] == (False,)


def test_when_even_offload_does_not_fit_tune_says_the_host_is_short(tmp_path):
    """llama3.1-405b on one node: offload fits the devices but not the host's 2 TB; the
    message says so, drops the floor's claim that no strategy can go below it, and names the
    smallest cluster of the space (with offload) that fits."""
    from autosearch.tuning import NoFeasibleStrategyError
    from autosearch.tuning._study import tune

    with pytest.raises(NoFeasibleStrategyError) as info:
        tune("llama3.1-405b", "h100-sxm:1x8", global_batch_size=32, seed=0, out=tmp_path)
    text = str(info.value)
    assert "Without offload to host memory any strategy needs at least" in text
    assert "which fits, but" in text and "GiB of host memory per node" in text
    assert "nodes or more" in text


def test_offload_opens_where_the_leanest_strategies_do_not_fit():
    """llama3-70b on two nodes at global batch 16: the floor (67.5 GiB) is under the device,
    but no strategy of the space's leanest settings fits 80 GiB less the margin: offload opens;
    llama3-8b fits and keeps it closed."""
    model, cluster = MODEL_70B, Cluster.parse("h100-sxm:2x8")
    config, _ = SpaceConfig.default().resolved(runtime="torch", model=model, cluster=cluster)
    assert not offload_needed(model, cluster)  # the floor alone does not say so
    assert offload_needed(model, cluster, global_batch_size=16, config=config, margin_fraction=0.1)
    small = ModelSpec.load("llama3-8b")
    config, _ = SpaceConfig.default().resolved(runtime="torch", model=small, cluster=cluster)
    assert not offload_needed(
        small, cluster, global_batch_size=16, config=config, margin_fraction=0.1
    )


def _open_space(model, cluster, gbs):
    config, _ = SpaceConfig.default().resolved(
        runtime="torch", model=model, cluster=cluster, offload=True
    )
    return SearchSpace(model, cluster, global_batch_size=gbs, config=config)


def test_an_open_space_holds_exactly_the_valid_combinations():
    """Offload's rule reads three axes (offload_params, offload_optimizer, zero_stage): the
    space keeps the combinations it allows, its size counts them, and the sampler draws
    only them."""
    model = ModelSpec.load("llama3-8b").scaled(n_layers=4)
    cluster = Cluster.parse("h100-sxm:1x4")
    space = _open_space(model, cluster, 8)
    strategies = list(space.enumerate())
    assert len(strategies) == space.size
    for s in strategies[:: max(1, len(strategies) // 500)]:
        s.validate(model, cluster)
    seen = {(s.zero_stage, s.offload_optimizer, s.offload_params) for s in strategies}
    assert (3, True, True) in seen and not any(p and (z != 3 or not o) for z, o, p in seen)
    # every combination the rules allow, per layout
    layout = next(space.layouts())
    combos = {
        (s.zero_stage, s.offload_optimizer, s.offload_params) for s in space.strategies_of(layout)
    }
    expected = {
        (z, o, p)
        for z, o, p in itertools.product(space.zero_stages, (False, True), (False, True))
        if not p or (z == 3 and o)
    }
    assert combos == expected
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(60):
        trial = study.ask()
        s = space.suggest(trial)
        s.validate(model, cluster)
        assert space.params_of(s) == trial.params
        study.tell(trial, 1.0)


# ---- exports -----------------------------------------------------------------------------------
def _export(strategy: str, to: str):
    from autosearch.export import export

    return export(Strategy.parse(strategy), to=to, model=MODEL_70B, allow_unsupported=True)


def test_deepspeed_offloads_to_pinned_host_memory():
    import json

    out = _export(OFFLOADED, "deepspeed")
    zero = json.loads(out.text)["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert zero["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert {"offload_optimizer", "offload_params"} <= out.mapped and not out.unsupported
    activations = _export(BASE + ",offload_activations=layers", "deepspeed")
    assert "offload_activations" in dict(activations.unsupported)


def test_megatron_offloads_the_optimizer_and_whole_layers():
    out = _export("dp=8,global_batch_size=32,zero_stage=1,offload_optimizer=true", "megatron")
    for flag in ("--optimizer-cpu-offload", "--optimizer-offload-fraction 1.0"):
        assert flag in out.text
    layers = _export(
        "dp=8,global_batch_size=32,zero_stage=1,offload_activations=layers", "megatron"
    )
    assert "--cpu-offloading-num-layers 79" in layers.text  # every layer but the last
    refused = _export(BASE + ",offload_activations=layers", "megatron")  # with recompute
    assert "offload_activations" in dict(refused.unsupported)
    assert "offload_params" in dict(_export(OFFLOADED, "megatron").unsupported)


def test_torchtitan_offloads_parameters_and_optimizer_together():
    out = _export(OFFLOADED, "torchtitan")
    assert "enable_cpu_offload = true" in out.text and not out.unsupported
    alone = _export("dp=8,global_batch_size=32,zero_stage=3,offload_optimizer=true", "torchtitan")
    assert "offload_optimizer" in dict(alone.unsupported)
