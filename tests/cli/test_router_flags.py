"""`llmgw router` names its controller as every other command does: `--url` with `--token` or
`$LLMGW_ADMIN_TOKEN`, and the older `--controller`/`--admin-token` (tests/router use those)."""

from __future__ import annotations

import time
import urllib.error
from pathlib import Path

import pytest

from tests.e2e.processes import free_port
from tests.router.conftest import TOKEN, Proc, fake_controller, get_json, write_state

pytestmark = pytest.mark.slow


def models(router: Proc) -> list[str]:
    deadline = time.monotonic() + 30  # a bound on a hang: the router learns the catalog from its feed
    while True:
        try:
            names = [m["id"] for m in get_json(router.url + "/v1/models")["data"]]
        except (OSError, urllib.error.URLError):
            names = []
        if names or time.monotonic() > deadline:
            return names
        time.sleep(0.05)


@pytest.mark.parametrize("how", ["--url and the environment's token", "--url and --token"])
def test_the_router_follows_a_controller_named_with_url(how: str, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    state = tmp_path / "state.json"
    write_state(state, [{"name": "chat"}], [])
    ctl = fake_controller(tmp_path, state).start("/test/usage")
    port = free_port()
    flags = ["--url", ctl.url]
    if how == "--url and --token":
        flags += ["--token", TOKEN]
    else:
        monkeypatch.setenv("LLMGW_ADMIN_TOKEN", TOKEN)  # inherited by the router's process
    router = Proc("llmgw.router.main", *flags, "--listen", f"127.0.0.1:{port}", port=port,
                  log=tmp_path / "router.log")
    try:
        router.start("/health")
        assert models(router) == ["chat"], router.log.read_text()
    finally:
        router.stop()
        ctl.stop()
