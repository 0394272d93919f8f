"""Fixtures for the node agent tests (helpers live in tests/agent/helpers.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from tests.agent.helpers import AGENT, ECHO_ENGINE, Node, confined_settings


def _port_block(size: int = 12) -> tuple[int, int]:
    # Spread over a wide range so parallel runs rarely meet; the agent skips busy ports anyway.
    base = 20000 + (os.getpid() * 37 + time.monotonic_ns()) % 30000
    return base, base + size - 1


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    root = tmp_path.resolve()  # a tmp dir reached through a symlink would trip the deletion guard
    paths = {name: root / name for name in ("cache", "models", "state", "bin")}
    for path in paths.values():
        path.mkdir()
    ports = _port_block()
    made = Node(root=root, config=root / "agent.json", ports=ports, **paths)
    made.write_config(
        cache_dir=str(made.cache), state_dir=str(made.state), model_dirs=[str(made.models)],
        port_range=list(ports), advertise_address="127.0.0.1",
        engines={
            "pyhttp": [sys.executable, "-m", "http.server"],
            "pyecho": [sys.executable, "-c", ECHO_ENGINE],
            "pysleep": [sys.executable, "-c", "import time; time.sleep(120)"],
        },
        gpus=[{"index": 0, "class": "h100", "memory_gb": 80}, {"index": 1, "class": "h100", "memory_gb": 80}],
        env_allow=["LLMGW_TEST_VALUE"], **{**confined_settings(), "local_sources": [str(root)]},
    )
    yield made
    _kill_leftover_engines(made.state)


def _kill_leftover_engines(state: Path) -> None:
    """Tests stop what they start; this only keeps a failed test from leaking engines."""
    for record_file in (state / "engines").glob("*.json"):
        record = json.loads(record_file.read_text())
        if not isinstance(record.get("pid"), int) or record["pid"] == os.getpid():
            continue  # the guard tests stand this test process in for a running engine
        stat_file = Path(f"/proc/{record['pid']}/stat")
        if stat_file.exists() and int(stat_file.read_text().rsplit(")", 1)[1].split()[19]) == record["pid_start"]:
            try:
                os.killpg(record["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture(scope="session")
def agent_module() -> ModuleType:
    """The agent imported in-process (for the guard's race and property tests)."""
    spec = importlib.util.spec_from_file_location("llmgw_agent_under_test", AGENT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
