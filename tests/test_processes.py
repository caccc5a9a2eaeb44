"""The process-group owner (autosearch/core/processes.py): every process it started ends and is
reaped, whether the commands finish, fail, time out, or the owner is interrupted or killed.

Processes are found by an environment marker in /proc (tests/procscan.py), which follows them
into the sessions of their own that `setsid` (and torchrun, for its workers) gives them.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from procscan import kill_marked, marked, new_mark, wait_until_gone

from autosearch.core.processes import (
    Exit,
    ProcessGroup,
    ProcessTimeout,
    clean_env,
    free_port,
    run,
)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def mark():
    m = new_mark()
    yield m
    kill_marked(m)


def test_exit_statuses_and_signal_names():
    exits = run([["true"], ["sh", "-c", "exit 3"]], timeout_s=30, fail_fast=False)
    assert [e.returncode for e in exits] == [0, 3]
    (segv,) = run([["sh", "-c", "kill -SEGV $$"]], timeout_s=30)
    assert segv.returncode == -signal.SIGSEGV and segv.signal_name == "SIGSEGV"
    assert Exit(returncode=-9).signal_name == "SIGKILL" and Exit(returncode=1).signal_name is None
    (missing,) = run([["no-such-command-here"]], timeout_s=30)
    assert missing.returncode == 127


def test_timeout_ends_grandchildren_in_sessions_of_their_own(mark, tmp_path):
    env = {**os.environ, **mark}
    # setsid: a grandchild in a new session, out of reach of killpg (torchrun's workers are so)
    cmd = ["sh", "-c", "setsid sleep 300 & sleep 300"]
    with pytest.raises(ProcessTimeout, match="not done after 1 s"):
        run([cmd], envs=env, timeout_s=1, grace_s=1)
    assert wait_until_gone(mark, 5) == []


def test_fail_fast_stops_the_others(mark):
    env = {**os.environ, **mark}
    with ProcessGroup([["sh", "-c", "exit 2"], ["sleep", "300"]], envs=env, timeout_s=60) as g:
        first, second = g.wait()
    assert first.returncode == 2 and second.returncode == -signal.SIGTERM
    assert marked(mark) == []


def test_children_get_a_clean_environment_and_a_private_tmp(tmp_path):
    dump = tmp_path / "env.txt"
    torchrun_env = {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "MASTER_PORT": "29500",
        "PET_NNODES": "1",
        "TORCHELASTIC_RUN_ID": "x",
        "KEEP_ME": "yes",
        "PATH": os.environ["PATH"],
    }
    with ProcessGroup(
        [["sh", "-c", f"env > {dump}; test -d $TMPDIR"]], envs=torchrun_env, timeout_s=30
    ) as g:
        (e,) = g.wait()
        private = g.tmp
    env = dict(line.split("=", 1) for line in dump.read_text().splitlines() if "=" in line)
    assert e.returncode == 0 and env["KEEP_ME"] == "yes" and env["TMPDIR"] == private
    assert not {"RANK", "WORLD_SIZE", "MASTER_PORT", "PET_NNODES", "TORCHELASTIC_RUN_ID"} & set(
        env
    )
    assert not os.path.exists(private)
    assert "RANK" not in clean_env({"RANK": "0", "HOME": "/x"})
    assert 0 < free_port() < 65536


OWNER = textwrap.dedent(
    """
    import sys, time
    from autosearch.core.processes import ProcessGroup
    with ProcessGroup([["sh", "-c", "setsid sleep 300 & sleep 300"], ["sleep", "300"]],
                      timeout_s=600, grace_s=1, remove=[sys.argv[1]]) as g:
        print(g.tmp, flush=True)
        g.wait()
    """
)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_killing_the_owner_ends_every_process_and_removes_the_temporary_folders(
    mark, tmp_path, sig
):
    """SIGKILL is the hard case: the owner runs no code, the supervisor sees its pipe close."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(scratch)],
        cwd=ROOT,
        env={**os.environ, **mark},
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    private = owner.stdout.readline().strip()
    deadline = time.monotonic() + 30  # the two sleeps and the setsid one: 3 + sh + supervisor
    while len(marked(mark)) < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(marked(mark)) >= 5
    owner.send_signal(sig)
    code = owner.wait(timeout=30)
    assert (
        code == {signal.SIGKILL: -9, signal.SIGTERM: 143, signal.SIGINT: -2}[sig]
    )  # Python re-raises SIGINT
    assert wait_until_gone(mark, 15) == []
    assert private and not os.path.exists(private) and not scratch.exists()


