"""`TuneConfig`: one schema for a tuning job (issue 17 item 2).

`tune(config)` from Python and `autosearch tune` leave the same folder; the CLI's flags are the
schema's fields; study.yaml reads back into the TuneConfig that ran; a wrong key or type is
refused with the key named; `Cluster.parse` has a strict and a lenient mode.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import os

import pytest
import yaml

from autosearch import Cluster, SpecError, TuneConfig, tune
from autosearch.cli import build_parser, main
from autosearch.core.schema import flag_of

# A small job that runs in a few seconds: 6 random trials with a fixed seed are the same trials
# in every process, so two runs of it can be compared file by file.
SETTINGS = dict(
    model="tiny-gpt",
    cluster="h100-sxm:1x8",
    global_batch_size=64,
    n_trials=6,
    sampler="random",
    seed=3,
    pin={"tp": [1, 2]},
)
ARGV = ["tune", "--model", "tiny-gpt", "--cluster", "h100-sxm:1x8", "--global-batch-size", "64"]
ARGV += ["--n-trials", "6", "--sampler", "random", "--seed", "3", "--pin", "tp=1,2", "--quiet"]
# What legitimately differs between two runs of the same job: wall times, the worker's id, and
# where the folder is.
TIMES = ("timings_s",)


def _rows(path) -> list[dict]:
    with open(path, newline="") as f:
        return [{k: v for k, v in r.items() if k != "worker"} for r in csv.DictReader(f)]


def _study(path, folder) -> dict:
    doc = yaml.safe_load(open(path))
    for key in TIMES:
        doc.pop(key)
    doc["storage"] = doc["storage"].replace(str(folder), "OUT")
    doc["config"]["out"] = doc["config"]["out"].replace(str(folder), "OUT")
    return doc


def test_tune_config_from_python_and_the_cli_leave_the_same_folder(tmp_path, capsys):
    py, cli = tmp_path / "py", tmp_path / "cli"
    result = tune(TuneConfig(**SETTINGS, out=str(py)))
    # --plan-only: without it the CLI also searches each other framework's own pick and writes
    # it into that framework's files (commands/tune.py framework_lines)
    assert main([*ARGV, "--out", str(cli), "--plan-only"]) == 0
    capsys.readouterr()
    names = sorted(os.listdir(py))
    assert names == sorted(os.listdir(cli))
    assert {"trials.csv", "top_k.csv", "best_strategy.yaml", "report.md", "study.yaml"} <= set(
        names
    )
    assert {"megatron.sh", "ds_config.json", "deepspeed_launch.sh", "torchtitan.toml"} <= set(
        names
    )  # the runtime exports, which only the CLI wrote before
    for name in ("trials.csv", "top_k.csv"):
        assert _rows(py / name) == _rows(cli / name) and len(_rows(py / "trials.csv")) == 6
    for name in ("best_strategy.yaml", "ds_config.json", "torchtitan.toml", "megatron.sh"):
        assert (py / name).read_text() == (cli / name).read_text(), name
    assert _study(py / "study.yaml", py) == _study(cli / "study.yaml", cli)
    # the config block is the TuneConfig that ran (names resolved, paths absolute)
    assert TuneConfig.from_dict(yaml.safe_load((py / "study.yaml").read_text())) == result.config
    assert result.config.out == str(py) and result.config.study_name == (
        "tiny-gpt_h100-sxm-1x8_gbs64_throughput"
    )


def test_the_cli_flags_are_the_schema_fields():
    tune_parser = next(
        a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)
    ).choices["tune"]
    flags = {a.option_strings[-1]: a.dest for a in tune_parser._actions if a.option_strings}
    schema = {flag_of(f): f.name for f in dataclasses.fields(TuneConfig)}
    presentation = {"--quiet": "quiet", "--dry-run": "dry_run", "--plan-only": "plan_only"}
    presentation["--config"] = "config"
    assert flags == {**schema, **presentation, "--help": "help"}
    # every flag keeps the spelling it had before the schema
    assert {"--nnodes", "--gpus-per-node", "--price-per-gpu-hour", "--no-recipes"} <= set(flags)


def test_study_yaml_round_trips_into_the_same_tune_config(tmp_path):
    model = tmp_path / "m.yaml"
    model.write_text("n_layers: 4\nhidden_size: 256\nn_heads: 4\nvocab_size: 1000\nseq_len: 64\n")
    config = TuneConfig(
        model=str(model),
        cluster="h100-sxm",
        nnodes=2,
        gpus_per_node=4,
        global_batch_size=32,
        n_trials=4,
        sampler="random",
        seed=7,
        pin={"pp": [1, 2]},
        use_recipes=False,
        price_per_gpu_hour=2.5,
        out=str(tmp_path / "run"),
    )
    assert TuneConfig.from_dict(config.to_dict()) == config
    result = tune(config)
    doc = yaml.safe_load((tmp_path / "run" / "study.yaml").read_text())
    again = TuneConfig.from_dict(doc)
    assert again == result.config and again.to_dict() == doc["config"]
    assert again.model["n_layers"] == 4 and again.cluster == "h100-sxm:2x4"  # nothing to go stale
    assert (again.nnodes, again.gpus_per_node, again.use_recipes) == (None, None, False)
    # ... and runs the same search again (into another folder: the same trials)
    other = tune(again.replace(out=str(tmp_path / "again")))
    assert _rows(tmp_path / "again" / "trials.csv") == _rows(tmp_path / "run" / "trials.csv")
    assert other.best_strategy == result.best_strategy


def test_a_study_yaml_written_before_the_config_block_still_loads():
    old = {  # the fields a study.yaml of the Python API recorded, before it had `config`
        "signature": "abc",
        "objective": "throughput",
        "trial_unit": "layout",
        "runtime": "torch",
        "model": "tiny-gpt",
        "cluster": "h100-sxm:1x8",
        "global_batch_size": 64,
        "model_spec": {"name": "tiny-gpt", "n_layers": 2, "hidden_size": 64, "n_heads": 2},
        "cluster_spec": {"gpu": "h100-sxm", "n_nodes": 1, "gpus_per_node": 8},
        "study_name": "s",
        "sampler": "tpe",
        "seed": 1,
        "n_trials_target": 40,
    }
    config = TuneConfig.from_dict(old)
    assert (config.global_batch_size, config.n_trials, config.seed, config.study_name) == (
        64,
        40,
        1,
        "s",
    )
    assert config.cluster == old["cluster_spec"] and config.model == old["model_spec"]
    # the old flag name of the recipes switch is read too
    assert TuneConfig.from_dict({**SETTINGS, "no_recipes": True}).use_recipes is False


@pytest.mark.parametrize(
    "data, words",
    [
        ({"batch": 64}, ["'batch'", "global_batch_size"]),
        ({"n_trials": "many"}, ["n_trials", "'many'", "not an integer"]),
        ({"n_trials": 0}, ["n_trials", ">= 1"]),
        ({"n_trials": True}, ["n_trials", "True"]),
        ({"top_k": 2.5}, ["top_k", "2.5"]),
        ({"seed": -1}, ["seed", ">= 0"]),
        ({"seed": 2**32}, ["seed", "limit"]),
        ({"sampler": "cmaes"}, ["sampler", "cmaes", "tpe"]),
        ({"objective": "speed"}, ["objective", "speed"]),
        ({"price_per_gpu_hour": float("nan")}, ["price_per_gpu_hour", "nan"]),
        ({"model": ["a", "b"]}, ["model", "single value"]),
        ({"use_recipes": "no"}, ["use_recipes", "true or false"]),
        ({"pin": ["tp=1", "tp=2"]}, ["tp", "pinned twice", "--pin tp=1,2"]),
        ({"pin": ["tp"]}, ["'tp'", "KEY=VALUE"]),
        ({"study_name": "../x"}, ["study name", "'../x'"]),
        ({"global_batch_size": 2**40}, ["global_batch_size", "limit"]),
    ],
)
def test_bad_keys_and_types_are_refused_with_the_key_named(data, words):
    with pytest.raises(SpecError) as info:
        TuneConfig.from_dict({**SETTINGS, **data}, what="c.yaml")
    message = str(info.value)
    assert all(w in message for w in ["c.yaml", *words]), message
    key = next(iter(data))
    if key != "batch":  # the same value from Python: the same refusal, naming the field
        with pytest.raises(SpecError, match=key if key != "pin" else "pinned|KEY=VALUE"):
            TuneConfig(**{**SETTINGS, **data})


def test_a_config_misses_nothing_required_and_tune_takes_one_form():
    with pytest.raises(SpecError, match="missing key.*global_batch_size"):
        TuneConfig.from_dict({"model": "tiny-gpt", "cluster": "h100-sxm:1x8"})
    with pytest.raises(SpecError, match="not also seed"):
        tune(TuneConfig(**SETTINGS), seed=1)
    with pytest.raises(TypeError, match="tune takes model, cluster and"):
        tune(**SETTINGS, n_trial=3)


def test_cli_flags_override_the_config_file_and_pins_merge(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({**SETTINGS, "pin": {"tp": [1, 2], "zero_stage": [0]}}))
    out = tmp_path / "o"
    argv = ["tune", "--config", str(config), "--pin", "tp=1", "--seed", "4", "--quiet"]
    assert main([*argv, "--out", str(out)]) == 0
    capsys.readouterr()
    recorded = TuneConfig.from_dict(yaml.safe_load((out / "study.yaml").read_text()))
    assert recorded.pin == {"tp": 1, "zero_stage": [0]} and recorded.seed == 4
    assert {r["tp"] for r in _rows(out / "trials.csv")} == {"1"}


def test_cluster_parse_strict_and_lenient(capsys):
    assert Cluster.parse("a100-sxm4-40gb").world_size == 8  # lenient: the profile's node
    with pytest.raises(SpecError, match="does not say how many nodes"):
        Cluster.parse("a100-sxm4-40gb", strict=True)
    both = Cluster.parse("h100-sxm", strict=True, nnodes=2, gpus_per_node=4)
    assert (
        both
        == Cluster.parse("h100-sxm:2x4")
        == Cluster.parse({"gpu": "h100-sxm", "n_nodes": 2, "gpus_per_node": 4})
    )
    assert Cluster.parse("h100:2x4", strict=True) == both
    assert "read as the 'h100-sxm' profile" in capsys.readouterr().err
    for text in ("h100-sxm:8", "h100-sxm:8x8x8"):
        with pytest.raises(SpecError, match="h100-sxm:8"):
            Cluster.parse(text)
    with pytest.raises(SpecError, match="--cluster .*gpus_per_node"):
        Cluster.parse({"gpu": "h100-sxm"}, strict=True, what="--cluster")
    with pytest.raises(SpecError, match="go together"):
        Cluster.parse("h100-sxm", nnodes=2)
    # tune reads a cluster text strictly: the devices per node are never guessed
    with pytest.raises(SpecError, match="does not say how many nodes"):
        tune(**{**SETTINGS, "cluster": "h100-sxm"})
