"""The controller's store: one Protocol (:class:`Store`), SQLite in the data dir (the embedded
default) and PostgreSQL (several controllers), and :func:`open_store` to pick one from the
controller config's ``store`` (DESIGN §5 "High availability", §7).

    Store            the Protocol every part of the controller is typed by (llmgw.store.protocol)
    SqliteStore      one file in the data dir (llmgw.store.sqlite)
    PostgresStore    a database several controllers share, with the leader lease (llmgw.store.postgres)
    store_for        the store a config value names, not yet opened (llmgw.store.opening)
    Applied, Event, LeaseGrant, Leadership, ...   the records (llmgw.store.records, pure)

Exports resolve on first use: the records must not load sqlite3 or psycopg, and `llmgw up`
never loads psycopg.
"""

from llmgw.lazy import lazy_exports

_RECORDS = ("Applied", "Event", "History", "LeaseGrant", "Leadership", "PendingPrune", "Rejection", "Rewrite",
            "SyncKind")
_EXPORTS = {
    "Store": "llmgw.store.protocol", "SqliteStore": "llmgw.store.sqlite", "PostgresStore": "llmgw.store.postgres",
    "store_for": "llmgw.store.opening", "DatabaseError": "llmgw.store.base",
    **{name: "llmgw.store.records" for name in _RECORDS},
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
