"""Storage integrity: the journal repairs a torn tail and names damage, locks never go stale or
follow links, writes are atomic, names stay names, and one folder holds one study."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import warnings

import pytest

from autosearch import SpecError, tune
from autosearch.tuning import (
    FileLock,
    StudyMeta,
    StudyOptions,
    atomic_write,
    load_study,
    open_study_storage,
)
from autosearch.tuning._journal import JournalFile, TornJournalWarning

SMALL = dict(model="llama3-8b", cluster="h100-sxm:2x8", global_batch_size=64)
FAST = dict(sampler="random", trial_unit="strategy", use_recipes=False)


def _trials(path):
    loaded = load_study(path)
    return loaded.study.get_trials(deepcopy=False)


# ---- the journal ------------------------------------------------------------------------------
def test_a_torn_last_line_is_ignored_then_cut_off_and_the_study_resumes(tmp_path):
    out = tmp_path / "run"
    tune(**SMALL, n_trials=8, seed=0, out=out, **FAST)
    journal = out / "study.journal"
    intact = journal.read_bytes()
    # a writer killed mid-append: half a record, no newline
    last = intact.rstrip(b"\n").rsplit(b"\n", 1)[1]
    journal.write_bytes(intact + last[: len(last) // 2])
    with pytest.warns(TornJournalWarning, match="cut short"):
        assert len(_trials(out)) == 8
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TornJournalWarning)
        again = tune(**SMALL, n_trials=12, seed=1, out=out, **FAST)
    assert (again.n_trials, again.n_new_trials) == (12, 4)
    data = journal.read_bytes()
    assert data.startswith(intact) and data.endswith(b"\n")
    for line in data.splitlines():  # every line is a whole record: nothing glued on
        assert "op_code" in json.loads(line)
    numbers = sorted(t.number for t in _trials(out))
    assert numbers == list(range(12))


def test_damage_in_the_middle_names_the_file_and_line_and_how_to_recover(tmp_path):
    out = tmp_path / "run"
    tune(**SMALL, n_trials=6, seed=0, out=out, **FAST)
    journal = out / "study.journal"
    lines = journal.read_bytes().splitlines(keepends=True)
    lines[3] = b'{"op_code": 5, "trial_id": 0, "va\xff garbage\n'
    journal.write_bytes(b"".join(lines))
    with pytest.raises(SpecError) as info:
        tune(**SMALL, n_trials=6, seed=0, out=out, **FAST)
    message = str(info.value)
    assert f"{journal}, line 4" in message and "head -n 3" in message
    assert "repaired.journal" in message
    # the recovery the message gives works
    (tmp_path / "repaired.journal").write_bytes(b"".join(lines[:3]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about: the prefix is intact
        backend = JournalFile(tmp_path / "repaired.journal")
        assert len(list(backend.read_logs(0))) == 3


def test_valid_json_that_is_not_a_record_is_damage_too(tmp_path):
    path = tmp_path / "x.journal"
    path.write_text('{"op_code": 0, "study_name": "s", "directions": [1]}\n[1, 2]\n')
    with pytest.raises(SpecError, match=r"line 2: not a journal record \(valid JSON"):
        list(JournalFile(path).read_logs(0))


def test_reads_are_incremental(tmp_path):
    """A worker that keeps its storage object reads each record once (the per-trial cost does
    not grow with the study): reading from record k starts at its byte offset."""
    path = tmp_path / "x.journal"
    backend = JournalFile(path)
    backend.append_logs([{"op_code": 99, "i": i} for i in range(100)])
    assert [r["i"] for r in backend.read_logs(0)] == list(range(100))
    backend.append_logs([{"op_code": 99, "i": 100}])
    with open(path, "r+b") as f:  # corrupt an early record: an incremental read never sees it
        f.write(b"X")
    assert [r["i"] for r in backend.read_logs(100)] == [100]


# ---- locks and writes -------------------------------------------------------------------------
def test_a_lock_held_by_a_killed_process_is_free_at_once(tmp_path):
    """Optuna's symbolic-link lock outlives a kill (the next run waited ~30 s); flock does not."""
    import fcntl

    lock = tmp_path / "x.flock"
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from autosearch.tuning import FileLock\n"
            f"l = FileLock({str(lock)!r}); l.acquire(); print('held', flush=True)\n"
            "sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout.readline().strip() == "held"
    fd = os.open(lock, os.O_RDWR)
    try:
        with pytest.raises(BlockingIOError):  # really held by the child
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        child.send_signal(signal.SIGKILL)
        child.wait()
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free without waiting
    finally:
        os.close(fd)


