"""What a first GPU run would have found (shared/notes/cuda-review.md), shown on CPU where CPU can
show it; the GPU-only checks are in test_cuda.py (`cuda` marker)."""

import subprocess
import sys
from pathlib import Path

import pytest

from autosearch import ModelSpec, Strategy
from autosearch.calibration.runner import with_compute_world_size
from autosearch.core.errors import SpecError
from autosearch.core.hardware import Cluster, HardwareProfile, profile_for_device
from autosearch.core.runtime import RuntimeOptions
from cost_models import AnalyticCostModel

FACTORIES = Path(__file__).resolve().parent / "validation_factories.py"
SPEC = ModelSpec.load("tiny-gpt").scaled(n_layers=2, seq_len=64)
S1 = Strategy(micro_batch_size=2, global_batch_size=4, amp="fp32")


def test_validation_builds_on_the_meta_device_and_compares_tensor_with_tensor(tmp_path):
    """The worker builds the model on the meta device (the factory refuses anything else), and
    memory_error_pct compares the predicted tensor peak (without the profile's 2.5 GB reserve)
    with the measured tensor peak; the total over the tensor peak was the review's +301%."""
    from autosearch.validation import validate

    result = validate(
        SPEC,
        [S1],
        cluster="h200-sxm:1x1",
        steps=1,
        warmup=1,
        out=tmp_path,
        verbose=False,
        factory=f"{FACTORIES}:meta_only",
    )
    row = result.table.iloc[0]
    assert row.status == "ok", row.reason
    measured = row.measured_peak_memory_bytes
    tensor_error = 100 * (row.predicted_peak_memory_bytes / measured - 1)
    assert row.memory_error_pct == pytest.approx(tensor_error, rel=1e-12)
    total_error = 100 * (row.predicted_total_memory_bytes / measured - 1)
    reserve = HardwareProfile.load("h200-sxm").reserved_memory_bytes
    # what the CUDA caching allocator holds beyond the live tensors (the torch preset's reserve)
    held = RuntimeOptions.get("torch").allocator_reserve_fraction
    held *= row.predicted_peak_memory_bytes
    # the reserve alone is 2.5 GB against a few MB measured: the old column was off by that
    assert total_error - tensor_error == pytest.approx(100 * (reserve + held) / measured, rel=1e-9)
    assert abs(row.memory_error_pct) < 100 < total_error


def test_timed_steps_do_not_build_batches(monkeypatch):
    """Every batch exists before the first timed step: no SyntheticTokens sample is made while
    measure.time_steps runs (it was ~50-100 ms a batch, the order of a GPU step)."""
    from autosearch.engine.data import SyntheticTokens
    from autosearch.validation import measure, worker

    made = {"timed": 0, "before": 0}
    timing = []
    getitem, time_steps = SyntheticTokens.__getitem__, measure.time_steps

    def counting_getitem(self, i):
        made["timed" if timing else "before"] += 1
        return getitem(self, i)

    def flagged_time_steps(*args, **kwargs):
        timing.append(True)
        try:
            return time_steps(*args, **kwargs)
        finally:
            timing.clear()

    monkeypatch.setattr(SyntheticTokens, "__getitem__", counting_getitem)
    monkeypatch.setattr(measure, "time_steps", flagged_time_steps)
    record = worker.run(
        {"model": SPEC.to_dict(), "strategy": S1.to_dict(), "steps": 2, "warmup": 1}
    )
    assert record["steps_measured"] == 2 and record["meta_init"] is True
    assert made == {"timed": 0, "before": 4 * 4}  # 3 timed steps + the memory step, 4 samples


def gpu_profile(**overrides):
    from test_calibration_quality import gpu_profile as synthetic_h100

    return synthetic_h100(**overrides)


