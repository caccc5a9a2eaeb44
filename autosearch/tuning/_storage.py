"""Where a study lives: Optuna storage from a URL, a file path, or nothing (in memory).

Measured on this project's CI machine (2 shared cores; `benchmarks/search_quality.py` prints the
current figures): persisting one finished trial (one `create_new_trial` with its parameters,
values and attributes) costs about 1.7 ms in a journal file and about 25-30 ms in SQLite through
Optuna's SQLAlchemy layer, against about 10 ms of TPE sampling per trial. Hence the default file
storage is an Optuna journal file (`<out>/study.journal`): crash-safe (each record is appended and
fsync'ed whole; a torn last line is ignored on reload), shared safely by several processes through
a lock file, and ~15x cheaper per trial than SQLite. SQLite and every RDB URL work the same way,
only slower per trial:

* ``results/x/study.db`` or ``sqlite:///results/x/study.db``: one machine, a few processes.
* ``postgresql://user:password@host/db``, ``mysql+pymysql://...``: many machines sharing one study
  (run the same command on each; every worker pulls the others' trials into its sampler).
* ``results/x/study.journal`` on a shared file system (NFS): many machines without a database
  (Optuna's JournalFileBackend; each append takes a lock file next to the journal).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from autosearch.core.errors import SpecError

if TYPE_CHECKING:  # pragma: no cover
    from optuna.storages import BaseStorage

JOURNAL_SUFFIXES = (".journal", ".log", ".jsonl")
SQLITE_SUFFIXES = (".db", ".sqlite", ".sqlite3")
DEFAULT_FILENAME = "study.journal"


def open_storage(storage: "str | os.PathLike | BaseStorage | None") -> "BaseStorage | None":
    """An Optuna storage for `storage`, or None for an in-memory study.

    Args:
        storage: None (in memory), an Optuna storage object, an RDB URL (``sqlite:///path.db``,
            ``postgresql://...``), a ``.journal`` file, or a ``.db`` SQLite file path.

    Raises:
        SpecError: the string is neither a URL nor a path with a known suffix.
    """
    import optuna

    if storage is None or isinstance(storage, optuna.storages.BaseStorage):
        return storage
    text = os.fspath(storage)
    if "://" in text:
        if text.startswith("sqlite:///"):
            _make_parent(text[len("sqlite:///") :])
            return optuna.storages.RDBStorage(
                text, engine_kwargs={"connect_args": {"timeout": 60}}
            )
        return optuna.storages.RDBStorage(text)
    if text.endswith(JOURNAL_SUFFIXES):
        from optuna.storages.journal import JournalFileBackend

        _make_parent(text)
        return optuna.storages.JournalStorage(JournalFileBackend(text))
    if text.endswith(SQLITE_SUFFIXES):
        _make_parent(text)
        return optuna.storages.RDBStorage(
            f"sqlite:///{os.path.abspath(text)}", engine_kwargs={"connect_args": {"timeout": 60}}
        )
    raise SpecError(
        f"storage {text!r} is not an RDB URL nor a file with a known suffix; use a journal file "
        f"(path ending in {', '.join(JOURNAL_SUFFIXES)}), a SQLite file (ending in {', '.join(SQLITE_SUFFIXES)} or "
        "sqlite:///path.db), or a database URL such as postgresql://user:password@host/dbname"
    )


def describe_storage(storage: "str | os.PathLike | BaseStorage | None") -> str:
    if storage is None:
        return "in memory (nothing persisted)"
    if isinstance(storage, (str, os.PathLike)):
        return os.fspath(storage)
    return type(storage).__name__


def _make_parent(path: str) -> None:
    parent = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as exc:
        raise SpecError(
            f"cannot create the folder {parent!r} for the study storage: {exc.strerror}"
        ) from None
