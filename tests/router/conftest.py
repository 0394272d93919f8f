"""Router test fixtures: simulated engines as real processes, routers on real ports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
import weakref
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import openai
import pytest
from aiohttp import web

from llmgw.contract import Endpoint
from llmgw.engines.testing import PACKAGE_ROOT, SimProcess, free_port
from llmgw.router import Router
from llmgw.tenancy.usage import Usage, UsageOutbox
from tests.conftest import REPO_ROOT

TOKEN = "admin-secret"


def endpoint(model: str, url: str, rid: str | None = None, *, names: tuple[str, ...] = (), priority: int = 0,
             weight: float = 1.0, task: str = "chat") -> Endpoint:
    return Endpoint(replica_id=rid or f"{model}-g1", model=model, names=names or (model,), url=url, engine="sim",
                    profile="sim", priority=priority, task=task, weight=weight)


@asynccontextmanager
async def serving_app(app: web.Application) -> AsyncIterator[str]:
    """A real HTTP server for ``app`` (a scripted engine) on a free loopback port; yields its URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


@asynccontextmanager
async def serving(router: Router) -> AsyncIterator[str]:
    """``router`` started and listening on a free port; yields its base URL."""
    await router.start()
    try:
        port = await router.listen("127.0.0.1", 0)
        yield f"http://127.0.0.1:{port}"
    finally:
        await router.close()


def client(base: str, key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=15)


def router_metric(router: Router, name: str, **labels: str) -> float:
    """One series of ``router``'s /metrics as a scrape would read it (0 when absent)."""
    return router.registry.get_sample_value(name, labels) or 0.0


# Rows a batch taken and acknowledged leaves the outbox: what ledger_usage read so far, per outbox.
_handed: weakref.WeakKeyDictionary[UsageOutbox, dict[tuple[str, str], Usage]] = weakref.WeakKeyDictionary()


def ledger_usage(router: Router) -> dict[tuple[str, str], Usage]:
    """What ``router`` has handed the controller's usage ledger, summed per (API key, model) as the
    ledger sums it: its outbox's batches taken and acknowledged as a controller does (so only for
    a router no controller reads)."""
    outbox = router.usage.outbox
    totals = _handed.setdefault(outbox, {})
    while (batch := outbox.take()) is not None:
        for row in batch.rows:
            counts = {k: v for k, v in row.to_json().items() if k not in ("minute", "tenant", "key", "model")}
            totals.setdefault((row.key, row.model), Usage()).add(Usage(**counts))
        outbox.acked(batch.seq)
    return {k: Usage(**u.to_json()) for k, u in totals.items()}


def sim_metric(endpoint_url: str, name: str) -> float:
    with urllib.request.urlopen(endpoint_url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


@pytest.fixture(scope="module")
def chat_sim() -> Iterator[SimProcess]:
    # "cold" is served here too: the scale-from-zero tests publish it once the "replica is ready".
    with SimProcess("chat", "--alias", "cold") as sim:
        yield sim


@pytest.fixture(scope="module")
def stream_sim() -> Iterator[SimProcess]:
    with SimProcess("stream", "--ttft", "0.2", "--tokens-per-second", "20") as sim:
        yield sim


@pytest.fixture(scope="module")
def embed_sim() -> Iterator[SimProcess]:
    with SimProcess("embed", "--task", "embedding", "--embedding-dim", "16") as sim:
        yield sim


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_ROOT, str(REPO_ROOT), e.get("PYTHONPATH")) if p)
    return e


class Proc:
    """A Python module run as a subprocess on a port (a fake controller, a router)."""

    def __init__(self, *argv: str, port: int, log: Path) -> None:
        self.argv = [sys.executable, "-m", *argv]
        self.port = port
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, ready_path: str = "/", timeout: float = 60.0) -> Proc:  # a bound on a hang
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env())
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.argv} exited: {self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + ready_path, timeout=1) as resp:
                    if resp.status == 200:
                        return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"{self.argv} not ready: {self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def rss_kb(self) -> int:
        assert self.proc is not None
        with open(f"/proc/{self.proc.pid}/status", encoding="ascii") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def write_state(path: Path, models: list[dict], endpoints: list[Endpoint]) -> None:
    path.write_text(json.dumps({"models": models, "endpoints": [e.to_json() for e in endpoints]}))


def fake_controller(tmp: Path, state: Path, port: int | None = None) -> Proc:
    port = port or free_port()
    return Proc("tests.router.fake_controller", "--port", str(port), "--token", TOKEN, "--state", str(state),
                port=port, log=tmp / f"controller-{port}.log")


def router_process(tmp: Path, controller: Proc, *extra: str) -> Proc:
    port = free_port()
    return Proc("llmgw.router.main", "--controller", controller.url, "--admin-token", TOKEN,
                "--listen", f"127.0.0.1:{port}", "--report-interval", "0.5", *extra,
                port=port, log=tmp / f"router-{port}.log")


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())
