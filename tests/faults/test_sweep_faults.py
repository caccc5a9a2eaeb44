"""A sweep killed (SIGKILL, at any moment) and run again ends with each combination once, equal
to the rows of a sweep that was never killed; rows computed with other tune settings are never
mixed in."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time

ARGS = ["sweep", "--models", "llama3-8b,qwen3-8b", "--clusters", "h100-sxm:1x2,h100-sxm:1x4"]
ARGS += ["--global-batch-sizes", "32,64", "--n-trials", "12", "--jobs", "2", "--quiet"]
KEY = ("model", "cluster", "global_batch_size")


def autosearch(args, *, cwd, **kw):
    return subprocess.Popen(
        [sys.executable, "-m", "autosearch", *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a kill of the group reaches the sweep's workers too
        **kw,
    )


def rows(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def picks(rs: list[dict]) -> list[tuple]:
    return [tuple(r[k] for k in KEY) + (r["strategy"], r["tokens_per_s"]) for r in rs]


def test_a_sweep_killed_again_and_again_ends_with_each_row_once(tmp_path):
    whole = autosearch(ARGS + ["--out", "whole.csv"], cwd=tmp_path)
    assert whole.wait(timeout=600) == 0, whole.stderr.read()
    expected = picks(rows(tmp_path / "whole.csv"))
    assert len(expected) == 8

    out = tmp_path / "killed.csv"
    kills = 0
    for _ in range(12):  # kill as soon as a row lands (or the header), until one run completes
        proc = autosearch(ARGS + ["--out", "killed.csv"], cwd=tmp_path)
        before = os.path.getsize(out) if out.exists() else 0
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline:
            if out.exists() and os.path.getsize(out) > before:
                os.killpg(proc.pid, signal.SIGKILL)
                kills += 1
                break
            time.sleep(0.05)
        if proc.wait(timeout=300) == 0:
            break
    else:
        raise AssertionError("the sweep never completed")
    assert kills >= 2  # it was interrupted, more than once
    assert picks(rows(out)) == expected  # each combination once, in order, as never killed


def test_a_csv_of_other_tune_settings_is_not_resumed(tmp_path):
    first = autosearch(ARGS + ["--out", "s.csv"], cwd=tmp_path)
    assert first.wait(timeout=600) == 0
    other = autosearch(ARGS + ["--out", "s.csv", "--runtime", "torchtitan"], cwd=tmp_path)
    assert other.wait(timeout=120) == 2
    message = other.stderr.read()
    assert "other tune settings" in message and "Traceback" not in message
    assert len(rows(tmp_path / "s.csv")) == 8  # nothing lost
