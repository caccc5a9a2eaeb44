"""Engine.tune end to end: describe this machine, search, optionally validate, then train with it."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autosearch import Engine, ModelSpec
from autosearch.engine import SyntheticTokens
from autosearch.core.errors import SpecError
from autosearch.transformer import Transformer

ROOT = Path(__file__).resolve().parent.parent
SPEC = ModelSpec.load("tiny-gpt").scaled(n_layers=2, seq_len=32)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def test_tune_calibrates_a_new_machine_validates_and_trains(tmp_path, capsys):
    """No profile for this machine: a quick calibration first (and it says so); the two best
    candidates run for real; the fastest measured one becomes the strategy, and training works."""
    engine = Engine(lambda: Transformer(SPEC), optimizer=adamw, seed=0)
    data = SyntheticTokens.for_model(SPEC, 64)
    result = engine.tune(data, batch_size=8, n_trials=20, seed=0, out=str(tmp_path / "study"),
                         calibration_dir=str(tmp_path / "calibration"), validate_top_k=2, steps=1, warmup=1,
                         space={"amp": "fp32"})
    printed = capsys.readouterr().out
    assert "calibrating it quickly" in printed and "best measured" in printed
    assert (tmp_path / "calibration" / "cpu-local.yaml").exists()
    assert engine.best_strategy_.world_size == 1 and engine.strategy == engine.best_strategy_
    assert engine.best_strategy_ in [c.strategy for c in result.top_k[:2]]
    assert list(engine.validation_.table.status) == ["ok", "ok"]
    assert (tmp_path / "study" / "best_strategy.yaml").exists()
    assert (tmp_path / "study" / "best_measured_strategy.yaml").exists()
    history = engine.fit(data, epochs=1, steps_per_epoch=2, verbose=0)
    assert len(history["loss"]) == 2 and all(l == l for l in history["loss"])


def test_tune_refuses_data_of_another_length(tmp_path):
    engine = Engine(lambda: Transformer(SPEC), optimizer=adamw)
    other = SyntheticTokens.for_model(SPEC.scaled(seq_len=16), 8)
    with pytest.raises(SpecError, match="length 16 but the model's ModelSpec says seq_len=32"):
        engine.tune(other, batch_size=8, cluster="h100-sxm:1x1", out=str(tmp_path), verbose=0)


def test_tune_under_torchrun_gives_every_rank_the_same_strategy(tmp_path):
    """Rank 0 searches (with the committed calibration of this kind of machine), rank 1 waits; both
    receive the same strategy and train with it."""
    record = tmp_path / "record"
    env = {**os.environ, "AUTOSEARCH_CALIBRATION_DIR": str(ROOT / "results" / "calibration")}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(ROOT / "tests" / "engine_tune_worker.py"), str(tmp_path / "study"), str(record)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads(Path(f"{record}.{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["strategy"] == ranks[1]["strategy"]
    assert ranks[0]["strategy"]["dp"] * ranks[0]["strategy"]["tp"] * ranks[0]["strategy"]["pp"] == 2
    assert ranks[0]["loss"] == pytest.approx(ranks[1]["loss"])
