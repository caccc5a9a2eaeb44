"""`autosearch sweep`: one CSV row per model x cluster x batch, resumable."""

from __future__ import annotations

import csv
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _sweep(out, *extra):
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "autosearch",
            "sweep",
            "--models",
            "llama3-8b,llama3-70b",
            "--gpus",
            "h100-sxm",
            "--nodes",
            "1,4",
            "--global-batch-sizes",
            "64",
            "--n-trials",
            "15",
            "--price-per-gpu-hour",
            "2",
            "--out",
            str(out),
            "--quiet",
            *extra,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_sweep_writes_one_row_per_combination_and_resumes(tmp_path):
    out = tmp_path / "sweep.csv"
    run = _sweep(out)
    assert run.returncode == 0, run.stderr
    rows = _rows(out)
    assert [(r["model"], r["n_nodes"]) for r in rows] == [
        ("llama3-8b", "1"),
        ("llama3-8b", "4"),
        ("llama3-70b", "1"),
        ("llama3-70b", "4"),
    ]
    ok = [r for r in rows if r["status"] == "ok"]
    assert ok and all(
        r["strategy"] and float(r["tokens_per_s"]) > 0 and float(r["usd_per_million_tokens"]) > 0
        for r in ok
    )
    no_fit = next(r for r in rows if r["model"] == "llama3-70b" and r["n_nodes"] == "1")
    assert no_fit["status"] == "infeasible" and "GiB over" in no_fit["reason"]

    # A torn last line (a sweep killed while writing) is dropped and its combination redone.
    text = out.read_text()
    out.write_text(text[: text.rstrip("\n").rfind("\n") + 1] + "llama3-70b,70.5,h100-s")
    again = _sweep(out)
    assert again.returncode == 0, again.stderr
    strip = lambda rs: [{k: v for k, v in r.items() if k != "search_s"} for r in rs]  # noqa: E731
    assert strip(_rows(out)) == strip(rows)


def test_sweep_user_errors(tmp_path):
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "autosearch",
            "sweep",
            "--models",
            "llama3-8b",
            "--gpus",
            "h100-sxm",
            "--global-batch-sizes",
            "64",
            "--out",
            str(tmp_path / "x.csv"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 2 and "--gpus and --nodes go together" in run.stderr


def test_sweep_rows_carry_every_strategy_dimension(tmp_path):
    """The CSV has a column for every Strategy field (cp, fp8, the split, ...), so a row names
    the whole strategy it found."""
    import dataclasses

    from autosearch import Strategy
    from autosearch.tuning._sweep import COLUMNS

    assert {f.name for f in dataclasses.fields(Strategy)} <= set(COLUMNS)
