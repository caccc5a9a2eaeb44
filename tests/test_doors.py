"""One search behind every door: `tune`, `sweep` (in-process and in worker processes) and
`Engine.tune` run the same search from a TuneConfig and pick the same strategy for the same case.

Two cases: one the budget rule scores exhaustively, and one it samples (TPE, then the local
search); the second runs with ``time_budget=0`` (the local search to its end), so what each door
picks cannot depend on how busy the machine is. Identical means the same strategy and the same
predicted tokens/s, to the integer the CSV keeps.
"""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

from autosearch import TuneConfig, tune
from autosearch.tuning._sweep import SweepConfig, sweep

ROOT = Path(__file__).resolve().parent.parent
CASES = {
    # 8B on four GPUs: scoring every layout fits the default budget (exhaustive, ~3 s)
    "exhaustive": dict(model="llama3-8b", cluster="h100-sxm:1x4", global_batch_size=32),
    # 70B at 8k tokens on 8 nodes: ~6,000 layouts, sampled then climbed
    "sampled": dict(
        model="llama3-70b",
        cluster="h100-sxm:8x8",
        global_batch_size=512,
        seq_len=8192,
        time_budget=0,
    ),
}


@pytest.fixture(scope="module")
def picks(tmp_path_factory) -> dict[str, dict[str, tuple[str, int]]]:
    """{case: {door: (strategy, tokens/s)}}."""
    tmp = tmp_path_factory.mktemp("doors")
    out: dict[str, dict[str, tuple[str, int]]] = {}
    for name, case in CASES.items():
        config = TuneConfig(**case)
        result = tune(config)
        assert result.best_strategy is not None and result.best_report is not None
        out[name] = {
            "tune": (result.best_strategy.short(), round(result.best_report.tokens_per_s)),
        }
        settings = {
            k: v for k, v in case.items() if k not in ("model", "cluster", "global_batch_size")
        }
        swept = sweep(
            SweepConfig(
                models=[case["model"]],
                clusters=[case["cluster"]],
                global_batch_sizes=[case["global_batch_size"]],
                settings=settings,
                jobs=1,
                out=str(tmp / f"{name}.csv"),
            )
        )
        (row,) = swept.rows
        out[name]["sweep"] = (row["strategy"], int(row["tokens_per_s"]))
        out[name]["search"] = (result.search, row["search"])
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_tune_and_sweep_pick_the_same(picks, name):
    assert picks[name]["sweep"] == picks[name]["tune"]


def test_the_doors_search_alike_and_cover_both_branches_of_the_budget_rule(picks):
    """Both doors did the same kind of search; the cases exercise both branches of the budget
    rule (else the test proves less)."""
    assert picks["exhaustive"]["search"] == ("exhaustive", "exhaustive")
    assert picks["sampled"]["search"] == ("tpe + local search",) * 2


def test_a_sweep_in_worker_processes_picks_what_tune_picks(picks, tmp_path):
    """The CLI, two combinations in two spawned processes: each row is tune's pick."""
    out = tmp_path / "s.csv"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "autosearch",
            "sweep",
            "--models",
            "llama3-8b",
            "--clusters",
            "h100-sxm:1x4,h100-sxm:1x2",
            "--global-batch-sizes",
            "32",
            "--jobs",
            "2",
            "--out",
            str(out),
            "--quiet",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    with open(out, newline="") as f:
        rows = {r["cluster"]: r for r in csv.DictReader(f)}
    assert list(rows) == ["h100-sxm:1x4", "h100-sxm:1x2"]  # the combinations' order
    row = rows["h100-sxm:1x4"]
    assert (row["strategy"], int(row["tokens_per_s"])) == picks["exhaustive"]["tune"]


def test_engine_tune_picks_what_tune_picks(picks, tmp_path):
    """Engine.tune from a TuneConfig and from keywords: the same search, the same pick."""
    pytest.importorskip("torch")
    from autosearch import Engine, ModelSpec
    from autosearch.models.transformer import Transformer

    case = CASES["exhaustive"]
    spec = ModelSpec.load(case["model"])
    engine = Engine(lambda: Transformer(spec), model_spec=spec)
    config = TuneConfig(**case, out=str(tmp_path / "a"))
    engine.tune(config=config, verbose=0)
    best = engine.best_strategy_.short(), round(engine.best_report_.tokens_per_s)
    assert best == picks["exhaustive"]["tune"]
    engine.tune(
        cluster=case["cluster"],
        batch_size=case["global_batch_size"],
        out=str(tmp_path / "b"),
        verbose=0,
    )
    assert engine.best_strategy_.short() == best[0]


def test_engine_tune_refuses_a_config_of_another_model(tmp_path):
    pytest.importorskip("torch")
    from autosearch import Engine, ModelSpec, SpecError
    from autosearch.models.transformer import Transformer

    spec = ModelSpec.load("tiny-gpt")
    engine = Engine(lambda: Transformer(spec), model_spec=spec)
    config = TuneConfig(**CASES["exhaustive"], out=str(tmp_path))
    with pytest.raises(SpecError, match="is not the engine's"):
        engine.tune(config=config, verbose=0)
    with pytest.raises(SpecError, match="not also"):
        engine.tune(config=config, seed=1, verbose=0)
