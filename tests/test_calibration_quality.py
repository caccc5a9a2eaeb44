"""A calibration checks its own measurements: synthetic measurement sets with a high spread, an
implausible GEMM rate, a loaded machine, an impossible precision ratio or a broken fit are refused
with a message naming the check; a good one passes, and the profile it gives prices bf16 as slow as
it was measured.

The synthetic measurements follow the cost model's own forms (GemmEfficiency.time_s, STREAM, ring
alpha-beta) with the parameters of a 2-core AVX2 CPU at 3 GHz (30 GFLOP/s fp32 per core, bf16 15x
slower without native bf16 instructions, 8 GB/s DRAM, gloo at 200 us and 1 GB/s) and 3%
lognormal noise on each median, the spread of a quiet machine's medians above ~1 ms.
"""

import subprocess
import sys
import time

import numpy as np
import pandas as pd
import pytest
import yaml

from autosearch.calibration.runner import cpu_time_sample, load_between
from autosearch.cli import main
from autosearch.core.hardware import Cluster, GemmEfficiency, HardwareProfile
from autosearch.core.model_spec import ModelSpec
from autosearch.core.strategy import Strategy
from cost_models import AnalyticCostModel
from cost_models.calibration import build_profile, collective_coefficients, quality_problems

MACHINE = {
    "date": "2026-12-03T00:00:00+00:00",
    "host_cpu": "synthetic AVX2 CPU",
    "device_name": "synthetic AVX2 CPU",
    "cpu_cores": 2,
    "cpu_flags": ["avx", "fma", "avx2"],
    "cpu_mhz": 3000.0,
    "cpu_max_mhz": None,
    "memory_total_bytes": 16e9,
    "last_level_cache_bytes": 8 * 2**20,
    "load_average_at_start": [0.2, 0.2, 0.2],
    "load_average_at_end": [2.1, 0.5, 0.3],
    "backend": "gloo",
}
GPU_MACHINE = {
    **MACHINE,
    "device_name": "NVIDIA H100 80GB HBM3",
    "device_count": 8,
    "device_memory_bytes": 85e9,
    "device_l2_cache_bytes": 50e6,
    "last_level_cache_bytes": 50e6,
    "cpu_cores": 16,
    "backend": "nccl",
}
LAUNCH_S = 5e-6


CPU_SHAPES = ((16, 64, 256, 1024), (64, 256, 1024), (64, 256, 1024))


def synthetic(
    *,
    rate_fp32=30e9,
    rate_bf16=2e9,
    cv=0.03,
    load=0.05,
    noise=0.03,
    seed=0,
    device="cpu",
    shapes=CPU_SHAPES,
    half_dim=2.0,
    dram=8e9,
    cache=40e9,
    alpha=200e-6,
    beta=1e9,
    group=2,
) -> pd.DataFrame:
    """Measurement rows as run_microbenchmarks writes them: on a CPU all of world size `group`
    (processes x 1 thread); on a GPU compute on one GPU and collectives over `group`."""
    rng = np.random.default_rng(seed)
    rows = [{"kind": "process_memory", "op": "baseline", "bytes": 2.3e8}]
    rows.append({"kind": "launch", "op": "tiny_add", "time_s": LAUNCH_S, "reps": 2000})
    rates = {"fp32": rate_fp32, "bf16": rate_bf16}
    gemm = GemmEfficiency(max_efficiency=rates, half_dim=half_dim, launch_s=1e-5)
    for p in rates:
        for m in shapes[0]:
            for n in shapes[1]:
                for k in shapes[2]:
                    fwd = gemm.time_s(m, n, k, 1.0, p)
                    for op, t in (("linear_fwd", fwd), ("linear_bwd", 3.0 * fwd)):
                        rows.append(
                            {"kind": "gemm", "op": op, "precision": p, "m": m, "n": n, "k": k}
                            | {"flops": 2.0 * m * n * k, "time_s": t, "reps": 10}
                        )
    llc = (MACHINE if device == "cpu" else GPU_MACHINE)["last_level_cache_bytes"]
    for size in (2**e for e in range(16, 31, 2)):
        bw = cache if 3 * size <= llc else dram
        for op, arrays in (("copy", 2), ("add", 3), ("triad", 3)):
            rows.append(
                {"kind": "memory", "op": op, "precision": "fp32", "array_bytes": size}
                | {"bytes": float(arrays * size), "time_s": LAUNCH_S + arrays * size / bw}
                | {"reps": 10}
            )
    for p, rate in rates.items():  # fused attention at 30% of the GEMM rate
        for b in (1, 4):
            for s in (64, 128, 256, 512):
                flops = 4.0 * b * 8 * s * s * 64 * 0.5
                fwd = LAUNCH_S + flops / (0.3 * rate)
                base = {"kind": "attention", "precision": p, "batch": b, "heads": 8}
                base |= {"seq_len": s, "head_dim": 64, "flops": flops, "reps": 10}
                rows.append(base | {"op": "sdpa_fwd", "time_s": fwd})
                rows.append(base | {"op": "sdpa_bwd", "time_s": 2.3 * fwd})
    compute_ws = group if device == "cpu" else 1
    for r in rows:
        r["world_size"] = compute_ws
    for op, factor in (("all_reduce", 1.0), ("all_gather", 0.6), ("reduce_scatter", 0.4)):
        for size in (4 * 4**i for i in range(12)):
            a, b = collective_coefficients(op, group)
            rows.append(
                {"kind": "collective", "op": op, "group_size": group, "bytes": float(size)}
                | {"time_s": a * alpha + b * size / (beta * factor), "reps": 10}
                | {"world_size": group}
            )
    df = pd.DataFrame(rows)
    timed = df["time_s"].notna()
    df.loc[timed, "time_s"] *= np.exp(rng.normal(0, noise, int(timed.sum())))
    df["time_min_s"] = df["time_s"] * 0.97
    df.loc[timed, "time_cv"] = cv
    df.insert(0, "device", device)
    df["threads"] = 1 if device == "cpu" else None
    df["load_other_cores"], df["load_steal_cores"] = load, 0.0
    df["load_cores"] = float((MACHINE if device == "cpu" else GPU_MACHINE)["cpu_cores"])
    df["skipped"] = None
    return df