def test_a_calibrated_h100_keeps_fp8_its_architecture_and_kernels():
    catalog = HardwareProfile.load("h100-sxm")
    prof = gpu_profile()  # synthetic H100 rows: fp32 and bf16 GEMMs, no fp8 benchmark
    assert prof.peak_flops["fp8"] == catalog.peak_flops["fp8"]
    for p in ("fp8", "fp8_rowwise"):
        assert prof.gemm.max_efficiency[p] == catalog.gemm.max_efficiency[p]
    assert prof.architecture == "hopper" and prof.attention_kernels == catalog.attention_kernels
    assert "precision.fp8" in prof.calibration["defaults"]
    cluster = Cluster(gpu=prof, n_nodes=1, gpus_per_node=8)
    s = Strategy(dp=8, global_batch_size=64, fp8="tensorwise", compile=True)
    report = AnalyticCostModel(ModelSpec.load("llama3-8b"), cluster, runtime="torchtitan")
    assert report.estimate(s).step_time_s > 0  # was refused: "this hardware profile has no fp8"


def test_measured_fp8_gemms_set_the_fp8_ceilings():
    import pandas as pd
    from test_calibration_quality import GPU, GPU_MACHINE, synthetic

    from cost_models.calibration import build_profile

    df = synthetic(**GPU)
    peak = HardwareProfile.load("h100-sxm").peak_flops["fp8"]
    rows = [
        {
            "device": "cuda",
            "world_size": 1,
            "kind": "gemm_fp8",
            "op": "scaled_mm",
            "precision": p,
            "m": m,
            "n": n,
            "k": k,
            "time_s": 2 * m * n * k / (eff * peak) * (1 + 128 / m + 128 / n + 128 / k),
        }
        for p, eff in (("fp8", 0.6), ("fp8_rowwise", 0.5))
        for m in (1024, 4096, 16384)
        for n in (4096, 8192)
        for k in (4096, 8192)
    ]
    df = pd.concat([df, pd.DataFrame(rows)], ignore_index=True)
    prof, fits = build_profile(
        df, name="h100-fp8", machine=dict(GPU_MACHINE), compute_world_size=1, gpus_per_node=8
    )
    assert prof.gemm.max_efficiency["fp8"] == pytest.approx(0.6, rel=0.05)  # 5%: fit noise
    assert prof.gemm.max_efficiency["fp8_rowwise"] == pytest.approx(0.5, rel=0.05)
    assert "gemm.max_efficiency.fp8" in prof.measured and "gemm_fp8" in fits


@pytest.mark.parametrize(
    "name, profile",
    [
        ("NVIDIA H100 80GB HBM3", "h100-sxm"),
        ("NVIDIA H200", "h200-sxm"),
        ("NVIDIA A100-SXM4-40GB", "a100-sxm4-40gb"),
        ("nvidia a100-sxm4-80gb", "a100-sxm4-80gb"),
        ("NVIDIA H100 PCIe", None),
        ("NVIDIA H100 NVL", None),
        ("NVIDIA GH200 480GB", None),
        ("NVIDIA H200 NVL", None),
        ("NVIDIA A100-PCIE-40GB", None),
        ("NVIDIA L40S", None),
    ],
)
def test_gpu_names_are_resolved_exactly(name, profile):
    found = profile_for_device(name)
    assert (found.name if found else None) == profile


def test_short_gpu_names_are_profile_data(capsys):
    from autosearch.commands._common import load_cluster
    from autosearch.core.hardware import profile_aliases

    aliases = profile_aliases()
    assert aliases["h100"] == "h100-sxm" and aliases["h200"] == "h200-sxm"
    assert load_cluster("h100:2x8").profile.name == "h100-sxm"
    assert "'h100' is read as the 'h100-sxm' profile" in capsys.readouterr().err


def test_more_processes_than_gpus_is_one_message(monkeypatch):
    """torchrun --nproc_per_node=2 on one GPU: a SpecError naming the fix, not "invalid device
    ordinal" (the real launch is in test_cuda.py)."""
    import torch

    from autosearch.engine import distributed as D

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(SpecError, match="needs its own GPU; start at most 1 per node"):
        D.device()
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert D.device() == torch.device("cuda", 0)


