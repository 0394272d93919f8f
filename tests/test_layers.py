"""The layers of DESIGN §1 hold in what is loaded, not only in what the code says: the pure
decisions and the standalone router load no I/O of the control plane (seen: `llmgw.plan` loaded
aiohttp, sqlite3, GitPython, gitops and dispatch; `llmgw.router.app` loaded gitops, the
reconciler and dispatch). The static contracts are in pyproject.toml, checked here too."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

CONTROL_PLANE = ("llmgw.gitops", "llmgw.dispatch", "llmgw.control", "llmgw.admin", "llmgw.reconciler.reconciler",
                 "llmgw.reconciler.lifecycle", "llmgw.reconciler.live", "llmgw.state")


def loaded_by(module: str) -> set[str]:
    code = f"import sys, json, {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    return set(json.loads(out.stdout))


@pytest.mark.parametrize(("module", "io"), [
    ("llmgw.plan", ("aiohttp", "sqlite3", "paramiko", "git", "watchfiles", "prometheus_client")),
    ("llmgw.decide.tick", ("aiohttp", "sqlite3", "paramiko", "git", "watchfiles", "prometheus_client")),
    ("llmgw.catalog", ("aiohttp", "sqlite3", "paramiko", "git", "watchfiles", "prometheus_client")),
    ("llmgw.router.main", ("sqlite3", "paramiko", "git", "watchfiles")),
    ("llmgw.contract", ("aiohttp", "sqlite3", "paramiko", "git", "watchfiles", "prometheus_client")),
    # The tenants' rules and the in-memory limiter (issue 29): no event loop, no Redis client.
    ("llmgw.tenancy.memory", ("asyncio", "aiohttp", "redis", "sqlite3", "paramiko", "git", "watchfiles",
                              "prometheus_client")),
])
def test_importing_a_layer_loads_nothing_below_it(module: str, io: tuple[str, ...]) -> None:
    loaded = loaded_by(module)
    # Whole package names: llmgw.adminaccess (where commands find the admin API) is not llmgw.admin.
    wrong = sorted(m for m in loaded if m.split(".")[0] in io
                   or any(m == p or m.startswith(p + ".") for p in CONTROL_PLANE))
    assert wrong == [], f"importing {module} loads {wrong}"


def test_the_import_contracts_are_kept() -> None:
    lint = Path(sys.executable).parent / "lint-imports"
    out = subprocess.run([str(lint)], capture_output=True, text=True, timeout=120, check=False,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stdout[-3000:]
    assert "0 broken" in out.stdout
