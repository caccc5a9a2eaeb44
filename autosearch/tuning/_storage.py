"""Where a study lives: Optuna storage from a URL, a file path, or nothing (in memory).

Measured on this project's CI machine (2 shared, loaded cores; `benchmarks/storage_scale.py`,
results/storage_scale.csv): one finished trial costs 2-10 ms in a journal file and 20-70 ms in
SQLite through Optuna's SQLAlchemy layer, the same at 50,000 trials as at 1,000 for the journal,
against about 10 ms of TPE sampling per trial. Hence the default file
storage is an Optuna journal file (`<out>/study.journal`, see `_journal.py`): each record is
appended whole and fsync'ed under an `flock`, a torn last line is ignored and cut off, and
damage in the middle is reported with the line number. SQLite and every RDB URL work the same
way, only slower per trial:

* ``results/x/study.db`` or ``sqlite:///results/x/study.db``: one machine, a few processes.
* ``postgresql+psycopg://user:password@host/db`` (``pip install 'autosearch[postgres]'``): many
  machines sharing one study (run the same command on each; every worker pulls the others'
  trials into its sampler). Tested with four workers on a throwaway cluster
  (tests/test_postgres.py).
* ``results/x/study.journal`` on a shared file system (NFS with working ``flock``): many machines
  without a database.

Every storage also gives the tuner a *study lock* (`OpenedStorage.lock`): an `flock` for the
journal and SQLite files, a PostgreSQL advisory lock for PostgreSQL. Workers take it to check the
trial count and persist a trial as one step, so the study never holds more trials than asked,
and an exhaustive search never scores a layout twice. Other databases get no such lock (a few
trials of overshoot are then possible with several workers; said when the storage is opened).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autosearch.core.errors import SpecError
from autosearch.tuning._files import FileLock

if TYPE_CHECKING:  # pragma: no cover
    from optuna.storages import BaseStorage

JOURNAL_SUFFIXES = (".journal", ".log", ".jsonl")
SQLITE_SUFFIXES = (".db", ".sqlite", ".sqlite3")
DEFAULT_FILENAME = "study.journal"
SQLITE_TIMEOUT_S = 60


@dataclass(frozen=True, kw_only=True)
class StudyOptions:
    """Where a study is kept and what it is called (the storage options of `tune`).

    Attributes:
        storage: None (in memory, or ``<out>/study.journal`` when `out` is given), an Optuna
            storage object, an RDB URL (``sqlite:///x.db``, ``postgresql+psycopg://...``) or a
            ``.journal`` / ``.db`` path.
        study_name: the study's name in the storage (letters, digits and ``._-+=``; it never
            becomes part of a path); None: ``<model>_<gpu>-<nodes>x<gpus>_gbs<batch>_<objective>``.
        out: folder for trials.csv, top_k.csv, best_strategy.yaml, study.yaml and report.md
            (None: no files).
    """

    storage: "str | os.PathLike | BaseStorage | None" = None
    study_name: str | None = None
    out: "str | os.PathLike | None" = None


@dataclass(frozen=True)
class OpenedStorage:
    """An opened storage, with what the tuner needs to share it safely.

    Attributes:
        storage: the Optuna storage object (keep this reference: the journal storage replays the
            file incrementally, so one object per process reads each record once).
        kind: ``journal``, ``sqlite`` or ``rdb``.
        description: for people (a path, or a URL without its password).
        lock: a re-entrant context manager factory: ``with opened.lock(study_name): ...``.
        exact: whether the lock makes counts exact across workers.
    """

    storage: "BaseStorage"
    kind: str
    description: str
    lock_path: str | None = None
    url: str | None = None
    journal: Any = None  # the JournalFile backend of a journal storage

    def batched_writes(self):
        """A block whose trial writes may be flushed to the disk together (journal: one fsync
        at the end, see `JournalFile.deferred_fsync`); a no-op for the other storages."""
        if self.journal is not None:
            return self.journal.deferred_fsync()
        return contextlib.nullcontext()

    @property
    def exact(self) -> bool:
        return self.lock_path is not None or _is_postgres(self.url)

    def lock(self, study_name: str):
        """The study lock (see the module docstring); a no-op where the storage has none."""
        if self.lock_path is not None:
            return _file_lock(self.lock_path)
        if self.url is not None and _is_postgres(self.url):
            return _advisory_lock(self.url, study_name)
        return contextlib.nullcontext()


_FILE_LOCKS: dict[str, FileLock] = {}
_ADVISORY_LOCKS: dict[tuple[str, str], Any] = {}


def _file_lock(path: str) -> FileLock:
    # One FileLock object per path and process: two flock()s on two descriptors of the same
    # file would block each other even inside one process.
    return _FILE_LOCKS.setdefault(os.path.abspath(path), FileLock(path))


def open_storage(storage: "str | os.PathLike | BaseStorage | None") -> "BaseStorage | None":
    """An Optuna storage for `storage`, or None for an in-memory study.

    Args:
        storage: None (in memory), an Optuna storage object, an RDB URL (``sqlite:///path.db``,
            ``postgresql+psycopg://...``), a ``.journal`` file, or a ``.db`` SQLite file path.

    Raises:
        SpecError: the string is neither a URL nor a path with a known suffix, the driver is
            missing, or the file is not a study storage.
    """
    opened = open_study_storage(storage)
    return None if opened is None else opened.storage


def open_study_storage(
    storage: "str | os.PathLike | BaseStorage | None", *, shared_ok: bool = False
) -> OpenedStorage | None:
    """Like `open_storage`, with the study lock and a description (None: in memory).

    Args:
        storage: as `open_storage` takes it.
        shared_ok: open a SQLite file or a database that holds tables of its own besides
            Optuna's (by default refused: Optuna would add its 13 tables to the user's database).
    """
    import optuna

    if storage is None:
        return None
    if isinstance(storage, OpenedStorage):
        return storage
    if isinstance(storage, optuna.storages.BaseStorage):
        return OpenedStorage(storage, _kind_of(storage), type(storage).__name__)
    text = os.fspath(storage)
    if "://" in text:
        _check_url_names_a_database(text)
        if text.startswith("sqlite:///"):
            return _open_sqlite(text[len("sqlite:///") :], shared_ok=shared_ok)
        return _open_rdb(text, shared_ok=shared_ok)
    if text.endswith(JOURNAL_SUFFIXES):
        return _open_journal(text)
    if text.endswith(SQLITE_SUFFIXES):
        return _open_sqlite(text, shared_ok=shared_ok)
    raise SpecError(
        f"storage {text!r} is not an RDB URL nor a file with a known suffix; use a journal file "
        f"(path ending in {', '.join(JOURNAL_SUFFIXES)}), a SQLite file (ending in "
        f"{', '.join(SQLITE_SUFFIXES)} or sqlite:///path.db), or a database URL such as "
        "postgresql+psycopg://user:password@host/dbname"
    )


def describe_storage(storage: Any) -> str:
    if storage is None:
        return "in memory (nothing persisted)"
    if isinstance(storage, OpenedStorage):
        return storage.description
    if isinstance(storage, (str, os.PathLike)):
        return _hide_password(os.fspath(storage))
    return type(storage).__name__


# ---- one opener per kind ------------------------------------------------------------------------
def _open_journal(path: str) -> OpenedStorage:
    import optuna

    from autosearch.tuning._journal import LOCK_SUFFIX, JournalFile

    _make_parent(path)
    _check_regular(path, "the journal")
    lock_path = path + LOCK_SUFFIX
    backend = JournalFile(path, lock=_file_lock(lock_path))
    _remove_optuna_lock_leftovers(path)
    try:
        storage = optuna.storages.JournalStorage(backend)
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, SpecError):
            raise
        raise SpecError(
            f"{path!r} is not an Optuna journal ({type(exc).__name__}: {exc}); move it away or "
            "pass another --storage"
        ) from None
    return OpenedStorage(storage, "journal", path, lock_path=lock_path, journal=backend)


def _open_sqlite(path: str, *, shared_ok: bool = False) -> OpenedStorage:
    _make_parent(path)
    _check_regular(path, "the SQLite file")
    path = os.path.abspath(path)
    if not shared_ok:
        _refuse_foreign_tables(_sqlite_tables(path), f"SQLite file {path!r}")
    lock_path = path + ".lock"
    # Several workers started at once on a new file would race to create the tables ("table
    # already exists", "UNIQUE constraint failed: alembic_version"): create them under the lock.
    new_lock = not os.path.lexists(lock_path)
    try:
        with _file_lock(lock_path):
            storage = _rdb(
                f"sqlite:///{path}",
                engine_kwargs={"connect_args": {"timeout": SQLITE_TIMEOUT_S}},
                what=f"SQLite file {path!r}",
            )
    except SpecError:
        if new_lock:  # leave nothing behind for a file that is not a study
            with contextlib.suppress(OSError):
                os.unlink(lock_path)
        raise
    return OpenedStorage(storage, "sqlite", path, lock_path=lock_path, url=f"sqlite:///{path}")


def _open_rdb(url: str, *, shared_ok: bool = False) -> OpenedStorage:
    shown = _hide_password(url)
    if _is_postgres(url):
        # Workers started together on an empty database race to create Optuna's tables
        # ("duplicate key value violates unique constraint"): create them under a lock.
        schema_lock = _AdvisoryLock(url, "\0schema")
        try:
            with schema_lock:
                if not shared_ok:
                    _refuse_foreign_tables(_rdb_tables(url, shown), f"database {shown}")
                storage = _rdb(url, what=f"database {shown}")
        finally:
            schema_lock.close()
    else:
        if not shared_ok:
            _refuse_foreign_tables(_rdb_tables(url, shown), f"database {shown}")
        storage = _rdb(url, what=f"database {shown}")
    if not _is_postgres(url):
        warnings.warn(
            f"{shown}: autosearch has no study lock for this database (it has one for journal "
            "files, SQLite and PostgreSQL); several workers may finish a few trials more than "
            "asked",
            stacklevel=3,
        )
    return OpenedStorage(storage, "rdb", shown, url=url)


def _rdb(url: str, *, what: str, engine_kwargs: dict | None = None) -> "BaseStorage":
    import optuna
    import sqlalchemy.exc

    try:
        return optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs)
    except sqlalchemy.exc.NoSuchModuleError:
        scheme = url.split("://", 1)[0]
        raise SpecError(
            f"storage URL scheme {scheme!r} is not a database SQLAlchemy knows; use "
            "postgresql+psycopg://user:password@host/db, sqlite:///path.db, or a .journal file"
        ) from None
    except ImportError as exc:
        raise SpecError(
            f"the driver for {what} is not installed ({exc}); for PostgreSQL: "
            "pip install 'autosearch[postgres]' and a URL starting postgresql+psycopg://"
        ) from None
    except (sqlalchemy.exc.SQLAlchemyError, ValueError) as exc:
        detail = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
        raise SpecError(
            f"cannot open {what} as an Optuna study storage: {detail}. Check the URL, that the "
            "server runs and accepts you, or that the file is an Optuna SQLite study"
        ) from None


# ---- what a storage may hold --------------------------------------------------------------------
def _optuna_tables() -> frozenset[str]:
    """The tables Optuna's RDB storage creates (its SQLAlchemy models, and Alembic's version)."""
    from optuna.storages._rdb import models

    return frozenset(models.BaseModel.metadata.tables) | {"alembic_version"}


def _refuse_foreign_tables(tables: set[str], what: str) -> None:
    """Refuse to add Optuna's tables to a database that holds others; one that holds Optuna's
    already (shared once, with --storage-shared-ok) gains no table and opens."""
    optuna_tables = _optuna_tables()
    foreign = sorted(tables - optuna_tables)
    if foreign and not optuna_tables <= tables:
        shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
        raise SpecError(
            f"--storage: the {what} holds tables that are not Optuna's ({shown}); a study "
            "would add Optuna's 13 tables to it. Give a database or file of its own (e.g. "
            "results/<study>/study.db), or pass --storage-shared-ok to share this one"
        )


def _sqlite_tables(path: str) -> set[str]:
    """The tables of an existing SQLite file, read without writing to it (none for a new or
    empty file; a file that is not SQLite is left to Optuna's own message)."""
    import sqlite3

    if not os.path.isfile(path) or os.path.getsize(path) == 0:
        return set()
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=SQLITE_TIMEOUT_S)
    except sqlite3.Error:
        return set()
    try:
        rows = conn.execute("SELECT name FROM sqlite_master WHERE type IN ('table', 'view')")
        return {name for (name,) in rows if not name.startswith("sqlite_")}
    except sqlite3.Error:
        return set()
    finally:
        conn.close()


