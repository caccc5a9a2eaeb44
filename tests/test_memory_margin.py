"""Memory headroom (issue 18 item 4): a strategy fits only with a margin that comes from the
measured memory error, `--memory-margin` overrides it, and the reports show peak, margin and
capacity."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from autosearch import Cluster, ModelSpec, Strategy, TuneConfig, tune
from autosearch.core.bands import conformal_band
from autosearch.core.report import CostReport
from autosearch.core.runtime import RUNTIMES
from autosearch.tuning._margin import memory_bands, memory_margin
from cost_models import AnalyticCostModel

ROOT = Path(__file__).resolve().parent.parent
GiB = float(1 << 30)


def _bands_module():
    spec = importlib.util.spec_from_file_location(
        "memory_bands", ROOT / "benchmarks" / "memory_bands.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_bands_file_is_what_the_fidelity_runs_give():
    """cost_models/memory_bands.yaml holds, per kind, the upper end of the split-conformal 90%
    interval of measured / predicted peak memory over the runs in results/fidelity_modern.csv
    (published torchtitan memory) and results/fidelity_local.csv (the Engine on this machine):
    rebuilt here from the CSVs, to the file's 4 decimals."""
    evidence = _bands_module().evidence()
    kinds = {(k["runtime"], k["device"]): k for k in memory_bands()}
    assert set(kinds) == {kind for kind, _, _ in evidence}
    for kind, k in kinds.items():
        ratios = [q for other, q, _ in evidence if other == kind]
        assert k["runs"] == len(ratios) >= 10
        assert k["high"] == pytest.approx(conformal_band(ratios)[1], abs=5e-5)
        assert k["high"] >= 1.0  # the model under-predicts some runs of every kind


def test_the_margin_comes_from_the_kind_of_run_or_the_nearest_evidence():
    h100, cpu = (
        Cluster.parse("h100-sxm:1x8"),
        Cluster.parse("results/calibration/example-amd-epyc-2c.yaml:1x2"),
    )
    tt = memory_margin("torchtitan", h100)
    high = {(k["runtime"], k["device"]): k["high"] for k in memory_bands()}
    assert tt.fraction == pytest.approx(1 - 1 / high[("torchtitan", "cuda")])
    assert "measured torchtitan runs on cuda" in tt.why
    # the Engine on a GPU: its own runs (benchmarks/gpu_check.py, results/gpu/h200)
    torch_gpu = memory_margin("torch", h100)
    assert torch_gpu.fraction == pytest.approx(1 - 1 / high[("torch", "cuda")])
    assert "measured torch runs on cuda" in torch_gpu.why
    # a runtime with no measured run on a device takes the widest band measured there
    widest = max(h for (_, device), h in high.items() if device == "cuda")
    mcore = memory_margin("megatron-core", h100)
    assert mcore.fraction == pytest.approx(1 - 1 / widest) and "no measured" in mcore.why
    # the Engine on this machine has its own runs
    assert memory_margin("torch", cpu).fraction == pytest.approx(1 - 1 / high[("torch", "cpu")])
    # a dated preset is evidence for its framework, and the flag overrides everything
    assert memory_margin("torchtitan-2412", h100).fraction == tt.fraction
    assert memory_margin("torch", h100, override=0.05).fraction == 0.05


def test_with_margin_fits_only_below_the_capacity_less_the_margin():
    cm = AnalyticCostModel(ModelSpec.load("llama3-8b"), Cluster.parse("h100-sxm:1x8"))
    r = cm.estimate(Strategy(dp=8, micro_batch_size=1, global_batch_size=64, zero_stage=3))
    assert r.fits and r.memory_margin_bytes == 0.0
    room = r.memory_capacity_bytes - r.peak_memory_bytes
    assert r.with_margin(room).fits and not r.with_margin(room + 1).fits
    tight = r.with_margin(room + GiB)
    assert tight.memory_excess_bytes == pytest.approx(GiB)
    assert "less a margin of" in tight.infeasible_reason
    # a report stored before the margin existed reads back with none
    data = tight.to_dict(flat=False)
    assert CostReport.from_dict(data) == tight
    del data["memory_margin_bytes"]
    assert CostReport.from_dict(data).memory_margin_bytes == 0.0


