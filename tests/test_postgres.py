"""A real PostgreSQL study: four `autosearch tune` workers at once on one study.

The test creates a throwaway database cluster (``initdb`` into a temporary folder, ``pg_ctl``
listening on a unix socket in that folder only, no TCP port), and tears it down afterwards, also
when the test fails. PostgreSQL refuses to run as root: under root the server runs as the
``postgres`` user (or ``nobody``) through ``runuser``. Skipped, with the reason printed, only
where the PostgreSQL binaries or the psycopg driver (``pip install -e '.[postgres]'``) are
missing.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import time

import pytest
from test_storage_concurrency import check_outputs_agree_with_storage, new_trials, run_workers

from autosearch.tuning import load_study


def _pg_bin() -> str | None:
    for folder in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if os.path.exists(os.path.join(folder, "initdb")):
            return folder
    found = shutil.which("initdb")
    return os.path.dirname(found) if found else None


def _as_server_user() -> tuple[list[str], str | None]:
    """The command prefix that runs the server unprivileged, and that user's name."""
    if os.geteuid() != 0:
        return [], None
    runuser = shutil.which("runuser")
    for user in ("postgres", "nobody"):
        try:
            pwd.getpwnam(user)
        except KeyError:
            continue
        if runuser:
            return [runuser, "-u", user, "--"], user
    pytest.skip("running as root without runuser and a postgres/nobody user to run the server")


@pytest.fixture
def postgres_url():
    bindir = _pg_bin()
    if bindir is None:
        reason = "PostgreSQL binaries (initdb, pg_ctl) not found; apt-get install postgresql"
        print(f"SKIPPED: {reason}")
        pytest.skip(reason)
    try:
        import psycopg  # noqa: F401
    except ImportError:
        reason = "the psycopg driver is not installed; pip install -e '.[postgres]'"
        print(f"SKIPPED: {reason}")
        pytest.skip(reason)
    prefix, user = _as_server_user()
    # Not pytest's tmp_path: its parents are private to root, and the server runs as `user`.
    folder = tempfile.mkdtemp(prefix="autosearch-pg-")
    data = os.path.join(folder, "data")
    if user is not None:
        entry = pwd.getpwnam(user)
        os.chown(folder, entry.pw_uid, entry.pw_gid)

    def run(*cmd: str) -> None:
        subprocess.run([*prefix, *cmd], check=True, capture_output=True, timeout=120)

    started = False
    try:
        run(f"{bindir}/initdb", "-D", data, "-A", "trust", "-U", "autosearch", "--no-sync")
        options = f"-k {folder} -c listen_addresses='' -c max_connections=50"
        log = os.path.join(folder, "server.log")
        run(f"{bindir}/pg_ctl", "-D", data, "-o", options, "-l", log, "-w", "start")
        started = True
        yield f"postgresql+psycopg://autosearch@/postgres?host={folder}"
    finally:
        if started:
            subprocess.run(
                [*prefix, f"{bindir}/pg_ctl", "-D", data, "-m", "immediate", "stop"],
                capture_output=True,
                timeout=120,
            )
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.slow
def test_four_workers_share_one_postgresql_study(postgres_url, tmp_path):
    out = tmp_path / "shared"
    n_trials = 60
    args = ["--model", "llama3-8b", "--cluster", "h100-sxm:2x8", "--global-batch-size", "64"]
    args += ["--trial-unit", "strategy", "--n-trials", str(n_trials), "--study-name", "pg"]
    args += ["--storage", postgres_url, "--out", str(out)]
    t0 = time.perf_counter()
    outs = run_workers(args)
    seconds = time.perf_counter() - t0
    trials = load_study("pg", storage=postgres_url).study.get_trials(deepcopy=False)
    numbers = sorted(t.number for t in trials)
    assert numbers == list(range(n_trials))  # as many as asked, none duplicated nor lost
    assert all(t.state.name == "COMPLETE" for t in trials)
    assert sum(new_trials(o) for o in outs) == n_trials
    print(
        f"PostgreSQL: {len(outs)} workers, {n_trials} trials, {seconds:.1f} s, "
        f"{len({t.user_attrs['worker'] for t in trials})} workers stored trials"
    )
    check_outputs_agree_with_storage(out, trials)  # the best equals the max over trials
