"""A quick calibration of this machine (CPU, gloo, world sizes 1 and 2) writes a profile that
loads, says what it measured and how well each fit held, and that the cost model and the CLI
can use.

No timing is asserted: the CPU is shared and its numbers vary; only structure and loadability are.
For the same reason the calibration is run with --accept-untrusted: on a loaded machine its quality
checks fail (tests/test_calibration_quality.py tests them), and the profile must still be written
and usable by the cost model."""

import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from autosearch import Cluster
from autosearch.cli import main
from autosearch.core.model_spec import ModelSpec
from autosearch.core.strategy import Strategy
from cost_models import AnalyticCostModel, HardwareProfile
from cost_models.calibration import quality_problems


@pytest.fixture(scope="module")
def quick_profile(tmp_path_factory):
    out = tmp_path_factory.mktemp("calibration") / "cpu-quick.yaml"
    code = main(
        [
            "calibrate",
            "--device",
            "cpu",
            "--world-sizes",
            "1,2",
            "--quick",
            "--accept-untrusted",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    return out


@pytest.mark.slow
def test_quick_calibration_writes_a_loadable_profile(quick_profile):
    prof = HardwareProfile.load(str(quick_profile))
    assert prof.device_type == "cpu" and prof.gpus_per_node == 2
    assert set(prof.peak_flops) == {"fp32", "bf16", "fp16"}
    for field in (
        "peak_flops",
        "gemm.max_efficiency",
        "gemm.half_dim",
        "memory_bandwidth_bytes_per_s",
        "attention_efficiency",
        "intra_node.latency_s",
        "intra_node.bandwidth_bytes_per_s",
        "kernel_launch_s",
    ):
        assert field in prof.measured
    assert "inter_node" in prof.defaults_used()  # one node: never measured, and said so
    assert "inter_node" in prof.calibration["defaults"]
    fits = prof.calibration["fits"]
    for name in ("gemm", "memory", "intra_node"):
        q = fits[name]["quality"]
        assert {"r2_log", "worst_rel_residual", "median_rel_residual", "n_points"} <= set(q)
    machine = prof.calibration["machine"]
    assert (
        machine["torch"]
        and machine["device_name"]
        and machine["date"]
        and machine["world_sizes"] == [1, 2]
    )
    assert prof.calibration["threads_per_process"] == 1 and "peak_definition" in prof.calibration
    assert max(prof.gemm.max_efficiency.values()) == pytest.approx(
        1.0
    )  # peak = best measured precision
    # The verdict of the checks is in the profile, and the load they saw is in the CSV.
    quality = prof.calibration["quality"]
    assert {"ok", "problems", "warnings", "checks"} <= set(quality)
    assert quality["ok"] == (quality_problems(prof) == [])
    assert "load" in quality["checks"] and "precision_slowdown" in quality["checks"]

    # The raw measurements and the single-process variant sit next to it.
    raw = pd.read_csv(quick_profile.with_suffix(".csv"))
    assert {"kind", "op", "world_size", "time_s", "time_min_s", "time_cv"} <= set(raw.columns)
    assert raw["load_other_cores"].notna().all() and (raw["load_other_cores"] >= 0).all()
    assert set(raw["kind"]) >= {"gemm", "memory", "attention", "collective", "launch"}
    assert set(raw.loc[raw["kind"] == "collective", "op"]) == {
        "all_reduce",
        "all_gather",
        "reduce_scatter",
        "send_recv",
    }
    single = HardwareProfile.load(str(quick_profile.parent / "cpu-quick-np1.yaml"))
    assert single.gpus_per_node == 1 and single.calibration["threads_per_process"] >= 1


@pytest.mark.slow
def test_the_cost_model_and_cli_use_the_calibrated_profile(quick_profile, capsys):
    cluster = Cluster(gpu=str(quick_profile), gpus_per_node=2)
    model = ModelSpec.load("tiny-gpt")
    cm = AnalyticCostModel(model, cluster)
    for text in (
        "dp=2,micro_batch_size=4,global_batch_size=8,amp=fp32",
        "tp=2,micro_batch_size=8,global_batch_size=8,amp=bf16",
        "pp=2,micro_batch_size=2,global_batch_size=8,amp=fp32",
    ):
        report = cm.estimate(Strategy.parse(text))
        assert report.step_time_s > 0 and report.fits
    assert Cluster.parse(f"{quick_profile}:1x2").world_size == 2
    code = main(
        [
            "estimate",
            "--model",
            "tiny-gpt",
            "--cluster",
            f"{quick_profile}:1x2",
            "--strategy",
            "dp=2,micro_batch_size=4,global_batch_size=8,amp=fp32",
        ]
    )
    out = capsys.readouterr().out
    assert (
        code == 0 and "step time" in out and "inter_node" in out
    )  # the default it relies on is named


def test_calibrate_user_errors_exit_2(tmp_path, capsys):
    assert main(["calibrate", "--device", "cpu", "--out", str(tmp_path / "x.txt")]) == 2
    assert "must be a .yaml file" in capsys.readouterr().err
    assert main(["calibrate", "--world-sizes", "0,2", "--out", str(tmp_path / "x.yaml")]) == 2
    assert "--world-sizes: world sizes must be integers >= 1, got '0,2'" in capsys.readouterr().err
    assert main(["calibrate", "--device", "cpu"]) == 2
    assert "calibrate needs --out" in capsys.readouterr().err


def test_import_cost_models_does_not_import_torch():
    """cost_models holds no torch code at all (its calibration half is the fitting); the
    torch side, autosearch.calibration, imports torch only where it measures."""
    code = (
        "import sys, cost_models, cost_models.calibration, autosearch.calibration; "
        "from cost_models.calibration import build_profile, refit_corrections; "
        "from autosearch.calibration import calibrate, make_plan; "
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
    root = Path(__file__).resolve().parents[1]
    torch_files = [
        str(p.relative_to(root))
        for p in (root / "cost_models").rglob("*.py")
        if re.search(r"^\s*(import torch|from torch\b)", p.read_text(), re.MULTILINE)
    ]
    assert torch_files == []


def test_calibrate_reads_the_load_first_and_records_the_machine(tmp_path, monkeypatch):
    """Before measuring, calibrate reads the load (a loaded machine is warned about, not
    refused) and records it; the profile records the machine it measured (CPU model, cores,
    ISA flags) and its header names it. The measurements are the example's, so nothing runs."""
    from autosearch.calibration import _calibrate
    from cost_models.calibration.machine import Load, recorded_machine, this_cpu

    root = Path(__file__).resolve().parents[1]
    example = pd.read_csv(root / "results" / "calibration" / "example-amd-epyc-2c.csv")
    monkeypatch.setattr(_calibrate, "run_microbenchmarks", lambda *a, **k: example)
    monkeypatch.setattr(_calibrate, "read_load", lambda: Load(cores=2, other_cores=1.5))
    lines: list[str] = []
    out = tmp_path / "cpu.yaml"
    result = _calibrate.calibrate(
        device="cpu", world_sizes=[1, 2], out=str(out), accept_untrusted=True, log=lines.append
    )
    text = "\n".join(lines)
    assert "before measuring, other processes keep 1.5 of 2 cores busy" in text
    assert "WARNING other processes keep 1.5 of 2 cores busy" in text
    machine = result.profile.calibration["machine"]
    assert machine["other_busy_cores_at_start"] == 1.5
    assert recorded_machine(result.profile.calibration, "cpu") == this_cpu()
    assert f"# Machine: {this_cpu().describe()}" in out.read_text().splitlines()[1]


def test_calibrate_takes_a_config_file_of_its_flags(tmp_path, capsys):
    """`autosearch calibrate --config FILE.yaml`: the flags' names as keys (CalibrateConfig),
    a flag given next to it overriding the file; here a refit of the example's measurements."""
    import shutil

    import yaml

    root = Path(__file__).resolve().parents[1] / "results" / "calibration"
    for ext in ("csv", "yaml"):
        shutil.copy(root / f"example-amd-epyc-2c.{ext}", tmp_path / f"example.{ext}")
    config = tmp_path / "calibrate.yaml"
    config.write_text(
        yaml.safe_dump({"from-csv": str(tmp_path / "example.csv"), "out": "unused.yaml"})
    )
    out = tmp_path / "refit.yaml"
    assert main(["calibrate", "--config", str(config), "--out", str(out)]) == 0
    assert (
        HardwareProfile.load(str(out)).name == "refit" and not (tmp_path / "unused.yaml").exists()
    )
    config.write_text(yaml.safe_dump({"out": str(out), "world_sizes": "1,x"}))
    assert main(["calibrate", "--config", str(config)]) == 2
    assert "is not a comma-separated list of integers" in capsys.readouterr().err


def test_the_machine_a_profile_records_is_compared_with_this_one():
    """A CPU profile is this machine's when its CPU model, cores and the ISA flags that bound
    its matmul rate agree (flags a profile did not record are not compared); a GPU profile when
    the GPU name and count agree."""
    from cost_models.calibration.machine import Machine, recorded_machine

    epyc = {"machine": {"host_cpu": "AMD EPYC", "cpu_cores": 2, "cpu_capability": "AVX2"}}
    xeon = Machine(device="cpu", name="Intel(R) Xeon(R) Processor", count=2, isa=("avx2",))
    old = recorded_machine(epyc, "cpu")
    assert old == Machine(device="cpu", name="AMD EPYC", count=2, isa=None)
    assert old.describe() == "AMD EPYC (cpu, 2 cores, ISA flags not recorded)"
    assert old.differences(xeon) == ["'AMD EPYC' against 'Intel(R) Xeon(R) Processor'"]
    assert old.slug() == "amd-epyc-2c" and xeon.slug() == "intel-xeon-processor-2c"
    same_name = Machine(device="cpu", name="AMD  EPYC", count=2, isa=("avx2", "avx512f"))
    assert old.differences(same_name) == []  # no flags recorded: model and cores decide
    assert same_name.differences(Machine(device="cpu", name="AMD EPYC", count=2, isa=("avx2",)))
    assert same_name.differences(Machine(device="cpu", name="AMD EPYC", count=4, isa=None)) == [
        "2 cores against 4"
    ]
    gpus = {"machine": {"device_name": "NVIDIA H100 80GB HBM3", "device_count": 8}}
    h100 = recorded_machine(gpus, "cuda")
    assert h100 == Machine(device="cuda", name="NVIDIA H100 80GB HBM3", count=8)
    assert h100.differences(Machine(device="cuda", name="NVIDIA H100 80GB HBM3", count=4))
    assert h100.slug() == "nvidia-h100-80gb-hbm3-x8" and "8 GPUs" in h100.describe()
    assert recorded_machine({}, "cpu") is None  # a datasheet profile records no machine
