"""Time and memory per trial as a study grows: 10^3, 10^4 and 5x10^4 trials, journal and SQLite.

Each case runs `tune` in a fresh process (random sampler, one strategy per trial, so what grows
is the storage and the loop around it, not the sampler's own O(n) model), then runs the same
command again (a no-op rerun: read the study, write the outputs). Printed and written to
``results/storage_scale.csv``:

* ``ms_per_trial``: wall time of the whole search divided by the trials; ``ms_per_trial_last``:
  the last 10% of trials only (what a trial costs when the study is that large). Target: the
  last-10% cost at 5x10^4 within 2x of the one at 10^3.
* ``peak_rss_mb`` (the process's maximum resident set) and ``kb_per_trial`` (its growth over an
  empty study, per trial). Optuna's journal storage replays every record into memory, so the
  memory of a worker is bounded per trial, not in total: it grows linearly with the study.
* ``rerun_s``, ``rerun_outputs_s``, ``rerun_peak_rss_mb``: the no-op rerun.

SQLite at 5x10^4 runs only when the 10^4 case says it takes under 5 minutes; otherwise the row
is extrapolated linearly from the 10^4 case and says so.

Usage: ``python benchmarks/storage_scale.py [--sizes 1000,10000,50000] [--kinds journal,sqlite]``
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASE = dict(model="llama3-70b", cluster="h100-sxm:32x8", global_batch_size=512)
SQLITE_BUDGET_S = 300.0
COLUMNS = [
    "storage",
    "n_trials",
    "measured",
    "search_s",
    "ms_per_trial",
    "ms_per_trial_first",
    "ms_per_trial_last",
    "peak_rss_mb",
    "kb_per_trial",
    "outputs_s",
    "rerun_s",
    "rerun_outputs_s",
    "rerun_peak_rss_mb",
    "note",
]


def child(kind: str, n: int, folder: str) -> dict:
    """One run in this process; returns its figures."""
    sys.path.insert(0, ROOT)
    import matplotlib.pyplot  # noqa: F401  (imported by the outputs: not part of the growth)

    from autosearch import tune

    tune(**CASE, n_trials=5, sampler="random", trial_unit="strategy", seed=0)  # warm-up, in memory
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    stamps: list[float] = []
    storage = os.path.join(folder, "study.db") if kind == "sqlite" else None
    t0 = time.perf_counter()
    result = tune(
        **CASE,
        n_trials=n,
        sampler="random",
        trial_unit="strategy",
        use_recipes=False,
        seed=0,
        out=folder,
        storage=storage,
        progress=lambda done, total, best: stamps.append(time.perf_counter()),
    )
    wall = time.perf_counter() - t0
    tenth = max(1, len(stamps) // 10)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "n_trials": result.n_trials,
        "n_new": result.n_new_trials,
        "wall_s": wall,
        "search_s": result.timings.get("search_s", 0.0),
        "outputs_s": result.timings.get("outputs_s", 0.0),
        "first_ms": 1e3 * (stamps[tenth] - stamps[0]) / tenth if len(stamps) > tenth else None,
        "last_ms": 1e3 * (stamps[-1] - stamps[-1 - tenth]) / tenth
        if len(stamps) > tenth
        else None,
        "peak_rss_mb": peak / 1024,
        "base_rss_mb": base_rss / 1024,
    }


def run_child(kind: str, n: int, folder: str) -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", kind, str(n), folder],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def case(kind: str, n: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="storage_scale_") as folder:
        first = run_child(kind, n, folder)
        again = run_child(kind, n, folder)
    assert first["n_trials"] == n and again["n_new"] == 0, (first, again)
    grown = first["peak_rss_mb"] - first["base_rss_mb"]
    return {
        "storage": kind,
        "n_trials": n,
        "measured": True,
        "search_s": round(first["search_s"], 2),
        "ms_per_trial": round(1e3 * first["search_s"] / n, 3),
        "ms_per_trial_first": round(first["first_ms"], 3),
        "ms_per_trial_last": round(first["last_ms"], 3),
        "peak_rss_mb": round(first["peak_rss_mb"], 1),
        "kb_per_trial": round(1024 * grown / n, 2),
        "outputs_s": round(first["outputs_s"], 2),
        "rerun_s": round(again["wall_s"], 2),
        "rerun_outputs_s": round(again["outputs_s"], 2),
        "rerun_peak_rss_mb": round(again["peak_rss_mb"], 1),
        "note": "",
    }


def extrapolated(row: dict, n: int) -> dict:
    k = n / row["n_trials"]
    return {
        **{c: "" for c in COLUMNS},
        "storage": row["storage"],
        "n_trials": n,
        "measured": False,
        "search_s": round(row["search_s"] * k, 1),
        "ms_per_trial": row["ms_per_trial_last"],
        "note": f"NOT MEASURED: extrapolated linearly from {row['n_trials']} trials "
        f"(would take ~{row['search_s'] * k / 60:.0f} min, over the "
        f"{SQLITE_BUDGET_S / 60:.0f} min budget)",
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1000,10000,50000")
    p.add_argument("--kinds", default="journal,sqlite")
    p.add_argument("--out", default=os.path.join(ROOT, "results", "storage_scale.csv"))
    p.add_argument("--note", default="", help="added to every row (e.g. machine load)")
    p.add_argument("--child", nargs=3, metavar=("KIND", "N", "FOLDER"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        kind, n, folder = args.child
        print(json.dumps(child(kind, int(n), folder)))
        return 0
    sizes = [int(s) for s in args.sizes.split(",")]
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    try:
        load = os.getloadavg()[0]
        machine += f", load average {load:.1f} at start"
    except OSError:  # pragma: no cover
        pass
    rows = []
    for kind in args.kinds.split(","):
        for n in sizes:
            prev = [r for r in rows if r["storage"] == kind and r["measured"]]
            if kind == "sqlite" and prev:
                biggest = prev[-1]
                predicted = biggest["ms_per_trial_last"] * n / 1e3
                if predicted > SQLITE_BUDGET_S:
                    rows.append(extrapolated(biggest, n))
                    print(f"{kind:8} {n:>7,}  skipped: ~{predicted:.0f} s predicted")
                    continue
            row = case(kind, n)
            row["note"] = f"{args.note} {machine}".strip()
            rows.append(row)
            print(
                f"{kind:8} {n:>7,}  {row['ms_per_trial']:7.3f} ms/trial "
                f"(first 10% {row['ms_per_trial_first']:.3f}, last 10% "
                f"{row['ms_per_trial_last']:.3f})  peak {row['peak_rss_mb']:7.1f} MB "
                f"({row['kb_per_trial']:.1f} kB/trial)  outputs {row['outputs_s']:.1f} s  "
                f"no-op rerun {row['rerun_s']:.1f} s, {row['rerun_peak_rss_mb']:.0f} MB",
                flush=True,
            )
    for kind in args.kinds.split(","):
        measured = [r for r in rows if r["storage"] == kind and r["measured"]]
        if len(measured) >= 2:
            ratio = measured[-1]["ms_per_trial_last"] / measured[0]["ms_per_trial_last"]
            print(
                f"{kind}: per-trial cost x{ratio:.2f} from {measured[0]['n_trials']:,} to "
                f"{measured[-1]['n_trials']:,} trials (target: within x2)"
            )
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, lineterminator="\n")
        w.writeheader()
        for r in rows:
            w.writerow(r)
        f.write(f"# written {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
