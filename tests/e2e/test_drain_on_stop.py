"""A replica on its way out finishes what it is answering: real `llmgw controller` and a
standalone `llmgw router`, both streaming from the one replica when the model is retired in git.

Before, the engine was stopped in the tick that withdrew it: every stream in flight was cut (a
failed answer no client can retry), through a scale-down, a rollout or a retirement alike. Now the
controller waits until no router has a request on it and every router serves without it, up to
``drain_timeout``, then stops it.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.conftest import git
from tests.e2e.processes import (
    SIM_CHAT_MODEL_YAML,
    LocalController,
    free_port,
    local_controller,
    start,
    stop_everything,
    wait_for,
)
from tests.e2e.test_up import processes_under

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]  # its waits allow 90 s (the default timeout: 60)
TOKEN = "drain-admin-token"
TOKENS = 60
# 10 tokens a second: each stream runs ~6 s, longer than the stop grace the agent allows. Two
# generations at a time: two streams straight to the engine take both, and what the routers send
# waits at the engine, in flight, until the test lets those two go (not for as long as a pace of
# tokens outlasts a retirement on whatever machine).
PACED = SIM_CHAT_MODEL_YAML + '    args: ["--tokens-per-second", "10", "--max-running", "2"]\n'


def api(admin: str, path: str, method: str = "GET") -> Any:
    req = urllib.request.Request(admin + path, method=method, data=b"{}" if method == "POST" else None,
                                 headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def setup(tmp_path: Path, *, drain: str, grace: str = "3s") -> LocalController:
    return local_controller(tmp_path, model_yaml=PACED, token=TOKEN,
                            reconciler={"stop_grace": grace, "drain_timeout": drain})


class Stream(threading.Thread):
    """One streamed answer, consumed as it comes: its chunks, how it ended."""

    def __init__(self, base: str, max_tokens: int = TOKENS, *, model: str = "chat",
                 leave: threading.Event | None = None) -> None:
        super().__init__(daemon=True)
        self.client = openai.OpenAI(base_url=base + "/v1", api_key="unused", timeout=120, max_retries=0)
        self.max_tokens = max_tokens
        self.model = model
        self.leave = leave  # set: the client goes away at its next chunk
        self.chunks: list[Any] = []
        self.error: Exception | None = None
        self.ended_at: float | None = None

    def run(self) -> None:
        try:
            with self.client.chat.completions.create(
                    model=self.model, messages=[{"role": "user", "content": "a long one"}],
                    max_tokens=self.max_tokens, stream=True) as answer:
                for chunk in answer:
                    self.chunks.append(chunk)
                    if self.leave is not None and self.leave.is_set():
                        break
        except openai.APIError as exc:
            self.error = exc
        self.ended_at = time.monotonic()

    @property
    def tokens(self) -> int:
        """The simulator's tokens are its words (1 to 3 in each event)."""
        return sum(len((c.choices[0].delta.content or "").split()) for c in self.chunks if c.choices)

    @property
    def finish(self) -> list[str]:
        return [c.choices[0].finish_reason for c in self.chunks if c.choices and c.choices[0].finish_reason]


def retire(repo: Path, admin: str) -> None:
    git(repo, "rm", "-q", "models/sim-chat.yaml")
    git(repo, "commit", "-qm", "Retire sim-chat\n\nLlmgw-Allow-Prune: yes")
    api(admin, "/api/v1/sync", "POST")


def replica_states(admin: str) -> list[str]:
    return [r["state"] for r in api(admin, "/api/v1/replicas")]


def events(admin: str, kind: str) -> list[dict]:
    return [e for e in api(admin, "/api/v1/events?limit=200") if e["kind"] == kind]


