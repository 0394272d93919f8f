"""Fixtures shared by the reconciler's tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw.state import Store


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    """A real controller store (SQLite) in a fresh directory."""
    s = Store(tmp_path / "state.db").open()
    yield s
    s.close()
