"""Checks that need a CUDA GPU (the `cuda` marker: skipped without one). benchmarks/gpu_check.py
runs them first on a GPU machine; on CPU they are collected and skipped."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from autosearch import ModelSpec, Strategy

pytestmark = pytest.mark.cuda
SPEC = ModelSpec.load("tiny-gpt").scaled(n_layers=2, seq_len=128)


def _torch():
    import torch

    return torch


def test_the_engine_trains_on_cuda_0():
    torch = _torch()
    from autosearch import Engine
    from autosearch.engine import SyntheticTokens
    from autosearch.models.transformer import Transformer

    engine = Engine(
        lambda: Transformer(SPEC),
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
        strategy=Strategy(micro_batch_size=2, global_batch_size=4, amp="bf16"),
    )
    history = engine.fit(SyntheticTokens.for_model(SPEC, 16), epochs=1, verbose=0)
    assert engine.device_ == torch.device("cuda", 0)
    assert all(torch.isfinite(torch.tensor(history["loss"])))


def test_a_gloo_group_keeps_tensors_on_cpu():
    """Tests start gloo themselves; their ranks must not land on cuda:r (review I2)."""
    import torch.distributed as dist

    from autosearch.engine import distributed as D

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        assert D.device().type == "cpu"
    finally:
        dist.destroy_process_group()
    assert D.device().type == "cuda"


def test_more_processes_than_gpus_is_one_message(tmp_path):
    torch = _torch()
    n = torch.cuda.device_count() + 1
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import torch
            from autosearch import Engine, ModelSpec, Strategy
            from autosearch.engine.distributed import run_main
            from autosearch.models.transformer import Transformer

            spec = ModelSpec.load("tiny-gpt").scaled(n_layers=2, seq_len=64)

            def main():
                Engine(lambda: Transformer(spec), strategy=Strategy(dp={n}, global_batch_size={n}),
                       optimizer=lambda p: torch.optim.AdamW(p)).prepare()

            run_main(main)
            """
        )
    )
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}"]
        + [str(script)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode != 0
    assert "needs its own GPU" in out.stderr and "invalid device ordinal" not in out.stderr


def test_calibrate_cuda_without_world_size_1(tmp_path):
    """`--world-sizes N` alone measures compute on one GPU too; fp8 GEMMs are benchmarked where
    the GPU has them, and a catalog GPU keeps its fp8 peak, architecture and kernels."""
    torch = _torch()
    from autosearch.calibration import calibrate

    n = torch.cuda.device_count()
    result = calibrate(
        device="cuda",
        world_sizes=[n],
        quick=True,
        out=str(tmp_path / "gpu.yaml"),
        accept_untrusted=True,
    )
    prof, df = result.profile, result.measurements
    assert 1 in set(df["world_size"]) and "gemm.max_efficiency" in prof.measured
    fp8 = df[df["kind"] == "gemm_fp8"]
    if torch.cuda.get_device_capability() >= (8, 9):
        # measured, not skipped (the column is there only when some measurement was skipped)
        assert len(fp8) and "fp8" in prof.peak_flops
        assert "skipped" not in fp8 or fp8["skipped"].isna().any()
    if prof.calibration["machine"]["device_name"] in ("NVIDIA H100 80GB HBM3", "NVIDIA H200"):
        assert prof.architecture == "hopper" and prof.attention_kernels


def test_validate_one_candidate_on_cuda(tmp_path):
    from autosearch.validation import validate

    result = validate(
        SPEC,
        [Strategy(micro_batch_size=2, global_batch_size=4, amp="bf16")],
        cluster="h100-sxm:1x1",
        steps=3,
        warmup=2,
        out=tmp_path,
        verbose=False,
    )
    row = result.table.iloc[0]
    assert row.status == "ok", row.reason
    assert row.device == "cuda" and row.peak_memory_method == "cuda.max_memory_allocated"
    # tensor vs tensor: a tiny model is within a factor of 3, never the reserve's +1000s%
    assert -70 < row.memory_error_pct < 200


def test_cuda_visible_devices_empty_runs_on_cpu():
    code = "from autosearch.engine import distributed as D; print(D.device().type)"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.stdout.strip() == "cpu" and "CPU-only build" not in out.stderr
