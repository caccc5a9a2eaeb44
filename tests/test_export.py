"""Exporters: one contract suite that every exporter passes, then a few runtime specifics."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import tomllib

from autosearch import ModelSpec, SpecError, Strategy
from autosearch.export import EXPORTERS, export
from autosearch.export._base import strategy_fields

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ModelSpec.load("llama3-70b")
STRATEGIES = [
    Strategy(dp=64, global_batch_size=512),
    Strategy(dp=64, global_batch_size=512, zero_stage=3, recompute="full", amp="bf16"),
    Strategy(
        dp=8,
        tp=8,
        pp=4,
        micro_batch_size=2,
        global_batch_size=512,
        recompute="selective",
        sequence_parallel=True,
        zero_stage=1,
    ),
    Strategy(
        dp=4,
        tp=8,
        pp=8,
        micro_batch_size=1,
        global_batch_size=512,
        pipeline_schedule="interleaved_1f1b",
        virtual_stages=5,
        amp="fp16",
        zero_stage=2,
    ),
    Strategy(
        dp=16,
        tp=4,
        pp=4,
        micro_batch_size=1,
        global_batch_size=256,
        pipeline_schedule="gpipe",
        amp="fp32",
    ),
]


@pytest.fixture(params=sorted(EXPORTERS))
def exporter(request):
    return EXPORTERS[request.param]


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.short())
@pytest.mark.parametrize("with_model", [False, True])
def test_contract_every_field_is_mapped_or_declared_unsupported(exporter, strategy, with_model):
    out = exporter.export(strategy, model=MODEL if with_model else None)
    assert out.runtime == exporter.name and out.text.strip()
    unsupported = {field for field, _ in out.unsupported}
    assert out.mapped | unsupported == set(strategy_fields())
    assert not out.mapped & unsupported
    assert all(why.strip() for _, why in out.unsupported)
    rendered = out.render()
    assert rendered.startswith(out.text.rstrip())
    assert ("no equivalent" in rendered) == bool(out.unsupported)
    for number in (strategy.tp, strategy.pp, strategy.global_batch_size):
        assert str(number) in rendered


def test_contract_text_is_machine_readable(exporter):
    for strategy in STRATEGIES:
        text = exporter.export(strategy, model=MODEL).text
        if exporter.name == "deepspeed":
            assert json.loads(text)["train_batch_size"] == strategy.global_batch_size
        elif exporter.name == "torchtitan":
            cfg = tomllib.loads(text)
            assert cfg["parallelism"]["tensor_parallel_degree"] == strategy.tp
        else:
            assert f"--micro-batch-size {strategy.micro_batch_size}" in text


def test_runtime_specifics():
    interleaved = STRATEGIES[3]
    mega = export(interleaved, to="megatron", model=MODEL)
    assert "--num-layers-per-virtual-pipeline-stage 2" in mega.text and "--fp16" in mega.text
    gpipe = export(STRATEGIES[4], to="megatron")
    assert dict(gpipe.unsupported)["pipeline_schedule"].startswith("Megatron-LM has no GPipe")
    ds = export(interleaved, to="deepspeed")
    assert {"virtual_stages", "zero_stage"} <= dict(ds.unsupported).keys()
    tt = export(STRATEGIES[2], to="torchtitan")
    assert "zero_stage" in dict(tt.unsupported)  # FSDP2 has no ZeRO-1
    with pytest.raises(SpecError, match="unknown runtime 'jax'.*megatron"):
        export(STRATEGIES[0], to="jax")


def test_cli_export_prints_config_on_stdout_and_caveats_on_stderr(tmp_path):
    path = tmp_path / "best.yaml"
    STRATEGIES[3].to_yaml(path)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "autosearch",
            "export",
            "--strategy",
            str(path),
            "--to",
            "deepspeed",
            "--model",
            "llama3-70b",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["zero_optimization"]["stage"] == 2
    assert "no equivalent in deepspeed" in run.stderr
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "autosearch",
            "export",
            "--strategy",
            str(path),
            "--to",
            "megatron",
            "--model",
            "gpt3-125m",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert (
        bad.returncode == 2
        and "does not divide n_heads" in bad.stderr
        and "Traceback" not in bad.stderr
    )
