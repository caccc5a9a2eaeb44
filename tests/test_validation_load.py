"""Validation on a loaded machine: the load is read before the runs and recorded with each,
threads per process fit the cores others leave free, and a run taken under load says so.

No wall-clock time is asserted: a busy loop started here is the load; what is checked is what
validate decides and records because of it.
"""

import subprocess
import sys

import pandas as pd
import pytest

from autosearch import ModelSpec, Strategy
from autosearch.validation import validate
from autosearch.validation._validate import threads_for
from cost_models.calibration.machine import UNDER_LOAD_SHARE, Load, cpu_cores, read_load

SPEC = ModelSpec.load("tiny-gpt").scaled(n_layers=2, seq_len=64)
S1 = Strategy(micro_batch_size=2, global_batch_size=4, amp="fp32")


def test_threads_fit_in_the_cores_others_leave_free():
    quiet, busy = Load(cores=2, other_cores=0.05), Load(cores=2, other_cores=1.0)
    assert not quiet.loaded and busy.loaded and busy.free_cores() == 1
    assert threads_for(1, None, quiet) == (2, "")  # a single process uses both cores
    threads, note = threads_for(1, None, busy)
    assert threads == 1 and "1 per process, not 2" in note and "1.0 of 2 cores busy" in note
    threads, note = threads_for(4, None, quiet)  # more processes than cores: 1 thread each
    assert threads == 1 and "4 processes oversubscribe the 2 free core(s)" in note
    threads, note = threads_for(2, 2, quiet)  # asked for: kept, and warned
    assert threads == 2 and "oversubscribe" in note and "kept as asked" in note
    assert threads_for(1, 1, busy) == (1, "")
    # without /proc/stat the load average stands in (an upper bound: it counts this process too)
    assert Load(cores=4, other_cores=None, load_average=3.2).threads_per_process(1) == 1


def test_the_load_read_before_measuring_counts_other_processes():
    """A busy loop keeps about one core busy: read_load sees it as other processes' CPU time
    (this process sleeps while it reads)."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        load = read_load(1.0)
    finally:
        busy.kill()
        busy.wait()
    assert load.cores == cpu_cores() and load.other_cores is not None
    assert load.other_cores >= 0.5 and load.loaded


@pytest.mark.skipif(cpu_cores() < 2, reason="needs a free core besides the busy one")
def test_a_run_on_a_loaded_machine_uses_the_free_cores_and_is_marked(tmp_path, capsys):
    """Half the cores kept busy (one of two) while a one-process candidate runs: it runs with
    fewer threads than cores (one of two), validation.csv records the load before and during
    the run and under_load, and the printed lines warn before the run and mark its result."""
    cores = cpu_cores()
    busy = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(max(1, cores // 2))
    ]
    try:
        result = validate(SPEC, [S1], steps=2, warmup=1, timeout_s=240, out=tmp_path)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    printed = capsys.readouterr().out
    row = result.table.iloc[0]
    assert row.status == "ok", row.reason
    assert row.threads < cores and f"{row.threads} per process, not {cores}" in printed
    assert row.cores == cores and row.other_busy_cores_before >= 0.5 * len(busy)
    assert row.other_busy_cores > UNDER_LOAD_SHARE * row.cores and bool(row.under_load)
    assert "validate: WARNING load: other processes keep" in printed
    assert "UNDER LOAD: other processes kept" in printed
    csv = pd.read_csv(tmp_path / "validation.csv")
    for column in (
        "load_average_before",
        "load_average_after",
        "other_busy_cores_before",
        "other_busy_cores",
        "under_load",
        "cores",
    ):
        assert column in csv.columns
    assert bool(csv.under_load[0])
