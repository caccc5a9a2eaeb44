"""Fault injection: SIGKILL `tune` at random points (journal and SQLite), then run it again.

Each kill point is a forked child running `tune` on the same study and output folder, killed
after a random delay drawn from a seeded generator (so a failure can be replayed); the delays
span the whole run, so kills land while trials are scored and persisted, while the study is
read at start, and while the outputs are written. After every kill, every trial that was
stored before is still there unchanged, numbered without a hole; after the final run the study
holds exactly the trials asked for and the folder holds no temporary file.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
import traceback

import pytest

from autosearch.export import EXPORT_FILES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KILLS = 20
SMALL = dict(model="llama3-8b", cluster="h100-sxm:2x8", global_batch_size=64)
EXPECTED = {
    "trials.csv",
    "top_k.csv",
    "best_strategy.yaml",
    "study.yaml",
    "report.md",
    "time_breakdown.png",
    "throughput_memory.png",
    "importances.png",
    ".lock",
    ".autosearch",  # the marker of a folder autosearch made
    # what each runtime takes, written beside best_strategy.yaml (as `autosearch tune` does)
    *EXPORT_FILES,
}


def _run_child(out: str, storage: str | None, n_trials: int, seed: int) -> int:
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:  # pragma: no cover - runs in the child
        from autosearch import tune

        tune(
            **SMALL,
            n_trials=n_trials,
            seed=seed,
            sampler="random",
            trial_unit="strategy",
            use_recipes=False,
            out=out,
            storage=storage,
        )
        code = 0
    except BaseException:  # pragma: no cover
        traceback.print_exc()
    finally:
        os._exit(code)


def _journal_snapshot(path: str) -> dict[int, tuple]:
    """Trials by number, read from the file with a fresh reader (not the workers' objects)."""
    trials: dict[int, dict] = {}
    with open(path, "rb") as f:
        for line in f:
            if not line.endswith(b"\n"):
                break  # a torn tail: not a stored record
            rec = json.loads(line)
            if rec["op_code"] == 4:  # CREATE_TRIAL (whole: we write finished trials in one op)
                trials[len(trials)] = (rec["state"], rec.get("params"), rec.get("value"))
    return trials


def _sqlite_snapshot(path: str) -> dict[int, tuple]:
    if not os.path.exists(path):
        return {}
    # read-write: a kill mid-transaction leaves a hot journal that the next opener rolls back
    con = sqlite3.connect(path, timeout=60)
    try:
        try:
            rows = con.execute("SELECT trial_id, number, state FROM trials").fetchall()
        except sqlite3.OperationalError as exc:
            if "no such table" in str(exc):  # killed before the tables were created
                return {}
            raise
        params = {}
        for tid, name, value in con.execute(
            "SELECT trial_id, param_name, param_value FROM trial_params"
        ):
            params.setdefault(tid, {})[name] = value
        values = dict(con.execute("SELECT trial_id, value FROM trial_values").fetchall())
    finally:
        con.close()
    return {num: (state, params.get(tid), values.get(tid)) for tid, num, state in rows}


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind,n_trials,max_delay_s",
    [("journal", 1200, 2.0), ("sqlite", 120, 2.5)],
)
def test_sigkill_at_random_points_loses_and_duplicates_nothing(
    tmp_path, kind, n_trials, max_delay_s
):
    out = str(tmp_path / "run")
    storage = None if kind == "journal" else os.path.join(out, "study.db")
    path = os.path.join(out, "study.journal") if kind == "journal" else storage
    snapshot = _journal_snapshot if kind == "journal" else _sqlite_snapshot
    rng = random.Random(1234)
    seen: dict[int, tuple] = {}
    delays = []
    # KILLS seeded delays; on a starved machine (a loaded CI runner) where none of them came
    # late enough to store a trial, more kills at 2x, 4x ... the longest delay, until one does
    extra = (max_delay_s * 2**i for i in range(1, 6))
    for k in range(KILLS + 5):
        if k >= KILLS and seen:
            break
        delay = rng.uniform(0.0, max_delay_s) if k < KILLS else next(extra)
        delays.append(round(delay, 3))
        pid = _run_child(out, storage, n_trials, seed=k)
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        now = snapshot(path) if os.path.exists(path) else {}
        assert sorted(now) == list(range(len(now))), f"hole after kill {k} ({delay:.3f} s)"
        assert len(now) <= n_trials
        for number, record in seen.items():  # nothing stored before was lost or changed
            assert now.get(number) == record, f"trial {number} changed by kill {k}"
        seen = now
    print(f"{kind}: killed at {delays} s; {len(seen)} of {n_trials} trials stored by then")
    assert 0 < len(seen), "no kill came late enough to store a trial"

    pid = _run_child(out, storage, n_trials, seed=99)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    final = snapshot(path)
    assert sorted(final) == list(range(n_trials))  # exactly as many as asked, none twice
    for number, record in seen.items():
        assert final[number] == record
    left = set(os.listdir(out)) - EXPECTED - {os.path.basename(path)}
    lock = os.path.basename(path) + (".flock" if kind == "journal" else ".lock")
    assert left <= {lock}, f"left behind: {sorted(left - {lock})}"
    with open(os.path.join(out, "trials.csv")) as f:
        assert sum(1 for _ in f) == n_trials + 1


@pytest.mark.slow
def test_ctrl_c_prints_one_line_and_the_same_command_resumes(tmp_path):
    out = tmp_path / "run"
    args = [sys.executable, "-m", "autosearch", "tune", "--model", "llama3-8b"]
    args += ["--cluster", "h100-sxm:2x8", "--global-batch-size", "64", "--trial-unit"]
    args += ["strategy", "--sampler", "random", "--n-trials", "3000", "--out", str(out)]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    journal = out / "study.journal"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
        if journal.exists() and journal.read_bytes().count(b"\n") >= 30:
            break
    assert proc.poll() is None, "finished before it could be interrupted; raise --n-trials"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    err = err.decode()
    assert proc.returncode == 130 and "interrupted" in err and "Traceback" not in err, err
    stored = len(_journal_snapshot(str(journal)))
    # 30 journal lines were seen before the interrupt; the first records are the study's own
    # (its creation and metadata, 2 today), the rest are whole trials, none of them lost
    assert stored >= 30 - 3
    again = subprocess.run(
        [*args[:-4], "--n-trials", str(stored + 5), "--out", str(out), "--quiet"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert again.returncode == 0, again.stderr
    assert len(_journal_snapshot(str(journal))) == stored + 5