def profile_of(df: pd.DataFrame) -> HardwareProfile:
    prof, _ = build_profile(
        df, name="synthetic", machine=dict(MACHINE), compute_world_size=2, gpus_per_node=2
    )
    return prof


def test_a_good_calibration_passes_and_recovers_its_terms():
    prof = profile_of(synthetic())
    assert quality_problems(prof) == []
    q = prof.calibration["quality"]
    assert q["ok"] is True and q["problems"] == []
    # The terms come back (3% noise: the tolerances of tests/test_calibration_fit.py).
    fits = prof.calibration["fits"]
    assert fits["gemm"]["rate_flops"]["fp32"] == pytest.approx(30e9, rel=0.15)
    assert fits["gemm"]["rate_flops"]["bf16"] == pytest.approx(2e9, rel=0.15)
    assert prof.gemm.backward_over_forward == pytest.approx(3.0, rel=0.05)
    assert prof.memory_bandwidth_bytes_per_s == pytest.approx(8e9, rel=0.15)
    assert prof.intra_node.latency_s == pytest.approx(200e-6, rel=0.15)
    assert prof.intra_node.op_factor("reduce_scatter") < prof.intra_node.op_factor("all_reduce")
    assert prof.attention_backward_over_forward == pytest.approx(2.3, rel=0.05)
    # bf16 without native instructions: recorded, warned about, and priced by the profile.
    assert q["checks"]["precision_slowdown"]["bf16"] == pytest.approx(15.0, rel=0.15)
    assert any(w.startswith("precision: bf16") for w in q["warnings"])
    assert prof.gemm.max_efficiency["bf16"] == pytest.approx(1 / 15.0, rel=0.15)


def test_the_profile_keeps_a_search_off_bf16_where_it_is_slow():
    cluster = Cluster(gpu=profile_of(synthetic()), gpus_per_node=2)
    cm = AnalyticCostModel(ModelSpec.load("tiny-gpt"), cluster)
    text = "dp=2,micro_batch_size=4,global_batch_size=8,amp={}"
    fp32 = cm.estimate(Strategy.parse(text.format("fp32"))).step_time_s
    bf16 = cm.estimate(Strategy.parse(text.format("bf16"))).step_time_s
    assert bf16 > 3 * fp32  # GEMMs 15x slower; the memory-bound part is not


@pytest.mark.parametrize(
    "kwargs, check",
    [
        ({"cv": 0.6}, "spread:"),
        ({"rate_fp32": 600e9, "rate_bf16": 40e9}, "plausibility:"),  # ceiling 144 GFLOP/s/core
        ({"rate_fp32": 0.2e9, "rate_bf16": 0.02e9}, "plausibility:"),  # floor 2.9 GFLOP/s/core
        ({"load": 1.2}, "load:"),
        ({"rate_bf16": 60e9}, "precision:"),  # bf16 2x faster than fp32 with no bf16 unit
        ({"noise": 0.8}, "fit:"),
    ],
    ids=["high-spread", "too-fast", "too-slow", "loaded-machine", "bf16-faster", "bad-fit"],
)
def test_a_bad_calibration_is_refused_naming_the_check(kwargs, check):
    prof = profile_of(synthetic(**kwargs))
    problems = quality_problems(prof)
    assert problems and prof.calibration["quality"]["ok"] is False
    assert any(p.startswith(check) for p in problems), problems


