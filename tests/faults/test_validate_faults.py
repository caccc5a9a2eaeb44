"""Kill `autosearch validate` at several points (SIGKILL, SIGTERM, Ctrl-C's SIGINT): no process it
started is left (found by an environment marker in /proc, whichever session torchrun put them in),
no temporary folder is left, and validation.csv holds every candidate that finished, whole.

Candidate 0 trains the tiny model in one process (it finishes); candidate 1 runs under torchrun
with two ranks that wait to be killed (tests/validation_factories.py:fault_point).
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml
from procscan import kill_marked, marked, new_mark, wait_until_gone

from autosearch import ModelSpec, Strategy

TESTS = Path(__file__).resolve().parent.parent
FACTORY = f"{TESTS / 'validation_factories.py'}:fault_point"
SPEC = ModelSpec.load("tiny-gpt").scaled(n_layers=2, seq_len=64)
ONE = Strategy(micro_batch_size=2, global_batch_size=4, amp="fp32")
TWO = Strategy(dp=2, micro_batch_size=2, global_batch_size=4, amp="fp32")


def _wait_for(condition, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


# (signal, point): "first" = candidate 0 running in one process; "launch" = candidate 1's
# torchrun just started; "ranks" = both ranks of candidate 1 alive and waiting.
CASES = [
    (signal.SIGKILL, "first"),
    (signal.SIGKILL, "launch"),
    (signal.SIGKILL, "ranks"),
    (signal.SIGTERM, "ranks"),
    (signal.SIGINT, "ranks"),
]


@pytest.mark.slow
@pytest.mark.parametrize("sig,point", CASES, ids=[f"{s.name}-{p}" for s, p in CASES])
def test_killing_validate_leaves_nothing_behind(tmp_path, sig, point):
    mark = new_mark()
    tmp, ready, out = tmp_path / "tmp", tmp_path / "ready", tmp_path / "out"
    for d in (tmp, ready):
        d.mkdir()
    model = tmp_path / "tiny.yaml"
    model.write_text(yaml.safe_dump({**SPEC.to_dict(), "name": "tiny-faults"}))
    strategies = []
    for i, s in enumerate((ONE, TWO)):
        strategies.append(str(tmp_path / f"s{i}.yaml"))
        s.to_yaml(strategies[-1])
    env = {**os.environ, **mark, "TMPDIR": str(tmp), "FAULT_READY_DIR": str(ready)}
    cmd = [
        sys.executable,
        "-m",
        "autosearch",
        "validate",
        "--strategies",
        *strategies,
        "--model",
        str(model),
        "--steps",
        "1",
        "--warmup",
        "0",
        "--timeout-s",
        "300",
        "--factory",
        FACTORY,
        "--out",
        str(out),
    ]
    proc = subprocess.Popen(
        cmd,
        env=env,
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        run0, run1 = out / f"run000_{ONE.short()}", out / f"run001_{TWO.short()}"
        if point == "first":  # validate, the supervisor, the rank's guard and the rank
            _wait_for(lambda: run0.exists() and len(marked(mark)) >= 4, 120, "candidate 0")
        elif point == "launch":
            _wait_for(lambda: (run1 / "config.json").exists(), 180, "candidate 1's launch")
        else:
            _wait_for(lambda: len(os.listdir(ready)) == 2, 300, "both ranks of candidate 1")
        alive = len(marked(mark))
        proc.send_signal(sig)
        code = proc.wait(timeout=60)
        left = wait_until_gone(mark, 20)
    finally:
        kill_marked(mark)
        proc.kill()
    expected = {signal.SIGKILL: -9, signal.SIGTERM: 128 + 15, signal.SIGINT: 130}[sig]
    assert code == expected, proc.stderr.read()[-2000:]
    assert left == [], f"{len(left)} of {alive} processes left"
    assert list(tmp.iterdir()) == []  # torchrun's and the workers' temporary folders went too
    finished = 0 if point == "first" else 1
    csv = out / "validation.csv"
    assert not (out / "validation.csv.partial").exists()
    if finished:
        table = pd.read_csv(csv)
        assert list(table.status) == ["ok"] and table.measured_step_time_s[0] > 0
    else:
        assert not csv.exists()
