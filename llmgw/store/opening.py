"""The store a controller config names (``store:``, or LLMGW_STORE): a path for SQLite, the
default ``llmgw.db`` in the data dir when absent, or a ``postgresql://`` URL.

Nothing is opened here (the controller's ``start()`` does that); a PostgreSQL URL is parsed,
so a malformed one stops the config from loading, and psycopg is imported only for one.
"""

from __future__ import annotations

from pathlib import Path

from llmgw.errors import ConfigError
from llmgw.redact import redact
from llmgw.store.protocol import Store

DEFAULT_FILE = "llmgw.db"
POSTGRES_SCHEMES = ("postgresql://", "postgres://")


def is_postgres(value: str | None) -> bool:
    return bool(value) and str(value).lower().startswith(POSTGRES_SCHEMES)


def store_for(value: str | None, data_dir: Path) -> Store:
    """The store ``value`` names, not yet opened: None or "" → SQLite ``llmgw.db`` in ``data_dir``
    (what `llmgw up` and every config without ``store`` get); a path → SQLite there (relative:
    to the data dir); ``postgresql://…`` → PostgreSQL. ConfigError for anything else, naming it
    redacted."""
    if is_postgres(value):
        from llmgw.store.postgres import PostgresStore

        return PostgresStore(str(value))
    from llmgw.store.sqlite import SqliteStore

    if not value:
        return SqliteStore(Path(data_dir) / DEFAULT_FILE)
    if "://" in value:
        raise ConfigError(f"store: {redact(value)} is neither a path (SQLite) nor a postgresql:// URL")
    path = Path(value).expanduser()
    return SqliteStore(path if path.is_absolute() else Path(data_dir) / path)
