"""What loading the store costs: its records (which gitops' status and the plan's readers use)
load no database driver, and the default store (`llmgw up`, SQLite) never loads psycopg."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.test_layers import loaded_by


@pytest.mark.parametrize(("module", "io"), [
    ("llmgw.store.records", ("sqlite3", "psycopg", "aiohttp", "llmgw.gitops", "llmgw.store.sqlite")),
    ("llmgw.gitops.status", ("sqlite3", "psycopg", "aiohttp", "llmgw.store.sqlite", "llmgw.store.postgres")),
    ("llmgw.store.protocol", ("sqlite3", "psycopg", "llmgw.store.sqlite", "llmgw.store.postgres")),
])
def test_the_records_and_the_protocol_load_no_driver(module: str, io: tuple[str, ...]) -> None:
    loaded = loaded_by(module)
    assert sorted(m for m in loaded if any(m == p or m.startswith(p + ".") for p in io)) == []


def test_the_default_store_does_not_load_psycopg() -> None:
    code = ("import sys, json, pathlib, llmgw.control.controller, llmgw.control.config\n"
            "from llmgw.store.opening import store_for\n"
            "store_for(None, pathlib.Path('/x')); store_for('state.db', pathlib.Path('/x'))\n"
            "print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    loaded = set(json.loads(out.stdout))
    assert "llmgw.store.sqlite" in loaded and not any(m.split(".")[0] == "psycopg" for m in loaded)
