"""The checks a tuning job passes before any work: where it writes and where it stores.

Each refuses, with one message naming the input and the fix, what would otherwise fail after the
search (an output folder that cannot be written, another study's outputs, a database URL whose
driver is missing), so that nothing is computed and then lost.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from autosearch.core.errors import SpecError
from autosearch.export import EXPORT_FILES

# What `tune` writes into its output folder (checked before the search: none may be a folder),
# with the files for other runtimes that `autosearch.export.write_exports` puts beside them.
OUTPUT_FILES = (
    "trials.csv",
    "top_k.csv",
    "pareto.csv",
    "best_strategy.yaml",
    "study.yaml",
    "report.md",
    "study.journal",
    ".lock",
    "time_breakdown.png",
    "throughput_memory.png",
    "importances.png",
) + EXPORT_FILES
# Database drivers by SQLAlchemy dialect: what to install when one is missing.
DRIVERS = {
    "postgresql": "pip install -e '.[postgres]' (psycopg 3), and write the URL as "
    "postgresql+psycopg://user:password@host/dbname",
    "mysql": "pip install pymysql, and write the URL as mysql+pymysql://user:password@host/dbname",
}


def _given(text: str | os.PathLike | None, flag: str) -> str:
    if text is None or not str(os.fspath(text)).strip():
        raise SpecError(f"{flag} is empty; give a value (see --help)")
    return str(os.fspath(text)).strip()


def check_path_length(text: str, flag: str = "--out") -> None:
    """Refuse a path the file system cannot hold (a name over NAME_MAX bytes, the whole over
    PATH_MAX) before any folder on the way is made: the error would come after `makedirs` had
    made the folders above it, and leave them behind."""
    path = os.path.abspath(text)
    probe = path
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    try:
        name_max = os.pathconf(probe, "PC_NAME_MAX")
        path_max = os.pathconf(probe, "PC_PATH_MAX") - 1  # the limit counts the final NUL
    except (OSError, ValueError, AttributeError):  # pragma: no cover - not POSIX
        name_max, path_max = 255, 4095
    shown = text if len(text) <= 80 else text[:60] + "..." + text[-15:]
    for name in path.split(os.sep):
        size = len(os.fsencode(name))
        if size > name_max:
            raise SpecError(
                f"{flag} {shown!r} cannot be made: the name {name[:30]!r}... is {size} bytes, "
                f"over the {name_max} this file system takes; give a shorter path"
            )
    size = len(os.fsencode(path))
    if size > path_max:
        raise SpecError(
            f"{flag} {shown!r} cannot be made: the path is {size} bytes, over the {path_max} "
            "this file system takes; give a shorter path"
        )


def check_output_folder(out: str, *, files: tuple[str, ...] = (), flag: str = "--out") -> None:
    """Refuse, before any work, an output folder that could not take every output file.

    `out` must not be the root of the file system nor an existing file, its nearest existing
    ancestor must be a writable folder, and none of `files` may exist there as a folder.
    """
    text = _given(out, flag)
    check_path_length(text, flag)
    path = os.path.abspath(text)
    if path == os.path.abspath(os.sep):
        raise SpecError(
            f"{flag} {text!r} is the root of the file system; give a folder of its own, "
            "e.g. results/my-study"
        )
    if os.path.exists(path) and not os.path.isdir(path):
        raise SpecError(f"{flag} {text!r} is a file, not a folder; give a folder path")
    _check_writable_parent(path, flag, text, folder=True)
    for name in files:
        target = os.path.join(path, name)
        if os.path.isdir(target):
            raise SpecError(
                f"{flag} {text!r} holds a folder named {name!r} where an output file goes; "
                "move it away or give another --out"
            )


def check_output_file(out: str, *, flag: str = "--out") -> None:
    """Refuse, before any work, an output file path that could not be written."""
    text = _given(out, flag)
    check_path_length(text, flag)
    path = os.path.abspath(text)
    if os.path.isdir(path):
        raise SpecError(f"{flag} {text!r} is a folder; give a file path, e.g. {text}/out.csv")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise SpecError(f"{flag} {text!r} is not writable; give another path")
    _check_writable_parent(os.path.dirname(path), flag, text, folder=True)


def _check_writable_parent(path: str, flag: str, text: str, *, folder: bool) -> None:
    """Walk up to the nearest existing ancestor of `path`: it must be a writable folder."""
    probe = path
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        raise SpecError(
            f"{flag} {text!r} cannot be created: {probe!r} is a file, not a folder; "
            "give a path under a folder"
        )
    if not os.access(probe, os.W_OK | os.X_OK):
        raise SpecError(
            f"{flag} {text!r} cannot be written: the folder {probe!r} is read-only for this "
            "user; give a path under a writable folder"
        )


def check_other_study(out: str, study_name: str) -> None:
    """Refuse an output folder that holds the outputs of another study (they would be replaced),
    or a study.yaml that is not one (a file of the user's)."""
    from autosearch.core._io import read_yaml_mapping

    path = os.path.join(out, "study.yaml")
    if not os.path.isfile(path):
        return
    try:
        other = read_yaml_mapping(path, what="study record").get("study_name")
    except SpecError:
        other = None
    if other is None:
        raise SpecError(
            f"--out {out!r} holds a study.yaml that is not readable; give another --out "
            "(or remove the folder if its study is not needed)"
        )
    if other != study_name:
        raise SpecError(
            f"--out {out!r} holds the outputs of study {other!r}, another study than "
            f"{study_name!r}; outputs of different studies never share a folder: give another "
            f"--out (for example results/{study_name}), or --study-name {other} to resume that "
            "study"
        )


def check_storage_url(text: str) -> None:
    """Refuse, before any work, a storage URL whose scheme or database driver is unknown."""
    text = _given(text, "--storage")
    if "://" not in text:
        return
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    try:
        url = make_url(text)
    except ArgumentError:
        raise SpecError(
            f"--storage {text!r} is not a database URL (e.g. postgresql+psycopg://user:password"
            "@host/dbname or sqlite:///study.db)"
        ) from None
    try:
        dialect = url.get_dialect()
    except NoSuchModuleError:
        raise SpecError(
            f"--storage {text!r}: unknown storage scheme {url.drivername!r}; use a journal file "
            "(study.journal), SQLite (study.db or sqlite:///study.db) or a database URL such as "
            "postgresql+psycopg://user:password@host/dbname"
        ) from None
    try:
        dialect.import_dbapi()
    except ImportError as exc:
        backend = url.get_backend_name()
        fix = DRIVERS.get(backend, f"install the Python driver {exc.name or url.drivername!r}")
        raise SpecError(
            f"--storage {url.render_as_string(hide_password=True)!r}: the {backend} driver "
            f"{exc.name or url.drivername!r} is not installed; {fix}"
        ) from None


@contextlib.contextmanager
def storage_errors(storage: str) -> Iterator[None]:
    """A database that cannot be reached or read is the user's to fix: one message."""
    try:
        yield
    except Exception as exc:
        if not type(exc).__module__.startswith("sqlalchemy"):  # imported only when needed
            raise
        from sqlalchemy.engine import make_url
        from sqlalchemy.exc import OperationalError

        if not isinstance(exc, OperationalError):
            raise

        shown = storage
        if "://" in storage:
            try:
                shown = make_url(storage).render_as_string(hide_password=True)
            except Exception:  # noqa: BLE001 - only for the message
                shown = storage.split("://", 1)[0] + "://..."
        first = str(exc.orig or exc).strip().splitlines()[0]
        raise SpecError(
            f"--storage {shown!r}: cannot connect to or read the database ({first}); "
            "check the URL, that the server runs, and the credentials"
        ) from None
