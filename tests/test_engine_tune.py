"""Engine.tune end to end: describe this machine, search, optionally validate, then train."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from autosearch import Engine, ModelSpec
from autosearch.autotune import local_cluster
from autosearch.core.errors import SpecError
from autosearch.engine import SyntheticTokens
from autosearch.models.transformer import Transformer

ROOT = Path(__file__).resolve().parent.parent
SPEC = ModelSpec.load("tiny-gpt").scaled(n_layers=2, seq_len=32)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


EXAMPLE = ROOT / "results" / "calibration" / "example-amd-epyc-2c"  # another machine's profile


def profiles_with_quality(folder: Path, *, ok: bool, problems=(), of_this_machine=True) -> Path:
    """The committed example CPU calibration (an AMD EPYC, 2 cores) copied as this machine's
    (``cpu-local.yaml`` and its 1-process variant), with a calibration quality record
    (scratch/INTERFACES.md item 2) saying it passed or failed its checks, and recording this
    machine as the one it measured (or, with ``of_this_machine=False``, the EPYC it did)."""
    from cost_models.calibration.machine import this_cpu

    here = this_cpu()
    folder.mkdir(parents=True, exist_ok=True)
    for suffix in ("", "-np1"):
        data = yaml.safe_load(Path(f"{EXAMPLE}{suffix}.yaml").read_text())
        data["name"] = f"cpu-local{suffix}"
        calibration = data.setdefault("calibration", {})
        calibration["quality"] = {"ok": ok, "problems": list(problems), "warnings": []}
        if "variants" in calibration:
            calibration["variants"] = {1: "cpu-local-np1.yaml"}
        calibration["machine"]["measurements_csv"] = "cpu-local.csv"
        if of_this_machine:
            calibration["machine"].update(
                host_cpu=here.name, device_name=here.name, cpu_cores=here.count,
                cpu_flags=list(here.isa or ()),
            )  # fmt: skip
        (folder / f"cpu-local{suffix}.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    (folder / "cpu-local.csv").write_text(Path(f"{EXAMPLE}.csv").read_text())
    return folder


def test_tune_validates_the_top_candidates_and_trains_with_the_fastest(tmp_path, capsys):
    """The two best candidates run for real; the fastest measured one becomes the strategy, and
    training works. The profile: the committed calibration of this kind of machine."""
    folder = profiles_with_quality(tmp_path / "calibration", ok=True)
    engine = Engine(lambda: Transformer(SPEC), optimizer=adamw, seed=0)
    data = SyntheticTokens.for_model(SPEC, 64)
    result = engine.tune(
        data,
        batch_size=8,
        n_trials=20,
        seed=0,
        out=str(tmp_path / "study"),
        calibration_dir=str(folder),
        validate_top_k=2,
        steps=1,
        warmup=1,
        space={"amp": "fp32"},
    )
    printed = capsys.readouterr().out
    assert "best measured" in printed and "calibrating" not in printed
    assert f"tune: hardware profile cpu-local-np1 ({folder}" in printed
    assert "its calibrated profile" in printed and "measured on" in printed
    assert engine.best_strategy_.world_size == 1 and engine.strategy_ == engine.best_strategy_
    assert engine.strategy is None  # the constructor's argument is kept (sklearn style)
    assert engine.best_strategy_ in [c.strategy for c in result.top_k[:2]]
    assert list(engine.validation_.table.status) == ["ok", "ok"]
    assert (tmp_path / "study" / "best_strategy.yaml").exists()
    assert (tmp_path / "study" / "best_measured_strategy.yaml").exists()
    history = engine.fit(data, epochs=1, steps_per_epoch=2, verbose=0)
    assert len(history["loss"]) == 2 and all(loss == loss for loss in history["loss"])


def test_tune_calibrates_a_new_machine_first(tmp_path, capsys):
    """No profile for this machine: a quick calibration first (and it says so). A calibration
    that passes its quality checks is searched with; on a busy machine it may fail them, and then
    tune refuses to search with it (SpecError naming the problems), never silently."""
    engine = Engine(lambda: Transformer(SPEC), optimizer=adamw, seed=0)
    folder = tmp_path / "calibration"
    try:
        engine.tune(
            batch_size=8,
            n_trials=5,
            seed=0,
            out=str(tmp_path / "study"),
            calibration_dir=str(folder),
            space={"amp": "fp32"},
        )
    except SpecError as exc:
        assert "failed its checks, so tune will not search with it" in str(exc)
        assert "calibrating it quickly" in capsys.readouterr().out
        return
    printed = capsys.readouterr().out
    assert "calibrating it quickly" in printed
    assert f"tune: hardware profile cpu-local-np1 ({folder}" in printed
    assert (folder / "cpu-local.yaml").exists() and engine.strategy_.world_size == 1


def test_tune_sets_learned_attributes_and_keeps_constructor_arguments(tmp_path):
    start = "dp=1,micro_batch_size=8,global_batch_size=8,amp=fp32,recompute=full"
    engine = Engine(lambda: Transformer(SPEC), optimizer=adamw, strategy=start, seed=0)
    data = SyntheticTokens.for_model(SPEC, 16)
    result = engine.tune(
        data,
        cluster="h100-sxm:1x1",
        n_trials=10,
        seed=0,
        out=str(tmp_path),
        space={"amp": "fp32"},
        verbose=0,
    )
    assert engine.strategy == start and engine.cluster is None  # arguments untouched
    assert engine.strategy_ == engine.best_strategy_ == result.best_strategy
    assert engine.best_strategy_.global_batch_size == 8  # the default batch: the start strategy's
    assert engine.best_report_ == result.best_report and engine.tune_result_ is result
    assert engine.tuned_cluster_.name == "h100-sxm:1x1" and engine.validation_ is None
    engine.fit(data, epochs=1, steps_per_epoch=1, verbose=0)
    assert engine.strategy_ == result.best_strategy  # what it trained with


def test_tune_refuses_data_of_another_length(tmp_path):
    engine = Engine(lambda: Transformer(SPEC), optimizer=adamw)
    other = SyntheticTokens.for_model(SPEC.scaled(seq_len=16), 8)
    with pytest.raises(SpecError, match="length 16 but the model's ModelSpec says seq_len=32"):
        engine.tune(other, batch_size=8, cluster="h100-sxm:1x1", out=str(tmp_path), verbose=0)


def test_tune_never_searches_with_a_profile_that_failed_its_checks(tmp_path):
    bad = profiles_with_quality(
        tmp_path / "bad", ok=False, problems=["GEMM rate 0.16 GFLOP/s: the machine was busy"]
    )
    engine = Engine(lambda: Transformer(SPEC), optimizer=adamw)
    with pytest.raises(SpecError, match="GEMM rate 0.16 GFLOP/s") as refused:
        engine.tune(
            batch_size=8, cluster=f"{bad / 'cpu-local.yaml'}:1x1", out=str(tmp_path), verbose=0
        )
    assert "will not search with the profile cpu-local" in str(refused.value)
    with pytest.raises(SpecError, match="is not trusted .*GEMM rate"):
        local_cluster(1, calibration_dir=str(bad), calibrate_if_missing=False, log=print)
    good = profiles_with_quality(tmp_path / "good", ok=True)
    cluster = local_cluster(1, calibration_dir=str(good), calibrate_if_missing=False, log=print)
    assert cluster.profile.path.startswith(str(good))


def test_the_profile_of_another_machine_is_not_this_machines(tmp_path, capsys):
    """The committed example (an AMD EPYC) in the calibration folder as ``cpu-local.yaml`` is
    not taken for this machine: without calibrating, tune refuses and names whose profile it
    is; this machine's ISA flags or core count differing is enough."""
    from cost_models.calibration.machine import this_cpu

    other = profiles_with_quality(tmp_path / "other", ok=True, of_this_machine=False)
    with pytest.raises(SpecError, match="measured on AMD EPYC .*not on this machine") as refused:
        local_cluster(1, calibration_dir=str(other), calibrate_if_missing=False, log=print)
    assert this_cpu().name in str(refused.value) and "autosearch calibrate" in str(refused.value)
    assert "calibrated profile" not in capsys.readouterr().out
    here = this_cpu()
    for field, value in (("cpu_cores", (here.count or 1) + 2), ("cpu_flags", ["avx", "avx2"])):
        folder = profiles_with_quality(tmp_path / field, ok=True)
        data = yaml.safe_load((folder / "cpu-local.yaml").read_text())
        data["calibration"]["machine"][field] = value
        (folder / "cpu-local.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
        if field == "cpu_flags" and set(here.isa or ()) == {"avx2"}:
            continue  # an AVX2-only machine: these flags are its own
        with pytest.raises(SpecError, match="not on this machine"):
            local_cluster(1, calibration_dir=str(folder), calibrate_if_missing=False, log=print)


def test_another_machines_profile_is_set_aside_and_this_machine_calibrated(tmp_path, monkeypatch):
    """With calibration allowed, the other machine's files move to
    other-machines/<that machine>/ (nothing measured is lost) and this machine is calibrated
    into cpu-local.yaml, which tune then uses; the log names both machines."""
    import autosearch.calibration as calibration

    folder = profiles_with_quality(tmp_path / "calibration", ok=True, of_this_machine=False)
    mine = profiles_with_quality(tmp_path / "mine", ok=True)
    asked = {}

    def fake_calibrate(*, out, world_sizes, **kwargs):  # this machine, measured (a copy)
        asked.update(out=out, world_sizes=world_sizes, **kwargs)
        for name in ("cpu-local.yaml", "cpu-local-np1.yaml", "cpu-local.csv"):
            (Path(out).parent / name).write_text((mine / name).read_text())
        from autosearch.core.hardware import HardwareProfile

        return type("Result", (), {"profile": HardwareProfile.load(out), "profile_path": out})

    monkeypatch.setattr(calibration, "calibrate", fake_calibrate, raising=False)
    lines: list[str] = []
    cluster = local_cluster(1, calibration_dir=str(folder), log=lines.append)
    text = "\n".join(lines)
    assert "measured on AMD EPYC (cpu, 2 cores" in text and "calibrating it quickly" in text
    assert asked["out"] == str(folder / "cpu-local.yaml") and asked["quick"]
    kept = folder / "other-machines" / "amd-epyc-2c"
    assert sorted(p.name for p in kept.iterdir()) == [
        "cpu-local-np1.yaml",
        "cpu-local.csv",
        "cpu-local.yaml",
    ]
    assert "AMD EPYC" in (kept / "cpu-local.yaml").read_text()
    assert cluster.profile.path == str(folder / "cpu-local-np1.yaml")
    lines.clear()
    again = local_cluster(
        1, calibration_dir=str(folder), calibrate_if_missing=False, log=lines.append
    )
    assert again.profile.path == cluster.profile.path and "its calibrated profile" in lines[0]


def test_validation_and_engine_do_not_import_each_other_in_a_loop():
    """The validation package (launcher and API) imports neither torch nor the Engine; the
    Engine's tune path uses validation only through the package's public names."""
    code = (
        "import sys, autosearch.validation, autosearch.core.processes; print(sorted(m for m in "
        "sys.modules if m == 'torch' or m.startswith('autosearch.engine')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    tree = ast.parse((ROOT / "autosearch" / "autotune.py").read_text())
    used = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert {m for m in used if m and m.startswith("autosearch.validation")} == {
        "autosearch.validation"
    }
    engine_tune = ast.parse((ROOT / "autosearch" / "autotune.py").read_text())
    tune = next(
        n for n in ast.walk(engine_tune) if isinstance(n, ast.FunctionDef) and n.name == "tune"
    )
    assigned = {
        t.attr
        for n in ast.walk(tune)
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Attribute)
    }
    assert "strategy" not in assigned and "cluster" not in assigned


def _torchrun(mode, tmp_path, env, timeout):
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(ROOT / "tests" / "engine_tune_worker.py"),
            mode,
            str(tmp_path / "study"),
            str(tmp_path / "record"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
def test_tune_under_torchrun_gives_every_rank_the_same_strategy(tmp_path):
    """Rank 0 searches (with the committed calibration of this kind of machine), rank 1 waits; both
    receive the same strategy and train with it."""
    folder = profiles_with_quality(tmp_path / "calibration", ok=True)
    env = {**os.environ, "AUTOSEARCH_CALIBRATION_DIR": str(folder)}
    proc = _torchrun("same", tmp_path, env, 600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"record.{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["strategy"] == ranks[1]["strategy"]
    assert (
        ranks[0]["strategy"]["dp"] * ranks[0]["strategy"]["tp"] * ranks[0]["strategy"]["pp"] == 2
    )
    assert ranks[0]["loss"] == pytest.approx(ranks[1]["loss"])


@pytest.mark.slow
def test_ranks_waiting_for_rank0_give_up_at_their_timeout_with_a_message(tmp_path):
    proc = _torchrun("slow", tmp_path, dict(os.environ), 300)
    record = json.loads((tmp_path / "record.1.json").read_text())
    assert "waited 3 s for rank 0" in record["error"] and "wait_timeout_s" in record["error"], (
        proc.stderr[-3000:]
    )


@pytest.mark.slow
def test_tune_under_torchrun_without_a_profile_calibrates_on_rank0_and_does_not_hang(tmp_path):
    """Rank 0 calibrates this machine from inside the torchrun job (its calibration workers must
    not inherit RANK/WORLD_SIZE/MASTER_PORT and join the job: that hung for ten minutes), then
    searches; rank 1 waits. On a busy machine the quick calibration may fail its quality checks:
    then every rank stops with the same message instead of searching with it."""
    env = {**os.environ, "AUTOSEARCH_CALIBRATION_DIR": str(tmp_path / "calibration")}
    proc = _torchrun("same", tmp_path, env, 420)
    if proc.returncode == 0:
        ranks = [json.loads((tmp_path / f"record.{r}.json").read_text()) for r in (0, 1)]
        assert ranks[0]["strategy"] == ranks[1]["strategy"]
        assert (tmp_path / "calibration" / "cpu-local.yaml").exists()
    else:
        assert "failed its checks" in proc.stdout + proc.stderr, proc.stderr[-3000:]