def engine_queue(endpoint: str) -> tuple[float, float]:
    """(running, waiting) as the engine itself counts them."""
    with urllib.request.urlopen(endpoint + "/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    return tuple(sum(float(x.rsplit(" ", 1)[1]) for x in lines if x.startswith(name))  # type: ignore[return-value]
                 for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"))


def test_streams_in_flight_on_both_routers_finish_before_the_engine_stops(tmp_path: Path) -> None:
    c = setup(tmp_path, drain="120s")
    url = {"router": c.router, "admin": c.admin}
    controller = start(["controller", "--config", str(c.config)], tmp_path / "controller.log")
    procs = [controller]
    try:
        own = free_port()
        wait_for(lambda: replica_states(url["admin"]) == ["ready"], 90, "the replica ready", controller)
        router = start(["router", "--controller", url["admin"], "--listen", f"127.0.0.1:{own}"],
                       tmp_path / "router.log", env={"LLMGW_ADMIN_TOKEN": TOKEN})
        procs.insert(0, router)
        standalone = f"http://127.0.0.1:{own}"
        client = openai.OpenAI(base_url=standalone + "/v1", api_key="unused", timeout=20, max_retries=0)
        def lists_chat() -> bool:
            try:
                return any(m.id == "chat" for m in client.models.list().data)
            except openai.APIConnectionError:
                return False  # not listening yet

        wait_for(lists_chat, 60, "the standalone router", router)

        # Both of the engine's slots taken straight at the engine (no router knows of these)...
        [endpoint] = [r["endpoint"] for r in api(url["admin"], "/api/v1/replicas")]
        let_go = threading.Event()
        blockers = [Stream(endpoint, 100_000, model="sim-chat", leave=let_go) for _ in range(2)]
        for b in blockers:
            b.start()
        wait_for(lambda: engine_queue(endpoint) == (2, 0), 60, "both engine slots taken", controller)
        # ...so a stream through each router waits at the engine, in flight, until the test says.
        streams = [Stream(url["router"]), Stream(standalone)]
        for s in streams:
            s.start()
        wait_for(lambda: engine_queue(endpoint) == (2, 2), 60, "both streams in flight at the engine", controller)
        retire(c.repo, url["admin"])
        # Withdrawn at once: neither router sends it anything new...
        wait_for(lambda: replica_states(url["admin"]) == ["stopping"], 30, "the replica stopping", controller)
        refused = openai.OpenAI(base_url=url["router"] + "/v1", api_key="unused", timeout=20, max_retries=0)
        with pytest.raises(openai.NotFoundError):
            refused.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}])
        # ...while what it was answering goes on: still stopping while both streams are in flight.
        assert all(s.ended_at is None for s in streams), [(s.tokens, s.error) for s in streams]
        assert replica_states(url["admin"]) == ["stopping"]
        let_go.set()  # the engine's slots freed: both streams run, at the engine's pace, to their end
        for s in (*blockers, *streams):
            s.join(60)
        for s in streams:
            assert s.error is None and s.tokens == TOKENS and s.finish == ["length"], (s.tokens, s.error, s.finish)
        wait_for(lambda: replica_states(url["admin"]) == [], 30, "the replica stopped after the streams", controller)
        assert not events(url["admin"], "replica-drain-timeout")
        wait_for(lambda: not processes_under(c.data), 30, "the engine gone", controller)
    finally:
        stop_everything(procs, c.data)


def test_a_stream_longer_than_drain_timeout_is_cut_and_the_event_says_so(tmp_path: Path) -> None:
    c = setup(tmp_path, drain="1s", grace="1s")
    url = {"router": c.router, "admin": c.admin}
    controller = start(["controller", "--config", str(c.config)], tmp_path / "controller.log")
    try:
        wait_for(lambda: replica_states(url["admin"]) == ["ready"], 90, "the replica ready", controller)
        long = Stream(url["router"], max_tokens=600)  # a minute at 10 tokens a second
        long.start()
        wait_for(lambda: long.tokens >= 3, 60, "the stream under way", controller)
        retire(c.repo, url["admin"])
        long.join(60)
        assert long.ended_at is not None and long.tokens < 600
        assert long.error is not None or long.finish != ["length"], (long.tokens, long.finish)
        [timeout] = wait_for(lambda: events(url["admin"], "replica-drain-timeout"), 30, "the drain-timeout event",
                             controller)
        assert "1 request(s) still in flight after drain_timeout 1s" in timeout["message"], timeout
        wait_for(lambda: replica_states(url["admin"]) == [], 30, "the replica stopped", controller)
    finally:
        stop_everything([controller], c.data)
