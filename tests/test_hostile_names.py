"""Nothing written can be turned into code (issue 22, item 1).

Hostile names (a newline then ``touch MARK``, quotes, ``]\\n[table]``, ``$(...)``, backticks,
Unicode line separators) are refused where a name enters (a model's ``name``, a hardware profile's
``name``) and made plain where autosearch derives one (a Hugging Face config's path). Behind that
check, every exporter is tested on its own with the hostile name forced into a ModelSpec: each
file it writes parses back (bash -n, tomllib, json) to the same data as with a plain name, and
running the scripts with the launchers replaced by ``true`` creates no MARK file.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import yaml

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from autosearch import Cluster, ModelSpec, SpecError, Strategy
from autosearch.export import write_exports

HOSTILE = [
    "m\ntouch MARK",
    "m\r\ntouch MARK",
    "m'; touch MARK; '",
    'm"; touch MARK; "',
    "m]\n[table]\nx = 1",
    "$(touch MARK)",
    "`touch MARK`",
    "m\u2028touch MARK",
    "m\u2029touch MARK",
    "m\x85touch MARK",
    "m\x0btouch MARK",
    "m\x1b[2Jtouch MARK",
    "m\\\ntouch MARK",
]
TINY = dict(n_layers=8, hidden_size=512, n_heads=8, vocab_size=1000, seq_len=256)
STRATEGY = Strategy(dp=2, tp=2, pp=2, global_batch_size=16, micro_batch_size=1)
LAUNCHERS = ("torchrun", "deepspeed", "pretrain_gpt.py", "TRAIN_SCRIPT.py")


def forced(name: str) -> ModelSpec:
    """A valid spec whose name is replaced afterwards, past the check at entry (as a bug or a
    future reader that forgets it would), to test the writers on their own."""
    spec = ModelSpec(name="tiny", ffn_activation="swiglu", **TINY)
    object.__setattr__(spec, "name", name)
    return spec


def parsed(folder) -> dict:
    """Every exported file as data (scripts: their words once comments are dropped)."""
    out = {}
    for name in sorted(os.listdir(folder)):
        if not name.endswith((".json", ".toml", ".sh")):
            continue
        text = (folder / name).read_text(encoding="utf-8")
        if name.endswith(".json"):
            out[name] = json.loads(text)
        elif name.endswith(".toml"):
            out[name] = tomllib.loads(text)
        elif name.endswith(".sh"):
            check = subprocess.run(["bash", "-n", str(folder / name)], capture_output=True)
            assert check.returncode == 0, check.stderr.decode()
            code = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
            out[name] = code
    return out


def run_scripts(folder) -> None:
    """Run every script with the launchers replaced by `true`; nothing else may happen."""
    bin_dir = folder / "bin"
    bin_dir.mkdir()
    for launcher in LAUNCHERS:
        path = bin_dir / launcher
        path.write_text("#!/bin/sh\nexit 0\n")
        path.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(folder)}
    # the launch scripts' placeholders and their smoke-run switch (autosearch/export/_launch.py)
    env.update(MOCK_DATA="1", TRAIN_ITERS="1", LR="1e-4", CHECKPOINT_DIR=str(folder))
    env.update(MEGATRON_LM=str(bin_dir), TORCHTITAN=str(bin_dir), TRAIN_SCRIPT="train.py")
    for name in os.listdir(folder):
        if name.endswith(".sh"):
            script = folder / name
            # megatron.sh calls pretrain_gpt.py by name: run it from bin/ (where it is `true`)
            res = subprocess.run(["bash", str(script)], cwd=bin_dir, env=env, capture_output=True)
            assert res.returncode == 0, res.stderr.decode()


def no_mark(root) -> bool:
    return not any("MARK" in names for _, _, names in os.walk(root))


@pytest.mark.parametrize("name", HOSTILE, ids=range(len(HOSTILE)))
def test_model_names_that_cannot_be_written_are_refused_where_they_enter(name, tmp_path):
    with pytest.raises(SpecError, match="model name"):
        ModelSpec(name=name, **TINY)
    path = tmp_path / "model.yaml"
    path.write_text(yaml.safe_dump({"name": name, **TINY}), encoding="utf-8")
    with pytest.raises(SpecError, match="model name"):
        ModelSpec.load(str(path))
    profile = yaml.safe_load(
        open(
            os.path.join(
                os.path.dirname(__file__), "..", "cost_models", "profiles", "h100-sxm.yaml"
            )
        )
    )
    profile["name"] = name
    (tmp_path / "gpu.yaml").write_text(yaml.safe_dump(profile), encoding="utf-8")
    with pytest.raises(SpecError, match="name"):
        Cluster.parse(f"{tmp_path / 'gpu.yaml'}:1x8")


@pytest.mark.parametrize("name", HOSTILE, ids=range(len(HOSTILE)))
def test_every_exporter_writes_hostile_names_as_data(name, tmp_path):
    cluster = Cluster.parse("h100-sxm:1x8")
    plain, hostile = tmp_path / "plain", tmp_path / "hostile"
    write_exports(plain, STRATEGY, model=forced("plain"), cluster=cluster)
    write_exports(hostile, STRATEGY, model=forced(name), cluster=cluster)
    assert parsed(hostile) == parsed(plain)  # the name is in comments only, on one line
    run_scripts(hostile)
    assert no_mark(tmp_path)
    for path in hostile.iterdir():  # every comment stayed one comment
        if path.suffix in (".sh", ".toml"):
            for line in path.read_text(encoding="utf-8").splitlines():
                assert not line.strip() or line.startswith("#") or "touch" not in line, line


def test_names_derived_from_a_path_are_made_plain_and_tune_writes_them_as_data(tmp_path):
    """A Hugging Face config's `_name_or_path` is a path (spaces, anything): the spec's name is
    made plain from it; the study's files written with it parse back and run nothing."""
    from autosearch import tune

    hf = {
        "_name_or_path": "/models/my model\ntouch MARK $(touch MARK)",
        "model_type": "llama",
        "num_hidden_layers": 8,
        "hidden_size": 512,
        "num_attention_heads": 8,
        "intermediate_size": 1376,
        "vocab_size": 1000,
        "max_position_embeddings": 256,
    }
    model = ModelSpec.from_hf_config(hf)
    assert model.name == "models/my-model-touch-MARK-touch-MARK-"
    out = tmp_path / "study"
    result = tune(model, "h100-sxm:1x8", global_batch_size=16, n_trials=6, seed=0, out=out)
    write_exports(out, result.best_strategy, model=model, cluster=Cluster.parse("h100-sxm:1x8"))
    study = yaml.safe_load((out / "study.yaml").read_text())
    assert study["model"] == model.name and study["model_spec"]["name"] == model.name
    best = yaml.safe_load((out / "best_strategy.yaml").read_text())
    assert best["model"] == model.name
    report = (out / "report.md").read_text()
    assert report.splitlines()[0].startswith(f"# Strategy search: {model.name}: ")
    parsed(out)
    run_scripts(out)
    assert no_mark(tmp_path)


def test_a_crafted_model_file_cannot_smuggle_code_through_the_cli(tmp_path, capsys):
    """The same through `autosearch export --model FILE --out DIR` (exit 2, nothing written)."""
    from autosearch.cli import main

    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump({"name": "x\ntouch MARK", **TINY}), encoding="utf-8")
    argv = ["export", "--strategy", "dp=2,tp=2,pp=2,global_batch_size=16", "--to", "all"]
    assert main(argv + ["--model", str(path), "--out", str(tmp_path / "out")]) == 2
    assert "model name" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    assert shutil.which("bash") and sys.platform != "win32"