def _rdb_tables(url: str, shown: str) -> set[str]:
    """The tables and views of the database's default schema (an unreachable server is left to
    Optuna's own message)."""
    import sqlalchemy
    import sqlalchemy.exc

    try:
        engine = sqlalchemy.create_engine(url, poolclass=sqlalchemy.pool.NullPool)
    except (sqlalchemy.exc.SQLAlchemyError, ImportError, ValueError):
        return set()
    try:
        inspector = sqlalchemy.inspect(engine)
        return set(inspector.get_table_names()) | set(inspector.get_view_names())
    except (sqlalchemy.exc.SQLAlchemyError, ImportError):
        return set()
    finally:
        engine.dispose()


def _check_url_names_a_database(url: str) -> None:
    """A URL must name its database: ``sqlite://`` is an in-memory database (the study would
    be lost), ``postgresql://host`` a server's default one."""
    scheme = url.split("://", 1)[0]
    if scheme.split("+", 1)[0] == "sqlite":
        if not url.startswith("sqlite:///") or not url[len("sqlite:///") :].split("?", 1)[0]:
            raise SpecError(
                f"--storage {url!r} names no file (SQLite would keep the study in memory and "
                "lose it); give sqlite:///path/study.db (three slashes, then the path)"
            )
        return
    try:
        from sqlalchemy.engine import make_url

        parsed = make_url(url)
        parsed.get_dialect()  # an unknown scheme: Optuna's opener names it
        database = parsed.database
    except Exception:  # noqa: BLE001 - a malformed URL: Optuna's opener says what is wrong
        return
    if not database:
        raise SpecError(
            f"--storage {_hide_password(url)!r} names no database (the part after the host, "
            f"e.g. {scheme}://user@host/autosearch); create one (createdb autosearch) and name it"
        )


