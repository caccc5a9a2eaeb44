"""A study never takes over a database or a file that is not its own (issue 22, items 4 and 5).

A SQLite file or a PostgreSQL database that holds tables other than Optuna's is refused (Optuna
would add its 13 tables to the user's database) unless the caller says it may be shared; a URL
that names no database is refused naming ``--storage``; a FIFO or a device given as the storage
file is refused before it is opened.
"""

from __future__ import annotations

import os
import sqlite3

import pytest
from test_postgres import postgres_url  # noqa: F401 - the throwaway server fixture

from autosearch import SpecError
from autosearch.tuning._storage import open_study_storage

SMALL = dict(model="llama3-8b", cluster="h100-sxm:1x8", global_batch_size=64)


def _user_db(path) -> None:
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT)")
        conn.execute("INSERT INTO customers (name) VALUES ('Ada')")


def _tables(path) -> set[str]:
    with sqlite3.connect(path) as conn:
        return {n for (n,) in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}


@pytest.mark.parametrize("form", ["path", "url"])
def test_a_sqlite_file_with_other_tables_is_refused_unless_shared(tmp_path, form):
    db = tmp_path / "app.db"
    _user_db(db)
    storage = str(db) if form == "path" else f"sqlite:///{db}"
    before = db.read_bytes()
    with pytest.raises(SpecError, match=r"not Optuna's \(customers\).*--storage-shared-ok"):
        open_study_storage(storage)
    assert db.read_bytes() == before and _tables(db) == {"customers"}
    assert not (tmp_path / "app.db.lock").exists()
    opened = open_study_storage(storage, shared_ok=True)
    assert opened is not None and "studies" in _tables(db) and "customers" in _tables(db)


def test_a_study_database_opens_again(tmp_path):
    """Optuna's own tables are not foreign: a study's SQLite file reopens (and resumes)."""
    from autosearch import tune

    db = str(tmp_path / "study.db")
    tune(**SMALL, n_trials=3, seed=0, storage=db, study_name="s")
    result = tune(**SMALL, n_trials=5, seed=1, storage=db, study_name="s")
    assert result.n_trials == 5


def test_tune_refuses_a_foreign_database_before_writing_anything(tmp_path, capsys):
    from autosearch.cli import main

    db = tmp_path / "app.db"
    _user_db(db)
    argv = ["tune", "--model", "llama3-8b", "--cluster", "h100-sxm:1x8"]
    argv += ["--global-batch-size", "64", "--n-trials", "3", "--quiet"]
    argv += ["--storage", f"sqlite:///{db}", "--out", str(tmp_path / "out")]
    assert main(argv) == 2
    assert "customers" in capsys.readouterr().err
    assert _tables(db) == {"customers"}


def test_tune_shares_a_database_when_told_and_reopens_it_without_the_flag(tmp_path):
    """--storage-shared-ok adds Optuna's tables next to the user's (their rows untouched); a
    later run opens the same database without it, as it adds no table then."""
    from autosearch.cli import main

    db = tmp_path / "app.db"
    _user_db(db)
    argv = ["tune", "--model", "llama3-8b", "--cluster", "h100-sxm:1x8", "--quiet"]
    argv += ["--global-batch-size", "64", "--n-trials", "3", "--storage", f"sqlite:///{db}"]
    argv += ["--study-name", "shared", "--out", str(tmp_path / "out")]
    assert main([*argv, "--storage-shared-ok"]) == 0
    assert {"customers", "studies", "trials"} <= _tables(db)
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT name FROM customers").fetchall() == [("Ada",)]
    argv[argv.index("3")] = "5"
    assert main([*argv, "--out", str(tmp_path / "out2")]) == 0
    from autosearch.tuning._storage import open_study_storage as reopen

    opened = reopen(f"sqlite:///{db}")
    assert opened is not None
    study = opened.storage.get_all_studies()[0]
    assert len(opened.storage.get_all_trials(study._study_id)) == 5


@pytest.mark.parametrize("url", ["sqlite://", "sqlite:///", "sqlite:///?timeout=5"])
def test_a_sqlite_url_without_a_path_names_storage(url):
    with pytest.raises(SpecError, match=r"--storage .*names no file"):
        open_study_storage(url)


def test_a_database_url_without_a_database_names_storage():
    with pytest.raises(SpecError, match=r"--storage .*names no database"):
        open_study_storage("postgresql+psycopg://me:secret@127.0.0.1:1")


@pytest.mark.parametrize("suffix", [".journal", ".db"])
def test_a_fifo_or_a_device_as_storage_is_refused_before_it_is_opened(tmp_path, suffix):
    fifo = tmp_path / f"s{suffix}"
    os.mkfifo(fifo)
    with pytest.raises(SpecError, match="named pipe"):
        open_study_storage(str(fifo))
    link = tmp_path / f"null{suffix}"
    link.symlink_to("/dev/null")
    with pytest.raises(SpecError, match="character device"):
        open_study_storage(str(link))


@pytest.mark.slow
def test_a_postgresql_database_with_other_tables_is_refused_unless_shared(postgres_url):  # noqa: F811
    import sqlalchemy

    engine = sqlalchemy.create_engine(postgres_url)
    with engine.begin() as conn:
        conn.execute(sqlalchemy.text("CREATE TABLE invoices (id serial PRIMARY KEY)"))
    with pytest.raises(SpecError, match=r"not Optuna's \(invoices\)"):
        open_study_storage(postgres_url)
    assert set(sqlalchemy.inspect(engine).get_table_names()) == {"invoices"}
    assert open_study_storage(postgres_url, shared_ok=True) is not None
    assert "studies" in set(sqlalchemy.inspect(engine).get_table_names())
    engine.dispose()
