"""The CLI: readable output, JSON, and one clear message with exit status 2 for every bad input."""

import argparse
import csv
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import yaml

from autosearch.cli import build_parser, main

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
        "offload_s",
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
            ["--model", "llama3-8b", "--cluster", "l40s:1x8", "--strategy", "dp=8"],
            "unknown GPU 'l40s'",
        ),
        (
            [
                "--model",
                "llama3-8b",
                "--cluster",
                "h100-sxm:1x8",
                "--strategy",
                "dp=4,global_batch_size=8",
            ],
            "but the cluster has 8 devices",
        ),
        (
            [
                "--model",
                "llama3-8b",
                "--cluster",
                "h100-sxm:1x8",
                "--strategy",
                "dp=-8,global_batch_size=8",
            ],
            "dp must be >= 1, got -8",
        ),
        (
            [
                "--model",
                "llama3-8b",
                "--cluster",
                "h100-sxm:1x8",
                "--strategy",
                "dp=8,amp=int4,global_batch_size=8",
            ],
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


def test_cluster_forms_agree(capsys):
    """GPU:NODESxGPUS, --nnodes/--gpus-per-node and a cluster YAML name the same cluster; the
    short name h100 is read as h100-sxm with a note."""
    # a strategy that fits (estimate exits 1 for one that does not)
    strategy = ["--strategy", "dp=16,zero_stage=3,recompute=full", "--global-batch-size", "64"]
    strategy.append("--json")
    outs = []
    for cluster in (
        ["--cluster", "h100-sxm:2x8"],
        ["--cluster", "h100-sxm", "--nnodes", "2", "--gpus-per-node", "8"],
        ["--cluster", "h100:2x8"],
    ):
        code, out, err = run(capsys, "estimate", "--model", "llama3-8b", *cluster, *strategy)
        assert code == 0
        assert ("read as the 'h100-sxm' profile" in err) == (cluster[1] == "h100:2x8")
        outs.append(json.loads(out))
    assert outs[0] == outs[1] == outs[2]
    assert outs[0]["cluster"] == "h100-sxm:2x8" and outs[0]["strategy"]["global_batch_size"] == 64


def test_estimate_global_batch_flag_equals_the_strategy_field(capsys):
    base = ["estimate", "--model", "llama3-8b", "--cluster", "h100-sxm:1x8", "--json"]
    fits = "dp=8,zero_stage=3,recompute=full"  # (estimate exits 1 for one that does not fit)
    code1, out1, _ = run(capsys, *base, "--strategy", f"{fits},global_batch_size=256")
    code2, out2, _ = run(capsys, *base, "--strategy", fits, "--global-batch-size", "256")
    assert code1 == code2 == 0 and json.loads(out1) == json.loads(out2)
    assert json.loads(out1)["report"]["samples_per_s"] > 0


def test_tune_refuses_an_out_folder_holding_another_study(capsys, tmp_path):
    """Issue 11 item 9: a second study into the same --out is refused; the first one's outputs
    stay as they were, and the same command as the first resumes it."""
    out = str(tmp_path / "o")
    first = ["tune", "--model", "tiny-gpt", "--cluster", "h100-sxm:1x8", "--global-batch-size"]
    first += ["64", "--n-trials", "3", "--quiet", "--out", out]
    assert run(capsys, *first)[0] == 0
    before = {p.name: p.read_bytes() for p in (tmp_path / "o").iterdir() if p.is_file()}
    second = [a if a != "tiny-gpt" else "tiny-llama" for a in first]
    code, _, err = run(capsys, *second)
    assert code == 2 and "holds the outputs of study" in err and "another study" in err
    assert "tiny-gpt" in err
    after = {p.name: p.read_bytes() for p in (tmp_path / "o").iterdir() if p.is_file()}
    assert after == before
    code, out_text, _ = run(capsys, *first)
    assert code == 0 and "nothing new to run" in out_text


DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


def _trials(folder) -> list[tuple]:
    """(trial, strategy, tokens/s) of every trial in trials.csv: what the search did."""
    with open(os.path.join(folder, "trials.csv"), newline="") as f:
        return [(r["trial"], r["strategy"], r["tokens_per_s"]) for r in csv.DictReader(f)]


def test_version(capsys):
    from autosearch import __version__

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"autosearch {__version__}"


# Flags of subcommands other helpers own that had no help when this test was written; the test
# passes once they gain it (a subset), and fails for any new flag without help.
KNOWN_WITHOUT_HELP = {("validate", "--top-k")}


def test_every_flag_has_help():
    parser = build_parser()
    missing = set()
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert len(subs) == 1
    for action in parser._actions:
        if action.option_strings and not action.help:
            missing.add(("autosearch", action.option_strings[-1]))
    for name, sub in subs[0].choices.items():
        assert sub.description or sub.format_help(), name
        for action in sub._actions:
            if action.option_strings and (not action.help or action.help == argparse.SUPPRESS):
                missing.add((name, action.option_strings[-1]))
    assert missing <= KNOWN_WITHOUT_HELP, sorted(missing - KNOWN_WITHOUT_HELP)
    assert {"estimate", "tune", "sweep", "export", "models", "hardware"} <= set(subs[0].choices)


def test_tune_config_file_is_the_same_as_its_flags(capsys, tmp_path):
    """Issue 11 item 5: --config takes the flags' keys; the same search from flags and from
    the file runs the same trials; a flag given next to --config overrides the file."""
    config = os.path.join(DATA, "tune_config.yaml")
    a, b, c = (str(tmp_path / x) for x in "abc")
    assert run(capsys, "tune", "--config", config, "--out", a)[0] == 0
    flags = ["tune", "--model", "tiny-gpt", "--cluster", "h100-sxm:1x8", "--quiet"]
    flags += ["--global-batch-size", "64", "--n-trials", "6", "--sampler", "tpe", "--seed", "0"]
    flags += ["--pin", "tp=1,2", "--pin", "zero_stage=0,1", "--out", b]
    assert run(capsys, *flags)[0] == 0
    assert _trials(a) == _trials(b) and len(_trials(a)) == 6
    assert {s.split("-")[1] for _, s, _ in _trials(a)} <= {"tp1", "tp2"}
    code, _, _ = run(capsys, "tune", "--config", config, "--out", c, "--n-trials", "3")
    assert code == 0 and len(_trials(c)) == 3 and _trials(c) == _trials(a)[:3]


def test_study_yaml_reproduces_the_run(capsys, tmp_path):
    """The study.yaml a run writes, given to --config, runs the same search (into another
    --out here: the same trials; into its own folder: the finished study, nothing new)."""
    model = tmp_path / "m.yaml"
    model.write_text("n_layers: 4\nhidden_size: 256\nn_heads: 4\nvocab_size: 1000\nseq_len: 64\n")
    first = str(tmp_path / "first")
    argv = ["tune", "--model", str(model), "--cluster", "h100-sxm", "--nnodes", "2"]
    argv += ["--gpus-per-node", "4", "--global-batch-size", "32", "--n-trials", "5"]
    argv += ["--sampler", "random", "--seed", "7", "--pin", "pp=1,2", "--quiet", "--out", first]
    assert run(capsys, *argv)[0] == 0
    study = os.path.join(first, "study.yaml")
    with open(study) as f:
        record = yaml.safe_load(f)["config"]
    assert record["model"]["n_layers"] == 4  # the model file written out: no path to go stale
    assert record["cluster"] == "h100-sxm:2x4" and record["pin"] == {"pp": [1, 2]}
    again = str(tmp_path / "again")
    assert run(capsys, "tune", "--config", study, "--out", again)[0] == 0
    assert _trials(again) == _trials(first)
    code, out, _ = run(capsys, "tune", "--config", study)
    assert code == 0 and "nothing new to run" in out


def test_tune_dry_run_prints_the_space_and_writes_nothing(capsys, tmp_path, monkeypatch):
    from search_spaces import SearchSpace

    monkeypatch.chdir(tmp_path)
    code, out, _ = run(
        capsys,
        "tune",
        "--model",
        "llama3-8b",
        "--cluster",
        "h100-sxm:4x8",
        "--global-batch-size",
        "256",
        "--n-trials",
        "50",
        "--dry-run",
    )
    space = SearchSpace("llama3-8b", "h100-sxm:4x8", global_batch_size=256)
    assert code == 0 and "dry run: nothing is searched or written" in out
    assert f"{space.size:,} strategies" in out
    assert f"layouts    {space.n_groups} " in out
    # --n-trials is the study's count, the local search's trials included (plan_search)
    assert "50 layouts: 12 with the tpe sampler, the rest a local search" in out
    assert "(50 to run" in out
    expected = re.search(r"expected   about ([\d,.]+) s of search for 50 trials", out)
    assert expected and float(expected.group(1).replace(",", "")) > 0
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("delay_s", [0.0, 0.3, 1.0, 2.5])
def test_ctrl_c_at_any_point_is_one_line_and_status_130(tmp_path, delay_s):
    """Issue 13 item 16: Ctrl-C while the study opens or inside a TPE trial (where Optuna logs
    the trial's traceback) ends in "interrupted", status 130, no traceback. The delay counts
    from the line tune prints before the search (a Ctrl-C while Python itself imports the
    `autosearch` package, before any of its code runs, is Python's to report)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "autosearch", "tune", "--model", "llama3-70b"]
        + ["--cluster", "h100-sxm:32x8", "--global-batch-size", "512", "--n-trials", "100000"]
        + ["--sampler", "tpe", "--out", str(tmp_path / "o")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    first = proc.stdout.readline()
    assert first.startswith("searching"), first
    time.sleep(delay_s)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in out + err and "failed with" not in err
    assert err.rstrip().endswith("interrupted")