GPU = {
    "device": "cuda",
    "rate_fp32": 55e12,  # 0.82 of the H100 datasheet's 66.9 TFLOP/s
    "rate_bf16": 700e12,  # 0.71 of 989.4
    "shapes": ((256, 1024, 4096, 16384), (1024, 4096, 8192), (1024, 4096, 8192)),
    "half_dim": 128.0,
    "dram": 2.9e12,  # 0.87 of 3.35 TB/s
    "cache": 8e12,
    "alpha": 10e-6,
    "beta": 370e9,  # 0.82 of NVLink's 450 GB/s
    "group": 8,
}


def gpu_profile(**overrides) -> HardwareProfile:
    prof, _ = build_profile(
        synthetic(**{**GPU, **overrides}),
        name="h100-synthetic",
        machine=dict(GPU_MACHINE),
        compute_world_size=1,
        gpus_per_node=8,
    )
    return prof


def test_a_gpu_calibration_is_checked_against_its_datasheet():
    good = gpu_profile()
    assert quality_problems(good) == [], good.calibration["quality"]
    assert good.gemm.max_efficiency["bf16"] == pytest.approx(700 / 989.4, rel=0.15)
    link = good.intra_node
    all_reduce = link.achieved_bandwidth_bytes_per_s * link.op_factor("all_reduce")
    assert all_reduce == pytest.approx(370e9, rel=0.15)
    # Above the datasheet peak: refused, and still written as a profile that loads (at the limit).
    fast = gpu_profile(rate_bf16=1.3e15)
    assert any("datasheet" in p for p in quality_problems(fast)), quality_problems(fast)
    assert fast.gemm.max_efficiency["bf16"] == 1.0
    slow = gpu_profile(rate_fp32=0.5e12, rate_bf16=5e12)  # 0.5% of the peak: a shared GPU
    assert any(p.startswith("plausibility:") for p in quality_problems(slow))


def test_profiles_without_a_quality_record():
    data = HardwareProfile.load("h100-sxm").to_dict()
    assert quality_problems(HardwareProfile.from_dict(data)) == []  # a datasheet: nothing measured
    data["calibration"] = {"tool": "autosearch calibrate", "fits": {}}
    (problem,) = quality_problems(HardwareProfile.from_dict(data))
    assert "no quality record" in problem and "--from-csv" in problem


def _write_run(tmp_path, df):
    csv = tmp_path / "run.csv"
    df.to_csv(csv, index=False)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({"calibration": {"machine": MACHINE}}))
    return str(csv)


def test_cli_refuses_an_untrusted_calibration_with_status_3(tmp_path, capsys):
    csv = _write_run(tmp_path, synthetic(load=1.2))
    out = tmp_path / "out" / "cpu.yaml"
    assert main(["calibrate", "--from-csv", csv, "--out", str(out)]) == 3
    captured = capsys.readouterr()
    assert "UNTRUSTED" in captured.out and "PROBLEM load:" in captured.out
    assert "REFUSED" in captured.err
    assert not out.exists()  # nothing under the trusted name ...
    kept = HardwareProfile.load(str(tmp_path / "out" / "cpu.untrusted.yaml"))  # ... nothing lost
    assert (tmp_path / "out" / "cpu.untrusted.csv").exists()
    assert any(p.startswith("load:") for p in quality_problems(kept))

    assert main(["calibrate", "--from-csv", csv, "--out", str(out), "--accept-untrusted"]) == 0
    accepted = HardwareProfile.load(str(out))
    assert accepted.calibration["quality"]["accepted_untrusted"] is True
    assert quality_problems(accepted)  # accepting names the file; the problems stay


def test_cli_writes_a_trusted_calibration(tmp_path, capsys):
    csv = _write_run(tmp_path, synthetic())
    out = tmp_path / "cpu.yaml"
    assert main(["calibrate", "--from-csv", csv, "--out", str(out)]) == 0
    assert "quality   TRUSTED" in capsys.readouterr().out
    assert quality_problems(HardwareProfile.load(str(out))) == []
    assert "# Quality: TRUSTED" in out.read_text()


def test_the_load_meter_sees_another_process():
    """A CPU-bound process that is not ours (not yet reaped) counts as load from others. Bound:
    on the shared 2-core VM the spinner gets at least a third of a core; others only add."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)  # let it start
        before = cpu_time_sample()
        time.sleep(2.0)
        load = load_between(before, cpu_time_sample())
    finally:
        spinner.kill()
        spinner.wait()
    if not load:
        pytest.skip("no /proc/stat on this system")
    assert load["load_other_cores"] > 0.25
    assert load["load_cores"] >= 1
