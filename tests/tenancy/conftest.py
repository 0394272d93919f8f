"""A real redis-server per test for the shared limits (CI installs it; a skip fails the run there)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from llmgw.engines.testing import free_port
from tests.router.test_budget_ledger import redis_server


@pytest.fixture
def redis_url() -> Iterator[str]:
    if not shutil.which("redis-server"):
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    port = free_port()
    proc = redis_server(port)
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.kill()
        proc.wait(5)
