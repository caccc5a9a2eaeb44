"""One owner for the processes a command starts: they all end, and are reaped, when the owner is
done, times out, is interrupted, or dies (even by SIGKILL), and its temporary folders go with them.

How. `ProcessGroup` starts a small supervisor (this file run as a script, standard library only)
in a session of its own and keeps a pipe to it open. The supervisor first makes the group's
private temporary folder (so that no moment exists where the owner could die and leave a folder
nobody owns), then starts the commands the owner sends. It is a child
subreaper (Linux ``prctl(PR_SET_CHILD_SUBREAPER)``), so every process they start stays its
descendant, even torchrun's workers, which run in sessions of their own, and even after their
parent died. It ends everything when the commands are done, when one fails (``fail_fast``), or
when the pipe closes: the owner finished, timed out, caught SIGINT/SIGTERM, or was killed and the
kernel closed its end. Ending is SIGTERM to every descendant, a grace period, then SIGKILL; every
child is reaped before the supervisor reports the exit statuses (with each command's peak
resident memory). The temporary folders stay until the owner releases the group (closes the
pipe, by leaving the ``with`` block or by dying), so that it can read what the commands left
there; then the supervisor removes them and exits.

Written by hand because no library does it: `subprocess` reaps one child and kills nothing when
the parent dies; ``start_new_session`` + ``killpg`` miss processes that start sessions of their
own (torchrun's workers do); `multiprocessing` and psutil have no owner that survives SIGKILL.

The children also get a clean environment: the variables torchrun gives its workers (RANK,
WORLD_SIZE, MASTER_PORT, TORCHELASTIC_*, ...) are removed (`clean_env`), so a job started from
inside a distributed job does not join that job's rendezvous, and TMPDIR points to a private
temporary folder that is removed with the group.

Example:
    >>> from autosearch.core.processes import ProcessGroup
    >>> with ProcessGroup([["true"], ["sh", "-c", "exit 3"]], timeout_s=30) as group:
    ...     exits = group.wait()
    >>> [e.returncode for e in exits]
    [0, 3]
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# The variables torch.distributed.run sets for its workers, and the ones it reads its own options
# from (PET_*): a child launch must not inherit them from a job it was started in.
DISTRIBUTED_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
)
DISTRIBUTED_ENV_PREFIXES = ("TORCHELASTIC_", "PET_")

PROC_TABLE = os.path.isdir("/proc/self")  # Linux: every descendant can be found
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


class ProcessTimeout(TimeoutError):
    """The commands did not finish in time; they were stopped."""


@dataclass(frozen=True, kw_only=True)
class Exit:
    """How one command ended.

    Attributes:
        returncode: exit status, negative for a signal (as `subprocess` reports it); None if it
            never ended by itself (it was stopped by the owner).
        max_rss_bytes: peak resident memory of the command's own process (not its children).
    """

    returncode: int | None
    max_rss_bytes: int = 0

    @property
    def signal_name(self) -> str | None:
        """``"SIGSEGV"`` for a command killed by a signal, else None."""
        if self.returncode is None or self.returncode >= 0:
            return None
        return signal_name(-self.returncode)


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def clean_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of `env` (default: this process's) without torchrun's distributed variables."""
    env = dict(os.environ if env is None else env)
    return {
        k: v
        for k, v in env.items()
        if k not in DISTRIBUTED_ENV and not k.startswith(DISTRIBUTED_ENV_PREFIXES)
    }


def free_port() -> int:
    """A TCP port free on the loopback interface now (the OS picks it)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send `sig` to this process when its parent ends (Linux
    ``prctl(PR_SET_PDEATHSIG)``); False where that is unavailable. Call it in the child right
    after fork (from a single-threaded parent), then check that ``os.getppid()`` is still the
    parent: one that died before the call sends nothing."""
    return _prctl(PR_SET_PDEATHSIG, sig)


