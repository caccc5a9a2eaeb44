"""Files that survive kills and hostile folders: one lock, one atomic write, one clean-up.

* `FileLock`: an exclusive advisory lock (``flock``) on a lock file opened without following a
  symbolic link. The kernel drops an ``flock`` when its process dies, so a killed worker never
  leaves a stale lock behind (Optuna's default journal lock is a symbolic link that a killed
  process leaves in place, and the next run waits 30 s before breaking it). The lock file itself
  stays: removing a lock file while another process may be opening it is the classic race.
* `atomic_write`: every output file is written to an unpredictable temporary name in the same
  folder (`tempfile.mkstemp`), flushed and fsync'ed, then renamed over the target (`os.replace`,
  atomic on POSIX), so a reader sees the old file or the new one, never a torn one.
* `remove_stale_temp_files`: what a kill between `mkstemp` and `os.replace` leaves behind (a
  temporary name carries its writer's pid; only files of dead processes are removed).
* `own_folder` / `mark_folder` / `is_owned`: autosearch writes only into a folder that is new,
  empty, or its own (a ``.autosearch`` marker file inside, created with ``O_EXCL``), and renames
  or removes only folders that hold that marker; a folder of the user's files is refused before
  anything is written there (study outputs, exports, checkpoints).

Written by hand because the standard library has the primitives but no such helper, and the
`filelock` package follows symbolic links when it opens its lock file.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Callable

from autosearch.core.errors import SpecError

TEMP_PREFIX = ".autosearch-"
TEMP_SUFFIX = ".tmp"


class FileLock:
    """An exclusive, re-entrant (within one process) `flock` on `path`.

    Args:
        path: the lock file; created (mode 0o644) if missing, never truncated, never followed if
            it is a symbolic link (that is refused with a `SpecError`).

    Example:
        >>> import tempfile, os
        >>> lock = FileLock(os.path.join(tempfile.mkdtemp(), ".lock"))
        >>> with lock:
        ...     with lock:  # re-entrant in the same process
        ...         pass
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._fd: int | None = None
        self._depth = 0
        self._thread_lock = threading.RLock()

    def acquire(self) -> None:
        self._thread_lock.acquire()
        try:
            if self._depth == 0:
                fd = _open_no_follow(self.path)
                try:
                    import fcntl

                    fcntl.flock(fd, fcntl.LOCK_EX)
                except ImportError:  # pragma: no cover - not POSIX: writes are still atomic
                    pass
                except BaseException:
                    os.close(fd)
                    raise
                self._fd = fd
            self._depth += 1
        except BaseException:
            self._thread_lock.release()
            raise

    def release(self) -> None:
        if self._depth <= 0:
            raise RuntimeError(f"release of {self.path} without acquire")
        self._depth -= 1
        if self._depth == 0 and self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # closing the only descriptor releases the flock
        self._thread_lock.release()

    @property
    def held(self) -> bool:
        return self._depth > 0

    def __enter__(self) -> FileLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _open_no_follow(path: str) -> int:
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        return os.open(path, flags, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise SpecError(
                f"the lock file {path!r} is a symbolic link; autosearch never follows one there "
                "(it could truncate the file it points to). Remove the link and run again"
            ) from None
        raise SpecError(f"cannot open the lock file {path!r}: {exc.strerror}") from None


def atomic_write(
    path: str | os.PathLike,
    data: str | bytes | Callable[[str], None],
    *,
    mode: int = 0o644,
) -> None:
    """Replace `path` by `data` atomically (temporary file in the same folder, fsync, rename).

    The temporary file is made by `tempfile.mkstemp` (``O_CREAT | O_EXCL``, an unpredictable
    name), so nothing planted in the folder is followed; the rename replaces a symbolic link at
    `path` itself, never the file it points to.

    Args:
        path: the file to write (its folder must exist).
        data: text (UTF-8), bytes, or a callable that writes the file at the temporary path it is
            given (for writers that want a path, such as matplotlib's ``savefig``).
        mode: the file's permissions (0o755 for a script).

    Raises:
        SpecError: the folder is not writable, or `path` is a folder.
    """
    path = os.fspath(path)
    folder, name = os.path.split(os.path.abspath(path))
    if os.path.isdir(path):
        raise SpecError(f"{path!r} is a folder; autosearch needs to write a file there")
    try:
        fd, tmp = tempfile.mkstemp(
            prefix=f"{TEMP_PREFIX}{os.getpid()}-{name}.", suffix=TEMP_SUFFIX, dir=folder
        )
    except OSError as exc:
        raise SpecError(f"cannot write into {folder!r}: {exc.strerror}") from None
    try:
        if callable(data):
            os.close(fd)
            fd = -1
            data(tmp)
            fd = os.open(tmp, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        else:
            payload = data.encode("utf-8") if isinstance(data, str) else data
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view) :]
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.chmod(tmp, mode)  # mkstemp creates 0o600; outputs are ordinary files
        os.replace(tmp, path)
    except BaseException as exc:
        if fd >= 0:
            os.close(fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(exc, OSError):
            raise SpecError(
                f"cannot write {path!r}: {exc.strerror}{DISK_HINTS.get(exc.errno or 0, '')}"
            ) from None
        raise
    _fsync_folder(folder)


DISK_HINTS = {
    errno.ENOSPC: " (the disk is full: free space or give another output path, then run again)",
    errno.EDQUOT: " (over the disk quota: free space or give another output path)",
    errno.EROFS: " (a read-only file system: give an output path on a writable one)",
}


def _fsync_folder(folder: str) -> None:
    """Make the rename itself durable (POSIX: fsync the directory)."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # pragma: no cover - e.g. not permitted on this platform
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def remove_stale_temp_files(
    folder: str | os.PathLike, *, extra: re.Pattern | None = None
) -> list[str]:
    """Remove the temporary files that writers killed mid-write left in `folder`.

    A temporary name carries its writer's process id (``.autosearch-<pid>-<name>.<random>.tmp``);
    a file is removed only when that process is gone, so a write in progress in another process
    is never disturbed. `extra`: a pattern for other writers' names, whose first group is the pid
    (e.g. ``name.tmp<pid>``). Returns the names removed.
    """
    removed: list[str] = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for name in names:
        pid = None
        m = _OURS.match(name)
        if m:
            pid = int(m.group(1))
        elif extra is not None and (m := extra.match(name)):
            pid = int(m.group(1))
        if pid is None or _alive(pid):
            continue
        try:
            os.unlink(os.path.join(folder, name))
            removed.append(name)
        except OSError:
            pass
    return removed


# ---- folders autosearch owns -------------------------------------------------------------------
MARKER = ".autosearch"  # the file that says "autosearch made this folder" (its kind inside)


def own_folder(
    path: str | os.PathLike,
    *,
    kind: str,
    what: str,
    accept: tuple[str, ...] = (),
    create: bool = True,
) -> str:
    """Make sure autosearch may write into the folder `path`, and mark it as its own.

    autosearch writes only into a folder that is new, empty, or its own: one holding the marker
    file `MARKER` (written here) or, for folders written before markers existed, one of the
    names in `accept` (e.g. ``study.yaml``). Anything else is the user's, and is refused before
    anything is written or removed there.

    Args:
        path: the folder.
        kind: what the folder holds (``study``, ``checkpoint``, ``export``), written in the marker.
        what: how the message names the folder (``--out 'x'``).
        accept: names whose presence marks a folder of autosearch's from before markers.
        create: create the folder (with its parents) when it does not exist.

    Returns:
        the folder's absolute path.

    Raises:
        SpecError: `path` is a file, or a folder holding files autosearch did not write.
    """
    folder = os.path.abspath(os.fspath(path))
    if os.path.lexists(folder) and not os.path.isdir(folder):
        raise SpecError(f"{what} is a file, not a folder; give a folder path")
    made = None  # the first folder this call makes (removed again if marking it fails)
    if not os.path.isdir(folder):
        if not create:
            return folder
        made = folder
        while not os.path.lexists(os.path.dirname(made)):
            made = os.path.dirname(made)
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as exc:
            raise SpecError(
                f"cannot create {what}: {exc.strerror}{DISK_HINTS.get(exc.errno or 0, '')}"
            ) from None
    try:
        names = os.listdir(folder)
    except OSError as exc:
        raise SpecError(f"cannot read {what}: {exc.strerror}") from None
    names = [n for n in names if not _OURS.match(n)]  # another writer's temporary file
    if names and MARKER not in names and not any(n in names for n in accept):
        shown = ", ".join(sorted(names)[:3]) + (", ..." if len(names) > 3 else "")
        raise SpecError(
            f"{what} holds files autosearch did not write ({shown}); autosearch writes only "
            "into a new or empty folder, or one it made itself (with a .autosearch file), so "
            "it never overwrites or removes your files. Give another path"
        )
    try:
        mark_folder(folder, kind=kind, what=what)
    except SpecError:
        empty = folder
        while made is not None:  # a full disk: leave none of the folders made here behind
            with contextlib.suppress(OSError):
                os.rmdir(empty)  # removes only an empty folder
            if empty == made:
                break
            empty = os.path.dirname(empty)
        raise
    return folder


def mark_folder(folder: str, *, kind: str, what: str) -> None:
    """Write the marker into `folder` unless it is there (created with ``O_EXCL``, never through
    a link: workers that start together on a new folder write it once, and none waits)."""
    marker = os.path.join(folder, MARKER)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(marker, flags, 0o644)
    except FileExistsError:
        if os.path.islink(marker) or not os.path.isfile(marker):
            raise SpecError(
                f"{what}: {MARKER} is not a plain file; remove it and run again"
            ) from None
        return
    except OSError as exc:
        raise SpecError(
            f"cannot write into {what}: {exc.strerror}{DISK_HINTS.get(exc.errno or 0, '')}"
        ) from None
    try:
        os.write(fd, f"written by autosearch: {kind}\n".encode())
    except OSError as exc:  # a full disk: no marker at all, rather than an empty one
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(marker)
        raise SpecError(
            f"cannot write into {what}: {exc.strerror}{DISK_HINTS.get(exc.errno or 0, '')}"
        ) from None
    os.close(fd)


def remove_owned(path: str | os.PathLike) -> None:
    """Remove a folder autosearch owns (`is_owned`) with its marker last: a process killed while
    removing it leaves a folder that is still marked, which the next run removes, never one
    that autosearch would refuse as the user's. A folder without the marker is left alone."""
    folder = os.fspath(path)
    if not is_owned(folder):
        return
    for entry in os.scandir(folder):
        if entry.name == MARKER:
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(folder, MARKER))
    with contextlib.suppress(OSError):
        os.rmdir(folder)


def is_owned(path: str | os.PathLike) -> bool:
    """Whether `path` is a real folder (not a symbolic link) holding autosearch's marker."""
    folder = os.fspath(path)
    marker = os.path.join(folder, MARKER)
    return (
        os.path.isdir(folder)
        and not os.path.islink(folder)
        and os.path.isfile(marker)
        and not os.path.islink(marker)
    )


_OURS = re.compile(re.escape(TEMP_PREFIX) + r"(\d+)-.*" + re.escape(TEMP_SUFFIX) + "$")


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True
