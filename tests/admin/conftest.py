"""A running controller with its admin listener, on 2 real sshd nodes, served from a thread.

The CLI is synchronous (as an operator's shell is), so the controller runs in its own
event loop on a background thread and the tests talk to it over HTTP like anyone else.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from llmgw.admin.app import build_admin_app
from llmgw.catalog import cache_name
from llmgw.control import Controller
from llmgw.control.feed import FeedHub
from llmgw.serving import listen
from tests.conftest import git
from tests.fixtures.sshd_fleet import SshdFleet
from tests.reconciler.fleet_e2e import CatalogRepo, Recorder, make_controller, make_repo, ready, sim_model

TOKEN = "test-admin-token"
SECRET = "test-webhook-secret"


@dataclass
class Running:
    url: str
    controller: Controller
    loop: asyncio.AbstractEventLoop
    repo: CatalogRepo
    fleet: SshdFleet
    weights: str

    def call(self, coro, timeout: float = 30):  # noqa: ANN001, ANN201 - test helper
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def wait(self, check, timeout: float = 30.0, what: str = "condition") -> None:  # noqa: ANN001
        import time

        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} not met within {timeout}s")
            time.sleep(0.05)


def put_cache_entry(cache_dir: Path, source: str, payload: bytes = b"x" * 1024) -> Path:
    """A complete cache entry as the agent would leave it (for a source no model uses)."""
    name = cache_name(source)
    entry = cache_dir / name
    entry.mkdir(parents=True)
    (entry / "weights.bin").write_bytes(payload)
    (entry / "llmgw-manifest.json").write_text(json.dumps({"source": source, "bytes": len(payload)}))
    return entry


@pytest.fixture(scope="module")
def running(sshd_fleet, tmp_path_factory) -> Iterator[Running]:
    fleet = sshd_fleet(2)
    tmp = tmp_path_factory.mktemp("admin")
    wfile = tmp / "weights.bin"
    wfile.write_bytes(os.urandom(2048))
    weights = f"file://{wfile}"
    repo = make_repo(tmp, fleet, {"chat": sim_model("chat", weights, min_=1, max_=2)})
    # A working repository that takes pushes, as `llmgw up` sets its own up.
    git(repo.path, "config", "receive.denyCurrentBranch", "updateInstead")
    loop = asyncio.new_event_loop()
    started = threading.Event()
    state: dict = {}

    async def main() -> None:
        c = make_controller(repo, tmp / "data", fleet, Recorder())
        await c.start()
        app = build_admin_app(c, token=TOKEN, webhook_secret=SECRET, hub=FeedHub())
        # The admin listener's own wiring, as `llmgw controller` serves it.
        runner = await listen(app, "127.0.0.1", 0, drain_timeout=5.0, max_connections=256, openai_errors=False)
        state.update(controller=c, runner=runner, url=f"http://127.0.0.1:{runner.addresses[0][1]}")
        started.set()

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(main(), loop).result(60)
    started.wait(10)
    r = Running(state["url"], state["controller"], loop, repo, fleet, weights)
    r.wait(lambda: len(ready(r.controller)) == 1, what="chat ready")
    yield r

    async def stop() -> None:
        await state["runner"].cleanup()
        c = state["controller"]
        for f in (repo.path / "models").glob("*.yaml"):
            f.unlink()
        repo.commit({}, "Retire\n\nLlmgw-Allow-Prune: yes")
        await c.follower.sync_once()
        for _ in range(200):
            if not c.reconciler.snapshot():
                break
            await asyncio.sleep(0.1)
        await c.close()

    asyncio.run_coroutine_threadsafe(stop(), loop).result(60)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