def test_locks_never_follow_a_symbolic_link(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "run"
    out.mkdir()
    os.symlink(victim, out / ".lock")
    with pytest.raises(SpecError, match="autosearch did not write"):  # not a folder of ours
        tune(**SMALL, n_trials=3, seed=0, out=out, **FAST)
    (out / ".autosearch").write_text("written by autosearch: study\n")  # ours: the lock's turn
    with pytest.raises(SpecError, match="is a symbolic link"):
        tune(**SMALL, n_trials=3, seed=0, out=out, **FAST)
    assert victim.read_text() == "precious"
    with pytest.raises(SpecError, match="is a symbolic link"):
        FileLock(out / ".lock").acquire()


def test_atomic_write_replaces_whole_and_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "a.txt"
    atomic_write(path, "one")
    atomic_write(path, b"two")
    atomic_write(path, lambda tmp: open(tmp, "w").write("three"))
    assert path.read_text() == "three" and os.listdir(tmp_path) == ["a.txt"]
    with pytest.raises(RuntimeError):  # a writer that fails leaves the old file and no temp
        atomic_write(path, lambda tmp: (_ for _ in ()).throw(RuntimeError("boom")))
    assert path.read_text() == "three" and os.listdir(tmp_path) == ["a.txt"]
    (tmp_path / "d").mkdir()
    with pytest.raises(SpecError, match="is a folder"):
        atomic_write(tmp_path / "d", "x")


def test_temporary_files_of_killed_writers_are_removed(tmp_path):
    """Temporary names carry their writer's pid: those of dead processes are removed, a write
    in progress in a live process (here: this one) is left alone."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    out = tmp_path / "run"
    out.mkdir()
    (out / ".autosearch").write_text("written by autosearch: study\n")  # a folder of tune's
    stale = [f".autosearch-{dead.pid}-trials.csv.abc123.tmp", f"report.md.tmp{dead.pid}"]
    stale.append(f"x.png.tmp{dead.pid}.png")
    live = f"notes.sh.tmp{os.getpid()}"  # not a name tune writes itself (megatron.sh is one)
    for name in [*stale, live]:
        (out / name).write_text("torn")
    (out / "study.journal.lock0f3e.rename").write_text("")  # Optuna's lock, killed mid-release
    tune(**SMALL, n_trials=3, seed=0, out=out, **FAST)
    left = sorted(os.listdir(out))
    assert not [n for n in left if n in stale or n.endswith(".rename")], left
    assert live in left


# ---- names and folders -------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["../../x", "/etc/passwd", "a/b", ".hidden", "", "x" * 201])
def test_a_study_name_is_never_a_path(tmp_path, name):
    with pytest.raises(SpecError, match="study name"):
        tune(**SMALL, n_trials=3, out=tmp_path / "run", study_name=name, **FAST)
    assert not (tmp_path / "run").exists() and sorted(os.listdir(tmp_path)) == []


def test_outputs_of_different_studies_never_overwrite_each_other(tmp_path):
    out = tmp_path / "run"
    tune(**SMALL, n_trials=4, seed=0, out=out, **FAST)
    before = (out / "trials.csv").read_bytes()
    with pytest.raises(SpecError, match="holds the outputs of study") as info:
        tune("llama3-8b", "h100-sxm:1x8", global_batch_size=64, n_trials=4, out=out, **FAST)
    assert "--out" in str(info.value) and "results/llama3-8b_h100-sxm-1x8" in str(info.value)
    assert (out / "trials.csv").read_bytes() == before
    # the same study continues in its folder
    assert tune(**SMALL, n_trials=6, seed=1, out=out, **FAST).n_trials == 6


def test_storage_options_object_and_keywords(tmp_path):
    opts = StudyOptions(out=tmp_path / "run", study_name="mine")
    result = tune(**SMALL, n_trials=3, seed=0, options=opts, **FAST)
    loaded = load_study(tmp_path / "run")
    assert loaded.study.study_name == "mine" and result.n_trials == 3
    assert loaded.meta == StudyMeta.from_dict(loaded.meta.to_dict())
    assert loaded.meta.model == "llama3-8b" and loaded.meta.load_cluster().world_size == 16
    assert [c.strategy for c in loaded.candidates(top_k=2)] == [
        c.strategy for c in result.top_k[:2]
    ]
    with pytest.raises(SpecError, match="given both in options and as keywords"):
        tune(**SMALL, n_trials=3, options=opts, study_name="other", **FAST)


# ---- files that are not storages ---------------------------------------------------------------
def test_bad_storages_are_one_clear_message(tmp_path):
    bad_db = tmp_path / "bad.db"
    bad_db.write_bytes(b"this is not a database" * 100)
    with pytest.raises(SpecError, match="cannot open SQLite file"):
        open_study_storage(bad_db)
    with pytest.raises(SpecError, match="scheme 'foo' is not a database"):
        open_study_storage("foo://bar")
    (tmp_path / "dir.journal").mkdir()
    with pytest.raises(SpecError, match="is a folder"):
        open_study_storage(tmp_path / "dir.journal")


def test_sqlite_resumes_and_counts_exactly(tmp_path):
    db = tmp_path / "study.db"
    tune(**SMALL, n_trials=5, seed=0, storage=db, **FAST)
    again = tune(**SMALL, n_trials=7, seed=1, storage=f"sqlite:///{db}", **FAST)
    assert (again.n_new_trials, again.n_trials) == (2, 7)


def test_exhaustive_strategy_units_cover_the_space_once_across_batches(tmp_path, monkeypatch):
    import autosearch.tuning._study as study_module
    from search_spaces import SearchSpace

    monkeypatch.setattr(study_module, "EXHAUSTIVE_BATCH", 50)  # many turns of the study lock
    space = SearchSpace(
        "llama3-8b", "h100-sxm:1x8", global_batch_size=32, config="megatron", amp="bf16"
    )
    assert space.size > 3 * 50
    result = tune(
        space.model,
        space.cluster,
        global_batch_size=32,
        space=space,
        sampler="exhaustive",
        trial_unit="strategy",
        n_trials=None,
        storage=tmp_path / "s.journal",
    )
    params = {tuple(sorted(t.params.items())) for t in result.study.get_trials()}
    assert result.n_trials == len(params) == space.size == result.n_units_covered


def test_exhaustive_search_flushes_the_journal_once_per_batch_and_loses_nothing(
    tmp_path, monkeypatch
):
    """One fsync per EXHAUSTIVE_BATCH trials (not per trial), and every unit stored whole."""
    import autosearch.tuning._journal as journal_module
    import autosearch.tuning._study as study_module
    from search_spaces import SearchSpace

    calls = []
    real_fsync = os.fsync
    monkeypatch.setattr(journal_module.os, "fsync", lambda fd: (calls.append(fd), real_fsync(fd)))
    monkeypatch.setattr(study_module, "EXHAUSTIVE_BATCH", 16)
    space = SearchSpace("llama3-8b", "h100-sxm:2x8", global_batch_size=64)
    storage = tmp_path / "s.journal"
    result = tune(
        space.model, space.cluster, global_batch_size=64, sampler="exhaustive", storage=storage
    )
    n = space.n_groups
    assert result.n_trials == result.n_units_covered == n
    study_writes = 2  # creating the study and its metadata (flushed one by one)
    assert len(calls) <= study_writes + -(-n // 16)
    # another reader sees every trial, whole, with its report
    trials = load_study(result.study.study_name, storage=str(storage)).study.get_trials()
    assert len(trials) == n and all("report" in t.user_attrs for t in trials)


def test_random_sampling_keeps_exact_counts_across_shadow_renewals(tmp_path, monkeypatch):
    """The sampler's in-memory copy is renewed every SHADOW_RENEW trials (random sampling reads
    no history): the study still ends with exactly the trials asked, each stored once."""
    import autosearch.tuning._study as study_module

    monkeypatch.setattr(study_module, "SHADOW_RENEW", 10)  # renewed 5 times in 60 trials
    storage = tmp_path / "s.journal"
    result = tune(**SMALL, n_trials=60, seed=0, storage=storage, **FAST)
    trials = load_study(result.study.study_name, storage=str(storage)).study.get_trials()
    assert result.n_trials == len(trials) == 60
    assert sorted(t.number for t in trials) == list(range(60))


def test_a_stored_value_edited_by_hand_is_rescored_not_trusted(tmp_path):
    """Issue 35: a journal whose stored objective of one trial was multiplied by 1000 by hand:
    the resumed study warns (RescoredTrialWarning, naming the trial) and ranks the trial by
    what its strategy scores now, so the best stays the real best."""
    from autosearch.tuning._study import RescoredTrialWarning

    journal = tmp_path / "s.journal"
    args = dict(global_batch_size=64, n_trials=12, sampler="random", storage=str(journal))
    first = tune("llama3-8b", "h100-sxm:1x8", **args)
    lines = journal.read_text().splitlines()
    scored = [(i, json.loads(ln)) for i, ln in enumerate(lines) if '"value":' in ln]
    i, record = min(((i, r) for i, r in scored if r.get("value")), key=lambda ir: ir[1]["value"])
    record["value"] *= 1000
    lines[i] = json.dumps(record)
    journal.write_text("\n".join(lines) + "\n")
    with pytest.warns(RescoredTrialWarning, match="1 trial"):
        again = tune("llama3-8b", "h100-sxm:1x8", **args)
    assert again.best_strategy == first.best_strategy
    assert again.best_report.tokens_per_s == pytest.approx(first.best_report.tokens_per_s)
