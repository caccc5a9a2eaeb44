"""An Optuna journal file that checks and repairs itself.

Optuna's `JournalStorage` replays a log of operations; this is its file backend
(`optuna.storages.journal.BaseJournalBackend`, the public extension point) with three changes
over `JournalFileBackend`:

1. The lock is an `flock` (`_files.FileLock`), which a killed process releases at once; Optuna's
   symbolic-link lock is left behind by a kill and the next run stalls 30 s before breaking it.
2. A torn last line (a writer killed mid-append, a full disk, a power loss) is ignored when read,
   with one warning, and cut off under the lock before the next append. Optuna ignores it when
   reading but appends after it, which glues the next record onto the torn one and makes the
   whole file unreadable from then on.
3. A damaged line in the middle (edited by hand, or a disk error) raises a `SpecError` that names
   the file and the line and says how to recover, instead of a bare `JSONDecodeError`.

Reads are incremental: the byte offset of every record already read is remembered, so a
worker that keeps one storage object reads only what other workers appended since.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Iterator
from typing import Any

from optuna.storages.journal import BaseJournalBackend

from autosearch.core._files import DISK_HINTS, FileLock
from autosearch.core.errors import SpecError

LOCK_SUFFIX = ".flock"


class TornJournalWarning(UserWarning):
    """The last record of a journal was cut short; it is ignored (and cut off on next write)."""


class JournalFile(BaseJournalBackend):
    """A journal file backend with an `flock`, torn-tail repair and clear errors.

    Args:
        path: the journal file (created if missing).
        lock: the lock shared with the tuner's study lock (default ``<path>.flock``).
    """

    def __init__(self, path: str | os.PathLike, *, lock: FileLock | None = None):
        self.path = os.fspath(path)
        self.lock = lock or FileLock(self.path + LOCK_SUFFIX)
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
            os.close(fd)
        except OSError as exc:
            raise SpecError(f"cannot open the journal {self.path!r}: {exc.strerror}") from None
        self._offsets: list[int] = [0]  # byte offset of record i (and one past the last read)
        self._warned_torn = False
        self._defer_fsync = 0  # > 0 inside `deferred_fsync`
        self._unsynced = False

    # ---- reading -------------------------------------------------------------------------------
    def read_logs(self, log_number_from: int) -> Iterator[dict[str, Any]]:
        start = min(log_number_from, len(self._offsets) - 1)
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            pos = self._offsets[start]
            f.seek(pos)
            number = start
            for line in f:
                pos += len(line)
                if not line.endswith(b"\n"):
                    if pos <= size:  # was there when we looked: a torn write
                        self._warn_torn(len(line), number)
                    break  # else being written right now: the next read gets it
                record = self._decode(line, number)
                if number + 1 == len(self._offsets):
                    self._offsets.append(pos)
                if number >= log_number_from:
                    yield record
                number += 1

    def _decode(self, line: bytes, number: int) -> dict[str, Any]:
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            problem = f"{type(exc).__name__}: {exc}"
        else:
            if isinstance(record, dict) and "op_code" in record:
                return record
            problem = "valid JSON but not an Optuna journal record (no op_code)"
        good = number  # records before this line are intact
        raise SpecError(
            f"{self.path}, line {number + 1}: not a journal record ({problem}); the file was "
            f"edited or damaged in the middle. Lines 1-{good} are intact: keep them with "
            f"`head -n {good} {self.path} > repaired.journal` and pass --storage "
            "repaired.journal (or move the file away to start a new study)"
        )

    def _warn_torn(self, nbytes: int, number: int) -> None:
        if not self._warned_torn:
            warnings.warn(
                f"{self.path}: the last record (line {number + 1}, {nbytes} bytes) is cut short, "
                "as left by a writer that was killed or ran out of disk; it is ignored and will "
                "be cut off before the next write (at most the one trial in flight is lost)",
                TornJournalWarning,
                stacklevel=3,
            )
            self._warned_torn = True

    # ---- writing -------------------------------------------------------------------------------
    def append_logs(self, logs: list[dict[str, Any]]) -> None:
        payload = "".join(json.dumps(log, separators=(",", ":")) + "\n" for log in logs)
        with self.lock:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0))
            except OSError as exc:
                raise SpecError(f"cannot write the study journal {self.path!r}: {exc}") from None
            size = 0
            try:
                self._cut_torn_tail(fd)
                size = os.fstat(fd).st_size
                data = memoryview(payload.encode("utf-8"))
                while data:
                    data = data[os.write(fd, data) :]
                if self._defer_fsync:
                    self._unsynced = True
                else:
                    os.fsync(fd)
            except OSError as exc:
                with contextlib.suppress(OSError):  # no torn record left behind
                    os.ftruncate(fd, size)
                raise SpecError(
                    f"cannot write the study journal {self.path!r}: {exc.strerror}"
                    f"{DISK_HINTS.get(exc.errno or 0, '')}; the trials stored before are kept, "
                    "and the same command continues the study"
                ) from None
            finally:
                os.close(fd)

    @contextlib.contextmanager
    def deferred_fsync(self) -> Iterator[None]:
        """Appends inside this block are written at once but flushed to the disk once, at its
        end: one `fsync` per batch of trials instead of one per trial (it costs 2-5 ms).

        A process killed inside the block loses nothing it wrote: the records are in the page
        cache, and other processes read them. Only a power loss or an OS crash before the
        final fsync can drop the batch's tail, which the torn-tail repair then cuts off.
        """
        self._defer_fsync += 1
        try:
            yield
        finally:
            self._defer_fsync -= 1
            if not self._defer_fsync and self._unsynced:
                self._unsynced = False
                fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)

    def _cut_torn_tail(self, fd: int) -> None:
        """Truncate a last line without its newline (only ever a torn write: every record is
        written whole with its newline under the lock, and we hold the lock)."""
        size = os.fstat(fd).st_size
        if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
            return
        end = size
        while end > 0:
            step = min(65536, end)
            chunk = os.pread(fd, step, end - step)
            i = chunk.rfind(b"\n")
            if i >= 0:
                end = end - step + i + 1
                break
            end -= step
        os.ftruncate(fd, end)
        warnings.warn(
            f"{self.path}: cut off a torn last record ({size - end} bytes) before appending",
            TornJournalWarning,
            stacklevel=4,
        )