def _check_regular(path: str, what: str) -> None:
    """A storage file is a regular file or does not exist yet (a FIFO or a device would hang
    the opener or never end)."""
    from autosearch.core._io import file_kind

    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise SpecError(f"--storage: cannot read {what} {path!r}: {exc.strerror}") from None
    kind = file_kind(mode)
    if kind is not None:
        raise SpecError(f"--storage: {what} {path!r} is {kind}; give the path of a regular file")


def _kind_of(storage) -> str:
    import optuna

    if isinstance(storage, optuna.storages.JournalStorage):
        return "journal"
    if isinstance(storage, optuna.storages.RDBStorage):
        return "rdb"
    return "memory" if isinstance(storage, optuna.storages.InMemoryStorage) else "rdb"


def _is_postgres(url: str | None) -> bool:
    return url is not None and url.split("://", 1)[0].split("+", 1)[0] in (
        "postgresql",
        "postgres",
    )


def _hide_password(url: str) -> str:
    if "://" not in url or "@" not in url:
        return url
    scheme, rest = url.split("://", 1)
    creds, host = rest.rsplit("@", 1)
    user = creds.split(":", 1)[0]
    return f"{scheme}://{user}{':***' if ':' in creds else ''}@{host}"


def _make_parent(path: str) -> None:
    parent = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as exc:
        raise SpecError(
            f"cannot create the folder {parent!r} for the study storage: {exc.strerror}"
        ) from None