class ProcessGroup:
    """Start commands under one owner, wait with a timeout, and always end and reap them all.

    Args:
        commands: argument lists, started together.
        envs: one environment for all commands, or one per command (default: this process's);
            either way without torchrun's distributed variables (`clean_env`), and with TMPDIR
            set to a private folder removed at the end.
        cwd: working folder of the commands.
        logs: a file per command receiving its stdout and stderr (default: /dev/null).
        timeout_s: `wait` stops the commands and raises `ProcessTimeout` after this long.
        grace_s: seconds between SIGTERM and SIGKILL when stopping.
        fail_fast: stop the others as soon as one command exits with a non-zero status.
        remove: more paths (files or folders) removed when the group is stopped (the block
            is left) or its owner dies.
        clean: remove torchrun's distributed variables from the environments (default); False
            keeps the environments as given (a launcher that sets RANK etc. itself, over
            `clean_env()`).

    Use it as a context manager: leaving the block, normally or by an exception (KeyboardInterrupt
    included), stops everything. While the block runs in the main thread, SIGTERM raises
    ``SystemExit(143)`` so that the block is left the same way. Without commands, the block
    opens the group only: write the commands' input files into ``group.tmp``, then call
    ``group.start(commands)``.
    """

    def __init__(
        self,
        commands: Sequence[Sequence[str]] = (),
        *,
        envs: Mapping[str, str] | Sequence[Mapping[str, str]] | None = None,
        cwd: str | os.PathLike | None = None,
        logs: Sequence[str | os.PathLike] | None = None,
        timeout_s: float | None = None,
        grace_s: float = 5.0,
        fail_fast: bool = True,
        remove: Sequence[str | os.PathLike] = (),
        clean: bool = True,
    ) -> None:
        self.commands: list[list[str]] = []
        self.envs: list[Mapping[str, str] | None] = []
        self.logs: list[str] | None = None
        self._set_commands(commands, envs, logs)
        self.cwd = os.fspath(cwd) if cwd is not None else None
        self.timeout_s = timeout_s
        self.grace_s = grace_s
        self.fail_fast = fail_fast
        self.remove = [os.fspath(p) for p in remove]
        self.clean = clean
        self.tmp = ""  # the private temporary folder, once open
        self.exits: list[Exit] | None = None
        self._proc: subprocess.Popen | None = None
        self._started = False
        self._started_at = 0.0
        self._old_sigterm: Any = None
        self._sigterm_installed = False

    def _set_commands(self, commands: Any, envs: Any, logs: Any) -> None:
        if envs is None or isinstance(envs, Mapping):
            envs = [envs] * len(commands)
        if len(envs) != len(commands) or (logs is not None and len(logs) != len(commands)):
            raise ValueError(
                f"{len(commands)} commands but {len(envs)} environments and "
                f"{len(logs) if logs is not None else 'no'} logs"
            )
        self.commands = [list(map(str, c)) for c in commands]
        self.envs = list(envs)
        self.logs = [os.fspath(p) for p in logs] if logs is not None else None

    # ---- lifecycle --------------------------------------------------------------------------
    def __enter__(self) -> "ProcessGroup":
        self.open()
        if self.commands:
            self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def open(self) -> str:
        """Start the supervisor; it makes the private temporary folder (`tmp`, returned), which
        it removes at the end even if this process dies right now. Write the commands' input
        files there, then `start` them."""
        if self._proc is not None:
            raise RuntimeError("this ProcessGroup was opened already")
        self._install_sigterm()
        # -I: the supervisor imports nothing but the standard library, not even from its folder.
        self._proc = subprocess.Popen(
            [sys.executable, "-I", os.path.abspath(__file__)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        settings = {"grace_s": self.grace_s, "fail_fast": self.fail_fast, "remove": self.remove}
        self._send(settings)
        assert self._proc.stdout is not None
        reply = json.loads(self._proc.stdout.readline().decode() or "{}")
        if "tmp" not in reply:
            raise RuntimeError("the process-group supervisor did not start (see stderr)")
        self.tmp = str(reply["tmp"])
        return self.tmp

    def start(
        self,
        commands: Sequence[Sequence[str]] | None = None,
        *,
        envs: Mapping[str, str] | Sequence[Mapping[str, str]] | None = None,
        logs: Sequence[str | os.PathLike] | None = None,
    ) -> None:
        """Start the commands (given here or to the constructor); the timeout counts from now."""
        if commands is not None:
            self._set_commands(commands, envs, logs)
        if not self.commands:
            raise ValueError("ProcessGroup needs at least one command")
        if self._proc is None:
            self.open()
        if self._started:
            raise RuntimeError("this ProcessGroup was started already")
        specs = []
        for i, (argv, env) in enumerate(zip(self.commands, self.envs)):
            env = clean_env(env) if self.clean else dict(os.environ if env is None else env)
            env["TMPDIR"] = self.tmp
            log = self.logs[i] if self.logs else os.devnull
            specs.append({"argv": argv, "env": env, "cwd": self.cwd, "log": log})
        self._send({"commands": specs})  # and keep the pipe open: closing it means stop
        self._started, self._started_at = True, time.monotonic()

    def _send(self, message: dict[str, Any]) -> None:
        assert self._proc is not None and self._proc.stdin is not None
        self._proc.stdin.write((json.dumps(message) + "\n").encode())
        self._proc.stdin.flush()

    def wait(self) -> list[Exit]:
        """Wait for the commands to end (or one to fail, with ``fail_fast``); their exits.

        The temporary folders stay until the group is stopped (leaving the ``with`` block), so
        that what the commands wrote there can still be read.

        Raises:
            ProcessTimeout: after ``timeout_s``; the commands were stopped and reaped.
        """
        if not self._started:
            raise RuntimeError("start the ProcessGroup first")
        if self.exits is not None:
            return self.exits
        remaining = None
        if self.timeout_s is not None:
            remaining = max(0.0, self.timeout_s - (time.monotonic() - self._started_at))
        if not self._read_report(remaining):
            self.stop()
            raise ProcessTimeout(
                f"{' '.join(self.commands[0][:4])} ...: not done after {self.timeout_s:g} s; "
                "stopped"
            )
        assert self.exits is not None
        return self.exits

    def stop(self) -> list[Exit]:
        """End every process of the group now (SIGTERM, then SIGKILL), reap them, remove the
        temporary folders. Idempotent; commands that were still running have no returncode."""
        try:
            if self._proc is not None and self._proc.returncode is None:
                self._close_pipe()  # the supervisor's signal to end everything and clean up
                if self.exits is None:
                    self._read_report(self.grace_s + 30)
                try:
                    self._proc.wait(timeout=self.grace_s + 30)
                except subprocess.TimeoutExpired:  # the supervisor itself is stuck: last resort
                    _killpg(self._proc.pid, signal.SIGKILL)
                    self._proc.wait()
                if self._proc.stdout:
                    self._proc.stdout.close()
        finally:
            self._restore_sigterm()
            if self.tmp:
                shutil.rmtree(self.tmp, ignore_errors=True)
        if self.exits is None:
            self.exits = [Exit(returncode=None)] * len(self.commands)
        return self.exits

    # ---- internals --------------------------------------------------------------------------
    def _close_pipe(self) -> None:
        assert self._proc is not None
        try:
            if self._proc.stdin and not self._proc.stdin.closed:
                self._proc.stdin.close()
        except BrokenPipeError:
            pass

    def _read_report(self, timeout_s: float | None) -> bool:
        """Read the supervisor's one-line report (the exits) if it comes within `timeout_s`."""
        import select

        assert self._proc is not None and self._proc.stdout is not None
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout_s)
        if not ready:
            return False
        line = self._proc.stdout.readline()
        try:
            report = json.loads(line.decode() or "{}")
        except ValueError:
            report = {}
        exits = report.get("exits") or [{"returncode": None}] * len(self.commands)
        self.exits = [Exit(**e) for e in exits]
        return True

    def _install_sigterm(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def terminated(signum: int, frame: object) -> None:
            raise SystemExit(128 + signum)

        self._old_sigterm = signal.signal(signal.SIGTERM, terminated)
        self._sigterm_installed = True

    def _restore_sigterm(self) -> None:
        if self._sigterm_installed:
            # None: a handler not set from Python; the default is the closest we can restore
            signal.signal(signal.SIGTERM, self._old_sigterm or signal.SIG_DFL)
            self._sigterm_installed = False


def run(commands: Sequence[Sequence[str]], **options: Any) -> list[Exit]:
    """Start `commands` as one `ProcessGroup`, wait for them, and clean up; their exits."""
    with ProcessGroup(commands, **options) as group:
        return group.wait()


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# ---- the supervisor (runs as `python -I processes.py`, reading its spec from stdin) -----------
def _prctl(option: int, value: int) -> bool:
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):  # not Linux
        return False


def _descendants(root: int) -> list[int]:
    """Every live descendant of `root`, from /proc (Linux); empty where /proc is absent."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()
        if fields and fields[0] != b"Z":  # zombies are reaped below, not signalled
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


class _Supervisor:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.pids: list[int] = []
        self.exits: dict[int, dict[str, Any]] = {}
        self.stop_requested = False
        self.signalled = False
        self.released = False
        self.owner = os.getppid()

    def run(self) -> None:
        """Make the private temporary folder and say where it is, read the commands, run them,
        end everything, report, wait for the owner's release, clean up."""
        import tempfile

        _prctl(PR_SET_CHILD_SUBREAPER, 1)
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._request_stop)
        tmp = tempfile.mkdtemp(prefix="autosearch-group-")
        self.spec["remove"] = [tmp, *self.spec.get("remove", [])]
        self.spec["commands"] = self._read_commands(tmp, wake_r)
        try:
            self._start_all()
            if self.pids:
                self._watch(wake_r)
        finally:
            self._end_all()
            exits = [self.exits.get(pid, {"returncode": None}) for pid in self.pids]
            try:
                sys.stdout.write(json.dumps({"exits": exits}) + "\n")
                sys.stdout.flush()
            except OSError:  # the owner is gone; say nothing more there
                os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
            self._wait_for_release(wake_r)
            for path in self.spec.get("remove", []):
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    try:
                        os.unlink(path)
                    except OSError:
                        pass

    def _read_commands(self, tmp: str, wake_r: int) -> list[dict[str, Any]]:
        """Say where the temporary folder is; the commands the owner sends back, or none if it
        dies, closes the pipe or signals us first."""
        import select

        try:
            sys.stdout.write(json.dumps({"tmp": tmp}) + "\n")
            sys.stdout.flush()
        except OSError:
            self.released = True
            return []
        stdin = sys.stdin.fileno()
        while not self.signalled and os.getppid() == self.owner:
            readable, _, _ = select.select([stdin, wake_r], [], [], 1.0)
            if wake_r in readable:
                os.read(wake_r, 4096)
            if stdin in readable:
                line = sys.stdin.buffer.readline()
                try:
                    return list(json.loads(line)["commands"])
                except (ValueError, KeyError, TypeError):
                    break
        self.released = True
        return []

    def _request_stop(self, *_: object) -> None:
        self.stop_requested = self.signalled = True

    def _wait_for_release(self, wake_r: int) -> None:
        """The owner reads what the commands left in the temporary folders, then closes the
        pipe (or dies, or signals us): only then are they removed."""
        import select

        stdin = sys.stdin.fileno()
        while not self.released and not self.signalled:
            readable, _, _ = select.select([stdin, wake_r], [], [], 1.0)
            if stdin in readable and not os.read(stdin, 4096):
                self.released = True
            if os.getppid() != self.owner:
                self.released = True
            if wake_r in readable:
                os.read(wake_r, 4096)

    def _start_all(self) -> None:
        """Start the commands, checking before each that the owner is still there and wants
        them: a signal, the owner's death (it is no longer our parent) or its closed pipe
        (Ctrl-C in the owner) stops the loop at once; what started is then ended by `_end_all`.
        (Polling, not PR_SET_PDEATHSIG: that follows the owner's *thread*, and an owner may
        open a group from a thread that ends before the group does.)"""
        for command in self.spec["commands"]:
            if self.signalled or os.getppid() != self.owner or self._owner_closed():
                self.stop_requested = self.released = True
                return
            self.pids.append(_spawn(command))

    def _owner_closed(self) -> bool:
        """Whether the owner closed its end of the pipe (it sends nothing after the commands)."""
        import select

        stdin = sys.stdin.fileno()
        readable, _, _ = select.select([stdin], [], [], 0)
        return bool(readable) and not os.read(stdin, 4096)

    def _reap(self) -> None:
        """Collect every child that ended; remember how the commands ended."""
        while True:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid in self.pids and pid not in self.exits:
                self.exits[pid] = {
                    "returncode": os.waitstatus_to_exitcode(status),
                    "max_rss_bytes": int(usage.ru_maxrss) * 1024,  # Linux reports KiB
                }

    def _watch(self, wake_r: int) -> None:
        import select

        stdin = sys.stdin.fileno()
        while not self.stop_requested:
            self._reap()
            if len(self.exits) == len(self.pids):
                return
            if self.spec.get("fail_fast") and any(e["returncode"] for e in self.exits.values()):
                return
            readable, _, _ = select.select([stdin, wake_r], [], [], 1.0)
            if stdin in readable and not os.read(stdin, 4096):
                self.stop_requested = self.released = True  # the owner closed the pipe, or died
            if os.getppid() != self.owner:  # died, though a forked child keeps the pipe open
                self.stop_requested = self.released = True
            if wake_r in readable:
                os.read(wake_r, 4096)

    def _end_all(self) -> None:
        """SIGTERM every descendant, wait `grace_s`, SIGKILL what is left, reap everything."""
        for sig, patience in (
            (signal.SIGTERM, self.spec.get("grace_s", 5.0)),
            (signal.SIGKILL, 10),
        ):
            self._reap()
            alive = self._alive()
            if not alive:
                break
            if sig == signal.SIGTERM and not PROC_TABLE:  # our handler only notes it
                _killpg(os.getpid(), sig)
            for pid in alive:
                try:
                    os.kill(pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            deadline = time.monotonic() + patience
            while time.monotonic() < deadline:
                self._reap()
                if not self._alive():
                    break
                time.sleep(0.02)
        self._reap()

    def _alive(self) -> list[int]:
        """Every live descendant (Linux); without /proc, the commands not yet reaped."""
        if PROC_TABLE:
            return _descendants(os.getpid())
        return [pid for pid in self.pids if pid not in self.exits]


def _spawn(command: dict[str, Any]) -> int:
    """fork + exec one command (the supervisor is single-threaded, so fork is safe here), with
    stdin from /dev/null, stdout and stderr to its log, and SIGKILL if the supervisor dies."""
    log = os.open(command["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    # A stop signal that reached the child between fork and its reset of the handlers below
    # would run the supervisor's handler (copied with the fork) and be lost: the command would
    # then run on until SIGKILL. Blocked across the fork, it stays pending until the child has
    # the default handlers, and then ends it as it would the command.
    stops = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, stops)
    pid = os.fork()
    if pid:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        os.close(log)
        return pid
    try:  # the child
        supervisor = os.getppid()
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != supervisor:  # it died before the line above took effect
            os._exit(137)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # a pending stop signal ends us here
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        if command.get("cwd"):
            os.chdir(command["cwd"])
        os.execvpe(command["argv"][0], command["argv"], command["env"])
    except BaseException as exc:  # noqa: BLE001 - report in the log, exit like a shell would
        os.write(2, f"cannot start {command['argv'][0]}: {exc}\n".encode())
    os._exit(127)


def _supervise() -> int:
    line = sys.stdin.buffer.readline()  # the settings; nothing if the owner died already
    if not line:
        return 0
    _Supervisor(json.loads(line)).run()
    return 0


if __name__ == "__main__":
    sys.exit(_supervise())
