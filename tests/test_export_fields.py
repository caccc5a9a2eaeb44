"""Every field that shapes the model is exported or refused (issue 31, item 1), and an export is
checked under the target framework before it is written (item 4).

The table: every catalog model x every exporter. Each field of `MODEL_FIELDS` is either given to
the framework (`Exported.model_fields`: its flag, key or model argument) or refused
(`Exported.refused`, with why), never dropped; an export with a refused field raises naming each
field and the framework unless asked to go on.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from autosearch import ModelSpec, SpecError, Strategy, TuneConfig, tune
from autosearch.core.model_spec import model_catalog
from autosearch.export import EXPORTERS, export
from autosearch.export._architecture import MODEL_FIELDS

ROOT = Path(__file__).resolve().parent.parent
ONE = Strategy(dp=1, global_batch_size=1)
TABLE = [(m, e) for m in sorted(model_catalog()) for e in EXPORTERS]


@pytest.mark.parametrize(("model", "exporter"), TABLE, ids=[f"{m}-{e}" for m, e in TABLE])
def test_every_field_is_exported_or_refused(model, exporter):
    spec = ModelSpec.load(model)
    out = export(ONE, to=exporter, model=spec, allow_unsupported=True)
    given = [f for f, _ in out.model_fields]
    refused = [f for f, _ in out.refused]
    assert sorted(given + refused) == sorted(MODEL_FIELDS)  # each once, none dropped
    assert all(why for _, why in out.refused)
    if refused:
        with pytest.raises(SpecError) as raised:
            export(ONE, to=exporter, model=spec)
        assert all(f in str(raised.value) for f in refused)
        assert out.runtime in str(raised.value)
    else:
        assert export(ONE, to=exporter, model=spec).text == out.text


def test_the_qwen3_moe_megatron_export_builds_the_planned_heads_norms_and_rope():
    """The case of the issue: 128-wide heads (not 2048 / 32), QK norm, RoPE base 1e6."""
    text = export(ONE, to="megatron", model=ModelSpec.load("qwen3-30b-a3b")).text
    for flag in ("--kv-channels 128", "--qk-layernorm", "--rotary-base 1000000"):
        assert flag in text


def autosearch(*args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "autosearch", *args], cwd=cwd, capture_output=True, text=True
    )


def test_a_strategy_that_does_not_fit_there_is_refused_unless_forced(tmp_path):
    args = ["export", "--model", "llama3-70b", "--cluster", "h100-sxm:8x8", "--to", "torchtitan"]
    args += ["--strategy", "dp=64,global_batch_size=512"]
    refused = autosearch(*args, cwd=tmp_path)
    assert refused.returncode == 2 and refused.stdout == ""
    assert "DOES NOT FIT" in refused.stderr and "--force" in refused.stderr
    forced = autosearch(*args, "--force", "--out", "x", cwd=tmp_path)
    assert forced.returncode == 0, forced.stderr
    for name in ("torchtitan.toml", "torchtitan.sh"):
        text = (tmp_path / "x" / name).read_text()
        assert (
            "# WARNING: torchtitan: priced as runtime torchtitan"
            in text.splitlines()[1 if text.startswith("#!") else 0]
        )


def test_a_pick_tuned_for_the_engine_names_the_frameworks_own_pick(tmp_path):
    """A best_strategy.yaml tuned for runtime torch, exported to torchtitan: priced there, and
    the message names what `tune --runtime torchtitan` picks for the same case."""
    case = dict(model="llama3-8b", cluster="h100-sxm:1x4", global_batch_size=32)
    tune(TuneConfig(**case, out=str(tmp_path / "study")))
    own = tune(TuneConfig(**case, runtime="torchtitan"))
    best = tmp_path / "study" / "best_strategy.yaml"
    run = autosearch("export", "--strategy", str(best), "--to", "torchtitan", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "priced as runtime torchtitan" in run.stderr
    said = f"`autosearch tune --runtime torchtitan` picks {own.best_strategy.short()} at "
    assert "tuned for runtime torch, not torchtitan" in run.stderr and said in run.stderr


@pytest.mark.parametrize("script", ["megatron.sh", "torchtitan.sh", "deepspeed_launch.sh"])
def test_a_launch_script_stops_until_its_placeholders_are_set(tmp_path, script):
    run = autosearch(
        "export", "--model", "llama3-8b", "--cluster", "h100-sxm:1x8", "--to", "all",
        "--strategy", "dp=8,global_batch_size=64,zero_stage=3,recompute=full", "--out", "x",
        cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    path = tmp_path / "x" / script
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    stopped = subprocess.run(
        ["bash", str(path)], cwd=tmp_path / "x", env=env, capture_output=True, text=True
    )
    assert stopped.returncode != 0
    assert "set " in stopped.stderr or "TRAIN_ITERS" in stopped.stderr, stopped.stderr
