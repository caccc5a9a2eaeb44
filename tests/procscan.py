"""Find processes by an environment marker, from /proc (no psutil): what a test started, however
deep, whichever session or process group it moved to, carries the marker in its environment."""

from __future__ import annotations

import os
import time
import uuid

MARK = "AUTOSEARCH_TEST_MARK"


def new_mark() -> dict[str, str]:
    """An environment entry to give a command under test: ``{MARK: <unique value>}``."""
    return {MARK: uuid.uuid4().hex}


def marked(mark: dict[str, str]) -> list[int]:
    """Live (non-zombie) processes of this user whose environment holds `mark`."""
    ((key, value),) = mark.items()
    needle = f"{key}={value}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        if needle in env and stat[stat.rfind(b")") + 2 :][:1] != b"Z":
            found.append(int(entry))
    return found


def wait_until_gone(mark: dict[str, str], timeout_s: float = 30.0) -> list[int]:
    """Poll until no marked process is left, at most `timeout_s`; the survivors (empty if none)."""
    deadline = time.monotonic() + timeout_s
    while (left := marked(mark)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def kill_marked(mark: dict[str, str]) -> None:
    """Clean up after a failed test: SIGKILL whatever still carries the mark."""
    for pid in marked(mark):
        try:
            os.kill(pid, 9)
        except OSError:
            pass
