"""Four `autosearch tune` workers at once on one study: the exact trial count, every layout once
in exhaustive mode, and outputs that agree with the storage (journal and a fresh SQLite file)."""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys

import pytest
import yaml

from autosearch.tuning import load_study
from search_spaces import SearchSpace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = 4
PINS = dict(cp=1, uneven_pipeline=False, compile=False, async_tp=False)


def run_workers(args: list[str], *, n: int = WORKERS, timeout: int = 300) -> list[str]:
    """Start `n` CLI workers together (different seeds); return their stdout."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "autosearch", "tune", *args, "--seed", str(i), "--quiet"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(n)
    ]
    outs = [p.communicate(timeout=timeout) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert "Traceback" not in err, err
    return [o for o, _ in outs]


def new_trials(stdout: str) -> int:
    m = re.search(r"^(\d+) trials \((\d+) new", stdout, re.M)
    return int(m.group(2)) if m else 0


def check_outputs_agree_with_storage(out, trials) -> None:
    """trials.csv, study.yaml, report.md and best_strategy.yaml tell what the storage holds."""
    with open(out / "trials.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert sorted(int(r["trial"]) for r in rows) == sorted(t.number for t in trials)
    meta = yaml.safe_load((out / "study.yaml").read_text())
    assert meta["n_trials"] == len(trials) == len(rows)
    assert f"trials: {len(trials)} finished" in (out / "report.md").read_text()
    feasible = [t for t in trials if t.user_attrs["report"]["fits"]]
    best_tps = max(t.user_attrs["report"]["tokens_per_s"] for t in feasible)
    best = yaml.safe_load((out / "best_strategy.yaml").read_text())
    assert best["prediction"]["tokens_per_s"] == pytest.approx(best_tps, rel=1e-12)


@pytest.mark.slow
def test_four_workers_on_a_journal_finish_exactly_n_trials(tmp_path):
    out = tmp_path / "shared"
    n_trials = 80
    args = ["--model", "llama3-8b", "--cluster", "h100-sxm:2x8", "--global-batch-size", "64"]
    args += ["--trial-unit", "strategy", "--n-trials", str(n_trials), "--out", str(out)]
    outs = run_workers(args)
    trials = load_study(out).study.get_trials(deepcopy=False)
    assert sorted(t.number for t in trials) == list(range(n_trials))  # no overshoot, no hole
    assert sum(new_trials(o) for o in outs) == n_trials  # every trial a worker ran is stored
    assert len({t.user_attrs["worker"] for t in trials}) >= 2
    check_outputs_agree_with_storage(out, trials)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["journal", "sqlite"])
def test_four_workers_in_exhaustive_mode_cover_every_layout_once(tmp_path, kind):
    """The issue's case (350 layouts; 2 workers covered 344, 4 covered 338) on a journal, and a
    smaller space on a fresh SQLite file that all four workers create at once.

    The pins keep the issue's 350 layouts of the space it was found in (no cp, no uneven
    pipelines; the default space now has 9,600 for 70B) and score fewer strategies per layout
    (no compile, no async TP): what is checked is the layout coverage, not the scores."""
    if kind == "journal":
        model, cluster, gbs = "llama3-70b", "h100-sxm:32x8", 512
    else:
        model, cluster, gbs = "llama3-8b", "h100-sxm:2x8", 64
    space = SearchSpace(model, cluster, global_batch_size=gbs, **PINS)
    assert space.n_groups == (350 if kind == "journal" else 223)
    out = tmp_path / "shared"
    args = ["--model", model, "--cluster", cluster, "--global-batch-size", str(gbs)]
    args += ["--sampler", "exhaustive", "--n-trials", str(10 * space.n_groups), "--out", str(out)]
    args += [f"--pin={k}={str(v).lower()}" for k, v in PINS.items()]
    if kind == "sqlite":
        args += ["--storage", str(out / "study.db")]
    outs = run_workers(args)
    trials = load_study(out).study.get_trials(deepcopy=False)
    layouts = {tuple(sorted(t.params.items())) for t in trials}
    assert len(trials) == len(layouts) == space.n_groups  # each layout exactly once
    assert sum(new_trials(o) for o in outs) == space.n_groups
    check_outputs_agree_with_storage(out, trials)
    # a rerun has nothing left to do, and says so truthfully
    again = run_workers(args, n=1)[0]
    assert new_trials(again) == 0 and f"{space.n_groups} trials" in again
