"""Which store a controller config names (``store:``, LLMGW_STORE), a controller running on
PostgreSQL, and the password: in no URL shown, no error, no log line, no repr."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest

from llmgw.control.config import ENV_STORE, ControllerConfig, load_config
from llmgw.control.controller import Controller
from llmgw.dispatch.recording import RecordingDispatcher
from llmgw.errors import ConfigError
from llmgw.reconciler.config import ReconcilerConfig
from llmgw.store.opening import store_for
from llmgw.store.postgres import PostgresStore
from llmgw.store.sqlite import SqliteStore
from tests.catalog.corpus import write_catalog
from tests.conftest import git
from tests.fixtures.postgres import PostgresServer

SECRET = "pw-7Hq2"


def test_no_store_is_sqlite_in_the_data_dir_as_llmgw_up_has_it(tmp_path: Path) -> None:
    for value in (None, ""):
        store = store_for(value, tmp_path)
        assert isinstance(store, SqliteStore) and store.path == tmp_path / "llmgw.db"
    assert store_for("state/other.db", tmp_path).where == str(tmp_path / "state" / "other.db")
    assert store_for("/srv/llmgw.db", tmp_path).where == "/srv/llmgw.db"


def test_a_postgresql_url_names_postgresql_and_shows_no_password(tmp_path: Path) -> None:
    for url in (f"postgresql://llmgw:{SECRET}@db.example.com:5432/llmgw", f"postgres://llmgw:{SECRET}@db/llmgw",
                f"postgresql://llmgw@db/llmgw?password={SECRET}&sslmode=require"):
        store = store_for(url, tmp_path)
        assert isinstance(store, PostgresStore)
        assert SECRET not in store.where and SECRET not in repr(store) and "***" in store.where


@pytest.mark.parametrize("value", [f"mysql://root:{SECRET}@db/x", f"postgresql://u:{SECRET}@db/x?bogus=1"])
def test_a_store_that_is_neither_is_refused_without_its_password(tmp_path: Path, value: str) -> None:
    with pytest.raises(ConfigError) as caught:
        store_for(value, tmp_path)
    assert SECRET not in str(caught.value) and "store:" in str(caught.value)


def test_the_config_file_or_the_environment_names_the_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_STORE, raising=False)
    path = tmp_path / "controller.yaml"
    path.write_text("repo: /srv/catalog\ndata_dir: data\n")
    assert load_config(path).controller.store is None  # SQLite in the data dir
    path.write_text(f"repo: /srv/catalog\nstore: postgresql://llmgw:{SECRET}@db/llmgw\n")
    config = load_config(path)
    assert config.controller.store == f"postgresql://llmgw:{SECRET}@db/llmgw"
    assert SECRET not in repr(config) and SECRET not in repr(config.controller)
    monkeypatch.setenv(ENV_STORE, f"postgresql://llmgw:{SECRET}@other/llmgw")  # the environment wins
    assert load_config(path).controller.store == f"postgresql://llmgw:{SECRET}@other/llmgw"
    monkeypatch.setenv(ENV_STORE, f"redis://:{SECRET}@cache")
    with pytest.raises(ConfigError, match="controller.yaml: store: redis://:\\*\\*\\*@cache is neither") as caught:
        load_config(path)
    assert SECRET not in str(caught.value)
    monkeypatch.delenv(ENV_STORE)
    path.write_text("repo: /srv/catalog\nstore: 5432\n")
    with pytest.raises(ConfigError, match="store: 5432 must be a string"):
        load_config(path)


def test_an_unreachable_server_is_a_config_error_naming_it_without_the_password(
        postgres_server: PostgresServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    closed = f"postgresql://llmgw:{SECRET}@127.0.0.1:1/llmgw"  # nothing listens on port 1
    started = time.monotonic()
    with pytest.raises(ConfigError, match="127.0.0.1:1/llmgw: cannot use the store") as caught:
        PostgresStore(closed, timeout=2).open()
    assert time.monotonic() - started < 30  # bounded by the connect timeout, not TCP's own
    assert SECRET not in str(caught.value) and "llmgw:***@" in str(caught.value)
    missing = postgres_server.url("no_such_db", password=SECRET)
    with pytest.raises(ConfigError, match="no_such_db") as caught:
        PostgresStore(missing).open()
    assert SECRET not in str(caught.value) and SECRET not in caplog.text


def test_a_failing_call_is_a_store_error_and_the_next_call_reconnects(postgres_server: PostgresServer,
                                                                      postgres_url: str) -> None:
    from llmgw.errors import StoreError

    store = PostgresStore(postgres_url, timeout=1).open()
    store.set_node_state("n1", "cordoned")
    dbname = postgres_url.rsplit("/", 1)[1]
    postgres_server.sql(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{dbname}' "
                        "AND pid <> pg_backend_pid()")
    with pytest.raises(StoreError):  # its connection was cut under it
        store.node_states()
    assert store.node_states() == {"n1": "cordoned"}  # a new one
    with pytest.raises(StoreError, match="statement timeout"):  # every call is bounded
        store._one("SELECT pg_sleep(5)", ())
    assert store.node_states() == {"n1": "cordoned"}
    store.close()


def _catalog_repo(tmp_path: Path) -> Path:
    repo = tmp_path / "catalog"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    write_catalog(repo)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "Initial catalog")
    return repo


async def _run_controller(repo: Path, data: Path, store: str, caplog: pytest.LogCaptureFixture) -> str | None:
    config = ControllerConfig(repo=str(repo), data_dir=data, fetch_interval=60, watch=False, store=store,
                              reconciler=ReconcilerConfig(tick_interval=0.2))
    controller = Controller(config, dispatcher=RecordingDispatcher(["gpu-1", "gpu-2", "a100-1", "cpu-1"]))
    await controller.start()
    try:
        deadline = time.monotonic() + 30
        while controller.store.applied() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        applied = controller.store.applied()
        return applied.sha if applied else None
    finally:
        await controller.close()
        assert SECRET not in caplog.text


async def test_a_controller_keeps_its_state_in_postgresql(tmp_path: Path, postgres_server: PostgresServer,
                                                          postgres_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """What a standby with another data dir will read: the applied revision, the events, and
    nothing of it in the data dir. (Standbys themselves are llmgw.control.leadership's tests.)"""
    caplog.set_level(logging.INFO)
    url = postgres_server.url(postgres_url.rsplit("/", 1)[1], password=SECRET)
    repo = _catalog_repo(tmp_path)
    head = git(repo, "rev-parse", "HEAD")
    assert await _run_controller(repo, tmp_path / "data-a", url, caplog) == head
    assert not (tmp_path / "data-a" / "llmgw.db").exists()
    store = PostgresStore(url).open()
    try:
        applied = store.applied()
        assert applied is not None and applied.sha == head and store.events()
    finally:
        store.close()
    assert "store: postgresql://llmgw:***@127.0.0.1" in caplog.text
