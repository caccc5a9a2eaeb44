"""The CLI: readable output, JSON, and one clear message with exit status 2 for every bad input."""

import json
import subprocess
import sys

import pytest

from autosearch.cli import main

STRATEGY = "dp=8,tp=8,pp=4,global_batch_size=512,recompute=full,sequence_parallel=true"


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_estimate_table(capsys):
    code, out, err = run(
        capsys,
        "estimate",
        "--model",
        "llama3-70b",
        "--cluster",
        "h100-sxm:32x8",
        "--strategy",
        STRATEGY,
    )
    assert code == 0 and err == ""
    for word in (
        "step time",
        "tokens/s",
        "MFU",
        "fits",
        "bubble",
        "dp_comm_exposed",
        "activations",
        "optimizer",
    ):
        assert word in out


def test_estimate_json_is_the_cost_report(capsys):
    code, out, _ = run(
        capsys,
        "estimate",
        "--model",
        "llama3-70b",
        "--cluster",
        "h100-sxm:32x8",
        "--strategy",
        STRATEGY,
        "--json",
    )
    data = json.loads(out)
    assert code == 0 and data["strategy"]["tp"] == 8
    report = data["report"]
    for key in (
        "step_time_s",
        "tokens_per_s",
        "samples_per_s",
        "model_flops_per_step",
        "tflops_per_gpu",
        "mfu",
        "peak_memory_bytes",
        "memory_capacity_bytes",
        "fits",
    ):
        assert key in report
    assert set(report["time"]) == {
        "compute_s",
        "recompute_s",
        "tp_comm_s",
        "pp_comm_s",
        "dp_comm_exposed_s",
        "bubble_s",
        "optimizer_s",
        "other_s",
    }
    assert set(report["memory"]) == {
        "params_bytes",
        "grads_bytes",
        "optimizer_bytes",
        "activations_bytes",
        "other_bytes",
    }


def test_models_and_hardware_list(capsys):
    assert run(capsys, "models")[0] == 0
    code, out, _ = run(capsys, "hardware")
    assert code == 0 and "h200-sxm" in out and "a100-sxm4-80gb" in out


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["--model", "gpt-99", "--cluster", "h100-sxm:1x8", "--strategy", "dp=8"],
            "unknown model 'gpt-99'",
        ),
        (
            ["--model", "llama3-8b", "--cluster", "b300:1x8", "--strategy", "dp=8"],
            "unknown GPU 'b300'",
        ),
        (
            ["--model", "llama3-8b", "--cluster", "h100-sxm:1x8", "--strategy", "dp=4"],
            "but the cluster has 8 devices",
        ),
        (
            ["--model", "llama3-8b", "--cluster", "h100-sxm:1x8", "--strategy", "dp=-8"],
            "dp must be >= 1, got -8",
        ),
        (
            ["--model", "llama3-8b", "--cluster", "h100-sxm:1x8", "--strategy", "dp=8,amp=int4"],
            "amp must be one of",
        ),
    ],
)
def test_bad_input_is_one_message_and_exit_2(capsys, args, message):
    code, out, err = run(capsys, "estimate", *args)
    assert code == 2
    assert message in err and "Traceback" not in err and err.count("\n") <= 3


def test_malformed_and_incomplete_files(capsys, tmp_path):
    bad_yaml = tmp_path / "strategy.yaml"
    bad_yaml.write_text("dp: 8\ntp: [2\n")
    code, _, err = run(
        capsys,
        "estimate",
        "--model",
        "llama3-8b",
        "--cluster",
        "h100-sxm:1x8",
        "--strategy",
        str(bad_yaml),
    )
    assert code == 2 and "not valid YAML at line" in err
    model = tmp_path / "model.yaml"
    model.write_text("n_layers: 4\nhidden_size: 256\n")
    code, _, err = run(
        capsys,
        "estimate",
        "--model",
        str(model),
        "--cluster",
        "h100-sxm:1x8",
        "--strategy",
        "dp=8",
    )
    assert code == 2 and "missing required key(s) n_heads, vocab_size, seq_len" in err
    negative = tmp_path / "neg.yaml"
    negative.write_text(
        "n_layers: -4\nhidden_size: 256\nn_heads: 4\nvocab_size: 100\nseq_len: 64\n"
    )
    code, _, err = run(
        capsys,
        "estimate",
        "--model",
        str(negative),
        "--cluster",
        "h100-sxm:1x8",
        "--strategy",
        "dp=8",
    )
    assert code == 2 and "n_layers must be >= 1, got -4" in err


def test_console_script_exit_code():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "autosearch",
            "estimate",
            "--model",
            "nope",
            "--cluster",
            "h100-sxm:1x8",
            "--strategy",
            "dp=8",
        ],
        capture_output=True,
        text=True,
    )
    assert (
        proc.returncode == 2
        and "unknown model 'nope'" in proc.stderr
        and "Traceback" not in proc.stderr
    )