def test_temporary_folders_live_until_the_group_is_left(tmp_path):
    """What the commands write in a folder given to `remove` (or in TMPDIR) can be read after
    `wait`; leaving the block removes it. A launcher that sets RANK itself keeps it
    (clean=False)."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    env = {**os.environ, "RANK": "3"}
    cmd = ["sh", "-c", f'echo "$RANK" > {scratch}/out.txt; echo x > "$TMPDIR/t"']
    with ProcessGroup([cmd], envs=env, remove=[scratch], timeout_s=30, clean=False) as g:
        (e,) = g.wait()
        assert e.returncode == 0 and (scratch / "out.txt").read_text() == "3\n"
        assert os.path.exists(os.path.join(g.tmp, "t"))
    assert not scratch.exists() and not os.path.exists(g.tmp)


OPEN_ONLY = textwrap.dedent(
    """
    import time
    from autosearch.core.processes import ProcessGroup
    with ProcessGroup(timeout_s=60) as g:  # opened: the folder exists, no command started yet
        print(g.tmp, flush=True)
        time.sleep(300)
    """
)


def test_an_owner_killed_before_starting_its_commands_leaves_no_folder(mark, tmp_path):
    owner = subprocess.Popen(
        [sys.executable, "-c", OPEN_ONLY],
        cwd=ROOT,
        env={**os.environ, **mark},
        stdout=subprocess.PIPE,
        text=True,
    )
    private = owner.stdout.readline().strip()
    assert private and os.path.isdir(private)
    owner.kill()
    owner.wait(timeout=30)
    assert wait_until_gone(mark, 15) == []  # the supervisor too
    assert not os.path.exists(private)


def test_open_then_start_with_files_written_first(tmp_path):
    with ProcessGroup(timeout_s=30) as group:
        plan = os.path.join(group.tmp, "plan.txt")
        with open(plan, "w") as f:
            f.write("7")
        group.start([["sh", "-c", f'test "$(cat {plan})" = 7']])
        (e,) = group.wait()
    assert e.returncode == 0 and not os.path.exists(plan)


MANY = textwrap.dedent(
    """
    import os, signal, sys
    from autosearch.core.processes import ProcessGroup
    log = sys.argv[1]
    g = ProcessGroup([["sh", "-c", f"echo x >> {log}; exec sleep 300"]] * 5000, timeout_s=600)
    g.open()
    print(g._proc.pid, flush=True)
    g.start()
    while not os.path.exists(log):  # the first workers are starting
        pass
    if sys.argv[2] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)  # the owner dies while its workers start
    elif sys.argv[2] == "close":
        g.stop()  # Ctrl-C in the owner: the block is left, the pipe closes
    else:
        g.wait()
    """
)


@pytest.mark.parametrize("how", ["kill", "close", "signal"])
def test_the_supervisor_stops_starting_workers_when_its_owner_goes(mark, tmp_path, how):
    """5,000 workers asked for; the owner dies (SIGKILL), leaves (closes the pipe, as Ctrl-C
    does), or the supervisor gets SIGTERM while it starts them: starting stops there (far fewer
    than 5,000 ever started, each start being a fork), and every worker started ends."""
    log = tmp_path / "started.log"
    owner = subprocess.Popen(
        [sys.executable, "-c", MANY, str(log), "stay" if how == "signal" else how],
        cwd=ROOT,
        env={**os.environ, **mark},
        stdout=subprocess.PIPE,
        text=True,
    )
    supervisor = int(owner.stdout.readline())
    if how == "signal":
        while not log.exists():
            time.sleep(0.001)
        os.kill(supervisor, signal.SIGTERM)
    owner.wait(timeout=120)
    assert wait_until_gone(mark, 60) == []
    started = len(log.read_text().splitlines()) if log.exists() else 0
    assert started < 5000, f"{started} of 5000 workers started after the owner went"
    print(f"workers started before the stop ({how}): {started} of 5000")