def test_a_cpu_only_torch_on_a_gpu_machine_is_said(monkeypatch, capsys, tmp_path):
    from autosearch.engine import distributed as D

    monkeypatch.setattr(D, "nvidia_gpus", lambda: 8)
    monkeypatch.setattr(D, "_warned", [])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert D.device().type == "cpu"
    assert "CPU-only build and this machine has 8 NVIDIA GPU(s)" in capsys.readouterr().err
    # validation (torch-free: a fresh process) reads the build from torch/version.py; the GPUs
    # come from the driver: /proc/driver/nvidia, else `nvidia-smi -L` (a stand-in here, where
    # this machine has neither)
    import os

    smi = tmp_path / "nvidia-smi"
    smi.write_text('#!/bin/sh\necho "GPU 0: NVIDIA H200 (UUID: a)"; echo "GPU 1: NVIDIA H200"\n')
    smi.chmod(0o755)
    code = (
        "import sys; from autosearch.validation import _validate as V; print(V.nvidia_gpus(),"
        " V.torch_build(), V.available_devices()[0], 'torch' in sys.modules)"
    )
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    if Path("/proc/driver/nvidia/gpus").exists():
        pytest.skip("this machine has NVIDIA GPUs: the stand-in nvidia-smi is not read")
    assert out.stdout.split() == ["2", "cpu", "cpu", "False"]
    assert "has 2 NVIDIA GPU(s) but the installed torch is a CPU-only build" in out.stderr


def test_calibrate_on_gpus_always_measures_compute_on_one():
    logged = []
    assert with_compute_world_size("cuda", [8], logged.append) == [1, 8]
    assert "world size 1 added" in logged[0]
    assert with_compute_world_size("cuda", [1, 8], logged.append) == [1, 8]
    assert with_compute_world_size("cpu", [2], logged.append) == [2] and len(logged) == 1


@pytest.mark.parametrize(
    "message, oom",
    [
        ("CUDA error: out of memory", True),
        ("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`", True),
        ("cuDNN error: CUDNN_STATUS_ALLOC_FAILED", True),
        (
            "NCCL error: unhandled cuda error, Cuda failure 'out of memory'",
            True,
        ),
        ("NCCL error in: ProcessGroupNCCL.cpp, remote process exited", False),
        ("CUDA error: an illegal memory access was encountered", False),
    ],
)
def test_cuda_allocation_failures_outside_the_allocator_are_oom(message, oom):
    from autosearch.validation.worker import is_out_of_memory

    assert is_out_of_memory(RuntimeError(message)) is oom


def test_an_oom_that_leaves_peers_waiting_until_the_timeout_is_an_oom():
    from autosearch.validation._launch import classify

    ranks = [
        {"rank": 0, "status": "oom", "error_type": "OutOfMemoryError", "message": "CUDA"},
        {"rank": 1, "status": "stopped"},
    ]
    outcome = classify(None, ranks, nproc=2, timed_out=True, timeout_s=600)
    assert outcome.status == "oom" and "rank 0: out of memory" in outcome.reason
    assert classify(None, ranks[1:], nproc=2, timed_out=True, timeout_s=600).status == "timeout"


def test_strategies_the_engine_cannot_run_are_rows_not_launches(tmp_path):
    from autosearch.validation import validate

    # async TP runs on CUDA only: on this CPU the row says so and nothing starts
    s = Strategy(tp=2, micro_batch_size=2, global_batch_size=4, compile=True, async_tp=True)
    row = validate(SPEC, [s], steps=1, out=tmp_path, verbose=False).table.iloc[0]
    assert row.status == "invalid" and "async_tp cannot run on this device (cpu" in row.reason
    assert not list(tmp_path.glob("run*"))  # nothing was started