def test_the_torch_preset_reserves_what_torchtitan_reserves_on_cuda_only():
    """The Engine and torchtitan share the CUDA caching allocator (FSDP2, DTensor): the same
    reserve; on a CPU no caching allocator holds memory beyond the tensors."""
    torch, tt = RUNTIMES["torch"], RUNTIMES["torchtitan"]
    assert torch.allocator_reserve_fraction == tt.allocator_reserve_fraction > 0
    s = Strategy(dp=8, micro_batch_size=1, global_batch_size=64, zero_stage=3)
    gpu = AnalyticCostModel(ModelSpec.load("llama3-8b"), Cluster.parse("h100-sxm:1x8"))
    m = gpu.estimate(s).memory
    tensors = m.params_bytes + m.grads_bytes + m.optimizer_bytes + m.activations_bytes
    reserved = gpu.profile.reserved_memory_bytes
    assert m.other_bytes == pytest.approx(reserved + torch.allocator_reserve_fraction * tensors)
    cpu = AnalyticCostModel(
        ModelSpec.load("tiny-gpt"),
        Cluster.parse("results/calibration/example-amd-epyc-2c.yaml:1x2"),
    )
    m = cpu.estimate(Strategy(dp=2, global_batch_size=8, amp="fp32")).memory
    assert m.other_bytes == cpu.profile.reserved_memory_bytes


def test_tune_keeps_the_margin_and_the_flag_changes_it():
    base = dict(model="llama3-8b", cluster="h100-sxm:1x8", global_batch_size=64, seed=0)
    for margin in (None, 0.0, 0.4):
        result = tune(TuneConfig(**base, memory_margin=margin))
        r = result.best_report
        assert r.memory_margin_bytes == pytest.approx(
            result.margin.fraction * r.memory_capacity_bytes
        )
        assert r.peak_memory_bytes <= r.memory_capacity_bytes - r.memory_margin_bytes
        assert all(
            c.report.peak_memory_bytes <= c.report.memory_usable_bytes for c in result.top_k
        )
        if margin is not None:
            assert result.margin.fraction == margin
    assert "GiB margin" in result.memory_line(r)


@pytest.mark.slow
def test_the_readme_main_job_picks_a_strategy_that_fits_with_the_margin():
    """`autosearch tune --model llama3-70b --cluster h100-sxm:32x8 --global-batch-size 512`:
    before the margin and the reserve it picked dp64-tp4-pp1-mb1-sp-z3-bf16 at 75.4 of 80 GiB,
    which torchtitan's allocator puts at 82 GiB. Its pick now leaves the margin free."""
    result = tune(
        TuneConfig(model="llama3-70b", cluster="h100-sxm:32x8", global_batch_size=512, seed=0)
    )
    r = result.best_report
    # the Engine's own band on a GPU (its runs on one H200, results/gpu/h200)
    (band,) = [
        k["high"] for k in memory_bands() if (k["runtime"], k["device"]) == ("torch", "cuda")
    ]
    assert r.memory_margin_bytes == pytest.approx((1 - 1 / band) * r.memory_capacity_bytes)
    assert r.memory_margin_bytes > 0.05 * r.memory_capacity_bytes
    assert r.peak_memory_bytes <= r.memory_capacity_bytes - r.memory_margin_bytes
    old = Strategy.parse("dp=64,tp=4,sequence_parallel=true,zero_stage=3,global_batch_size=512")
    cm = AnalyticCostModel(result.space.model, result.space.cluster)
    assert not cm.estimate(old).with_margin(r.memory_margin_bytes).fits
