"""An open router (no API keys) on an address others can reach is said out loud: a warning in the
log at start and a banner on the dashboard; a standalone router says which keys it enforces (it
had logged "open: no API keys" while enforcing the keys its controller sent).

Real processes: `llmgw controller --config` with a catalog of no nodes, `llmgw router` following it.
"""

from __future__ import annotations

import json
import re
import signal
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from llmgw.router.exposure import is_loopback, open_warning
from llmgw.router.keys import hash_key
from tests.conftest import git
from tests.e2e.processes import free_port, start, stop, wait_for

TOKEN = "open-router-admin-token"
KEY = "sk-team-a-0123456789"


def test_which_addresses_others_can_reach() -> None:
    for host in ("127.0.0.1", "127.3.0.9", "::1", "[::1]", "localhost"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "", "10.0.0.5", "llmgw.example.com"):
        assert not is_loopback(host), host
    assert open_warning(keys_open=True, host="127.0.0.1", port=8080) is None
    assert open_warning(keys_open=False, host="0.0.0.0", port=8080) is None
    said = open_warning(keys_open=True, host="0.0.0.0", port=8080)
    assert said is not None and said.startswith("the router on 0.0.0.0:8080 is open: there are no API keys")
    assert "[::]:8080" in (open_warning(keys_open=True, host="::", port=8080) or "")


def _catalog(tmp: Path) -> Path:
    repo = tmp / "catalog"
    (repo / "models").mkdir(parents=True)
    (repo / "nodes.yaml").write_text("nodes: []\n")
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "An empty fleet")
    return repo


@contextmanager
def _controller(tmp: Path, name: str, *, router_host: str, keys: bool) -> Iterator[tuple[str, Path]]:
    admin = f"http://127.0.0.1:{free_port()}"
    config = tmp / f"{name}.yaml"
    config.write_text(json.dumps({
        "repo": str(_catalog(tmp / name)), "data_dir": str(tmp / name / "data"),
        "listen": {"router": f"{router_host}:{free_port()}", "admin": admin.removeprefix("http://")},
        "admin_token": TOKEN,
        **({"api_keys": [{"name": "team-a", "sha256": hash_key(KEY), "models": ["*"]}]} if keys else {}),
    }))
    log = tmp / f"{name}.log"
    proc = start(["controller", "--config", str(config)], log)
    try:
        wait_for(lambda: "admin API:" in log.read_text(), 60, f"{name} started", proc)
        yield admin, log
    finally:
        stop(proc, signal.SIGTERM)


def _dashboard(admin: str) -> str:
    req = urllib.request.Request(admin + "/", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=20) as r:
        return r.read().decode()


BANNER = re.compile(r'<div class="err" id="open-router">(.*?)</div>', re.S)


@pytest.mark.slow
def test_an_open_router_on_every_address_warns_in_the_log_and_on_the_dashboard(tmp_path: Path) -> None:
    with _controller(tmp_path, "open", router_host="0.0.0.0", keys=False) as (admin, log):
        text = log.read_text()
        assert re.search(r"WARNING \S+: the router on 0\.0\.0\.0:\d+ is open: there are no API keys", text), text
        (banner,) = BANNER.findall(_dashboard(admin))
        assert "is open: there are no API keys, so anyone who can reach it may use every model" in banner

        # A standalone router following it on every address says the same once it has the keys (none).
        rlog = tmp_path / "router-open.log"
        router = start(["router", "--url", admin, "--listen", f"0.0.0.0:{free_port()}"], rlog,
                       env={"LLMGW_ADMIN_TOKEN": TOKEN})
        try:
            wait_for(lambda: "is open: there are no API keys" in rlog.read_text(), 60, "the router's warning", router)
        finally:
            stop(router, signal.SIGTERM)


@pytest.mark.slow
def test_a_router_with_keys_or_on_loopback_is_quiet_and_says_which_keys_it_enforces(tmp_path: Path) -> None:
    with _controller(tmp_path, "keyed", router_host="0.0.0.0", keys=True) as (admin, log):
        assert "is open" not in log.read_text()
        assert not BANNER.findall(_dashboard(admin))
        rlog = tmp_path / "router-keyed.log"
        router = start(["router", "--url", admin, "--listen", f"0.0.0.0:{free_port()}"], rlog,
                       env={"LLMGW_ADMIN_TOKEN": TOKEN})
        try:
            wait_for(lambda: "1 API key from the controller" in rlog.read_text(), 60, "the router's keys", router)
        finally:
            stop(router, signal.SIGTERM)
        text = rlog.read_text()
        assert "open" not in re.sub(r"(?i)opening|\bopen(ed)? files\b", "", text), text
    with _controller(tmp_path, "loopback", router_host="127.0.0.1", keys=False) as (admin, log):
        assert "is open" not in log.read_text()
        assert not BANNER.findall(_dashboard(admin))


def test_the_standalone_routers_keys_file_is_counted_at_start(tmp_path: Path) -> None:
    """`--api-keys FILE` is known at start: the line names the file and the count, never "open"."""
    keys = tmp_path / "keys.yaml"
    keys.write_text(f"- {{name: a, sha256: {hash_key(KEY)}, models: ['*']}}\n")
    log = tmp_path / "router.log"
    # No controller: the router starts, logs its keys and goes on trying to reach it.
    router = start(["router", "--url", f"http://127.0.0.1:{free_port()}", "--listen", f"0.0.0.0:{free_port()}",
                    "--api-keys", str(keys)], log, env={"LLMGW_ADMIN_TOKEN": TOKEN})
    try:
        wait_for(lambda: f"1 API key from {keys}" in log.read_text(), 60, "the router's start line", router)
    finally:
        assert stop(router, signal.SIGTERM) in (0, -signal.SIGTERM), log.read_text()
    assert "is open" not in log.read_text()