def _remove_optuna_lock_leftovers(path: str) -> None:
    """Optuna's symbolic-link journal lock leaves ``<journal>.lock<uuid>.rename`` files when a
    process dies while releasing it (journals written by earlier versions of autosearch)."""
    folder, name = os.path.split(os.path.abspath(path))
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for n in names:
        if n.startswith(name + ".lock") and n.endswith(".rename"):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(folder, n))


# ---- PostgreSQL advisory lock -------------------------------------------------------------------
class _AdvisoryLock:
    """A session-level PostgreSQL advisory lock on one dedicated connection (released by the
    server when the connection ends, so a killed worker never leaves it held)."""

    def __init__(self, url: str, study_name: str):
        import sqlalchemy

        digest = hashlib.blake2b(f"autosearch:{study_name}".encode(), digest_size=8).digest()
        self.key = int.from_bytes(digest, "big", signed=True)
        self._engine = sqlalchemy.create_engine(url, poolclass=sqlalchemy.pool.NullPool)
        self._conn = None
        self._depth = 0

    def __enter__(self):
        import sqlalchemy
        import sqlalchemy.exc

        if self._depth == 0:
            if self._conn is None:
                try:
                    self._conn = self._engine.connect().execution_options(
                        isolation_level="AUTOCOMMIT"
                    )
                except ImportError as exc:
                    raise SpecError(
                        f"the PostgreSQL driver is not installed ({exc}); pip install "
                        "'autosearch[postgres]' and a URL starting postgresql+psycopg://"
                    ) from None
                except sqlalchemy.exc.SQLAlchemyError as exc:
                    detail = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
                    raise SpecError(
                        f"cannot connect to {_hide_password(str(self._engine.url))}: {detail}"
                    ) from None
            self._conn.execute(sqlalchemy.text("SELECT pg_advisory_lock(:k)"), {"k": self.key})
        self._depth += 1
        return self

    def __exit__(self, *exc) -> None:
        import sqlalchemy

        self._depth -= 1
        if self._depth == 0 and self._conn is not None:
            self._conn.execute(sqlalchemy.text("SELECT pg_advisory_unlock(:k)"), {"k": self.key})

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        self._engine.dispose()


def _advisory_lock(url: str, study_name: str) -> _AdvisoryLock:
    key = (url, study_name)
    if key not in _ADVISORY_LOCKS:
        _ADVISORY_LOCKS[key] = _AdvisoryLock(url, study_name)
    return _ADVISORY_LOCKS[key]
