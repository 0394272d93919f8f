"""The SQLite store under its old name, for the tests and benches written against it (they build
one with ``Store(path)``). The controller's parts are typed by :class:`llmgw.store.protocol.Store`
and never import this; new code imports :mod:`llmgw.store`.
"""

from llmgw.store.base import USAGE_MINUTES_KEPT
from llmgw.store.protocol import USAGE_GROUPS
from llmgw.store.records import Applied, Event, SyncKind
from llmgw.store.sqlite import SCHEMA_VERSION
from llmgw.store.sqlite import SqliteStore as Store

__all__ = ["SCHEMA_VERSION", "USAGE_GROUPS", "USAGE_MINUTES_KEPT", "Applied", "Event", "Store", "SyncKind"]
