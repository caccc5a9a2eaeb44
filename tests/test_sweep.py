"""`autosearch sweep`: one CSV row per model x cluster x batch, resumable."""

from __future__ import annotations

import collections
import csv
import json
import os
import signal
import subprocess
import sys
import time

import pytest

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


# offload to host memory kept off, so that llama3-70b on one node stays a row that does not fit
# (with offload it fits: tests/test_offload.py)
NO_OFFLOAD = ("--pin", "offload_optimizer=false", "--pin", "offload_activations=none")


def test_sweep_writes_one_row_per_combination_and_resumes(tmp_path):
    out = tmp_path / "sweep.csv"
    run = _sweep(out, *NO_OFFLOAD)
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
    again = _sweep(out, *NO_OFFLOAD)
    assert again.returncode == 0, again.stderr
    strip = lambda rs: [{k: v for k, v in r.items() if k != "search_s"} for r in rs]  # noqa: E731
    assert strip(_rows(out)) == strip(rows)


KILLS = 4  # SIGKILLs of the sweep, each once it has appended a row
# 12 combinations: 3 models x 2 clusters x 2 batches
KILLED_SWEEP = (
    ("--models", "llama3-8b,llama3-70b,gpt3-175b"),
    ("--clusters", "h100-sxm:1x8,h100-sxm:4x8"),
    ("--global-batch-sizes", "64,128"),
    ("--n-trials", "6"),
    ("--jobs", "1"),
)


def _records(path) -> int:
    try:
        return open(path, "rb").read().count(b"\n")
    except FileNotFoundError:
        return 0


@pytest.mark.slow
def test_a_sweep_killed_again_and_again_has_each_combination_once(tmp_path):
    """Issue 35: the sweep is killed (SIGKILL, no clean-up of any kind) as soon as it has
    appended a row, `KILLS` times, with a record torn mid-write left once; the same command then
    finishes, and each of the 12 combinations is in the CSV exactly once (the resume is keyed
    by the combination)."""
    out = tmp_path / "sweep.csv"
    cmd = [sys.executable, "-m", "autosearch", "sweep", "--out", str(out), "--quiet"]
    cmd += [x for pair in KILLED_SWEEP for x in pair]
    kills = 0
    for i in range(KILLS):
        before = _records(out)
        run = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        deadline = time.monotonic() + 120
        while run.poll() is None and _records(out) <= before + (before == 0):
            assert time.monotonic() < deadline, "the sweep appended no row in 120 s"
            time.sleep(0.01)
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)  # the sweep and any worker, mid-run
            kills += 1
        run.wait()
        run.stderr.close()
        if i == 1:  # what a kill inside a write leaves: half a record, a newline in its quotes
            with open(out, "a") as f:
                f.write(
                    'llama3-70b,70.55,,8192,h100-sxm:4x8,h100-sxm,4,8,32,128,1048576,invalid,,"a'
                )
                f.write("\nreason cut sh")
    final = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert final.returncode == 0, final.stderr
    rows = _rows(out)
    count = collections.Counter((r["model"], r["cluster"], r["global_batch_size"]) for r in rows)
    print(
        f"sweep killed {kills} times: {len(count)} combinations, "
        f"{sum(n - 1 for n in count.values())} written twice"
    )
    assert kills >= KILLS - 1, "the sweep ended before it could be killed"
    assert len(count) == 12 and set(count.values()) == {1}, count


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


def test_capacity_answers_follow_from_the_rows(tmp_path):
    """Prices per GPU type, a token target and a deadline: each row's days and dollars are the
    arithmetic of its tokens/s and price; the smallest cluster in time is the smallest row that
    meets the deadline, and the cheapest the row of least dollars per token."""
    from autosearch.tuning._sweep import SweepConfig, sweep

    prices = {"h100-sxm": 2.5, "b200-sxm": 4.5}
    config = SweepConfig(
        models=["llama3-8b"],
        gpus=["h100-sxm", "b200-sxm"],
        nodes=[1, 2, 4],
        global_batch_sizes=[256],
        price_per_gpu_hour=",".join(f"{g}={p}" for g, p in prices.items()),
        tokens="300B",
        deadline_days=20,
        settings={"n_trials": 12},
        jobs=1,
        out=str(tmp_path / "s.csv"),
    )
    result = sweep(config)
    assert len(result.rows) == 6 and all(r["status"] == "ok" for r in result.rows)
    for r in result.rows:
        tps, n, price = float(r["tokens_per_s"]), int(r["n_gpus"]), prices[r["gpu"]]
        days = 300e9 / tps / 86400
        assert float(r["days_for_tokens"]) == pytest.approx(days, rel=5e-3)  # 3 digits kept
        assert float(r["usd_for_tokens"]) == pytest.approx(days * 24 * n * price, rel=5e-3)
        assert r["meets_deadline"] == ("yes" if days <= 20 else "no")
        if r["tokens_per_s_low"] != "":  # the band holds the prediction
            assert float(r["tokens_per_s_low"]) <= tps <= float(r["tokens_per_s_high"])
    for answer in result.answers:
        group = [r for r in result.rows if r["gpu"] == answer["gpu"]]
        in_time = [r for r in group if r["meets_deadline"] == "yes"]
        smallest = answer["smallest_in_time"]
        assert smallest == (min(in_time, key=lambda r: int(r["n_gpus"])) if in_time else None)
        cheapest = min(group, key=lambda r: float(r["usd_per_million_tokens"]))
        assert answer["cheapest"] is cheapest
    report = (tmp_path / "s_report" / "report.md").read_text()
    assert "## Capacity" in report and "(tokens_per_gpu.png)" in report
    assert (tmp_path / "s_report" / "usd_per_million_tokens.png").stat().st_size > 10_000


def test_a_larger_cluster_slower_per_device_is_noted_with_the_term_that_grew():
    from autosearch.tuning._sweep import SweepConfig, complete

    def row(n, tps, shares):
        return {
            "model": "m", "seq_len": 4096, "gpu": "h100-sxm", "global_batch_size": 64,
            "cluster": f"h100-sxm:{n // 8}x8", "n_gpus": n, "status": "ok", "tokens_per_s": tps,
            "step_shares": json.dumps(shares),
        }  # fmt: skip

    small = row(8, 80_000, {"compute_s": 0.9, "dp_comm_exposed_s": 0.1})
    big = row(64, 400_000, {"compute_s": 0.6, "dp_comm_exposed_s": 0.4})
    config = SweepConfig(models=["m"], clusters=["h100-sxm:1x8"], global_batch_sizes=[64])
    rows = complete([small, big], config)
    assert rows[0]["note"] == ""
    assert rows[1]["note"] == (
        "-38% per device than 8 GPUs: exposed data-parallel communication 10% -> 40% of the "
        "step (64 sequences over 64 GPUs)"
    )
