"""An `llmgw controller` process over real sshd nodes, a catalog repository it follows, and constant
client load through its router: what the rollout tests (tests/e2e/test_rollouts.py) and
bench/rollout_bench.py watch a change go through.

Plain Python (no pytest), so the bench starts the same fleet. A rollout is observed as an operator
would: the controller's events (``/api/v1/events``), its replicas (``/api/v1/replicas``), each
engine asked directly, and what the clients were answered.
"""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai

from tests.conftest import commit_files, git
from tests.e2e.processes import controller_config, start, stop, wait_for
from tests.fixtures.sshd_fleet import SshdFleet, kill_marked

TOKEN = "rollout-admin-token"
HELLO = [{"role": "user", "content": "hello"}]


def opening(n: int) -> list[dict[str, str]]:
    """Each load request a conversation of its own: the router splits a canary's traffic by
    conversation (a conversation's turns stay on one version), so one repeated message would all
    go to one track."""
    return [{"role": "user", "content": f"hello from {threading.get_ident()} #{n}"}]


def nodes_yaml(fleet: SshdFleet, *, gpus: int = 2) -> str:
    """The fleet's nodes, each declaring ``gpus`` GPUs (fewer than its agent has: a full fleet)."""
    lines = ["nodes:"]
    for i, n in enumerate(fleet, start=1):
        lines += [f"  - id: n{i}", f"    address: {n.host}", f"    port: {n.port}", "    user: root",
                  f"    gpus: {{count: {gpus}, class: sim, memory_gb: 24}}", "    disk_gb: 100"]
    return "\n".join(lines) + "\n"


def model_yaml(name: str, *, replicas: int, args: Sequence[str] = (), rollout: str = "") -> str:
    """A simulated chat model with ``replicas`` replicas of one GPU each, and a ``rollout:`` block."""
    extra = f"    args: {json.dumps(list(args))}\n" if args else ""
    return (f"name: {name}\nsource: sim://{name}\nsize_gb: 0.1\nscaling:\n  min: {replicas}\n  max: {replicas}\n"
            f"profiles:\n  - name: sim\n    engine: sim\n    gpus: 1\n    gpu_class: [sim]\n{extra}{rollout}")


def canary_policy(*, steps: Sequence[int] = (25, 50), interval: str = "2s", min_requests: int = 5,
                  extra: str = "") -> str:
    return (f"rollout:\n  strategy: canary\n  steps: {list(steps)}\n  interval: {interval}\n"
            f"  checks: {{min_requests: {min_requests}}}\n{extra}")


@dataclass
class Controller:
    """One `llmgw controller` process (restartable on its data dir) and its catalog repository."""

    tmp: Path
    repo: Path
    config: Path
    admin: str
    router: str
    proc: Any = None
    lives: int = 0

    @classmethod
    def create(cls, tmp: Path, fleet: SshdFleet, files: dict[str, str], *, gpus: int = 2,
               tick: str = "300ms") -> Controller:
        repo = tmp / "catalog"
        repo.mkdir()
        git(repo, "init", "-q", "-b", "main")
        commit_files(repo, {"llmgw.yaml": "pools:\n  - name: default\n", "nodes.yaml": nodes_yaml(fleet, gpus=gpus),
                            **files}, "Initial catalog")
        config, admin = controller_config(tmp, "data", repo, fleet, TOKEN)
        raw = json.loads(config.read_text())
        raw["reconciler"] = {"tick_interval": tick}
        config.write_text(json.dumps(raw))
        return cls(tmp, repo, config, admin, "http://" + raw["listen"]["router"])

    def start(self) -> None:
        self.lives += 1
        self.proc = start(["controller", "--config", str(self.config)], self.tmp / f"controller{self.lives}.log")
        wait_for(lambda: self.api("/api/v1/summary")["sync"]["state"] == "synced", 60, "controller synced", self.proc)

    def stop(self, sig: int = signal.SIGTERM) -> int:
        return stop(self.proc, sig, timeout=60) if self.proc is not None else 0

    def api(self, path: str, body: dict | None = None) -> Any:
        req = urllib.request.Request(self.admin + path, data=json.dumps(body).encode() if body is not None else None,
                                     method="POST" if body is not None else "GET",
                                     headers={"Authorization": f"Bearer {TOKEN}",
                                              "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())

    def commit(self, files: dict[str, str | None], message: str) -> str:
        """Commit to the catalog and have the controller fetch it now (as a webhook would)."""
        sha = commit_files(self.repo, files, message)
        self.api("/api/v1/sync", {})
        wait_for(lambda: self.api("/api/v1/summary")["sync"]["applied_sha"] == sha, 60,
                 f"revision {sha[:12]} applied", self.proc)
        return sha

    def events(self, *, after: int = 0, subject: str | None = None) -> list[dict[str, Any]]:
        evs = self.api(f"/api/v1/events?after={after}&limit=1000")
        return [e for e in evs if subject is None or e["subject"] == subject]

    def last_event_id(self) -> int:
        evs = self.api("/api/v1/events?limit=1")
        return evs[-1]["id"] if evs else 0

    def wait_event(self, kinds: str | Sequence[str], subject: str, *, after: int = 0,
                   timeout: float = 120) -> dict[str, Any]:
        """The first event of one of ``kinds`` about ``subject`` after event ``after``."""
        wanted = (kinds,) if isinstance(kinds, str) else tuple(kinds)

        def found() -> dict[str, Any] | None:
            return next((e for e in self.events(after=after, subject=subject) if e["kind"] in wanted), None)

        return wait_for(found, timeout, f"event {'/'.join(wanted)} for {subject}", self.proc)

    def replicas(self, model: str | None = None) -> list[dict[str, Any]]:
        return [r for r in self.api("/api/v1/replicas") if r["state"] != "stopped"
                and (model is None or r["model"] == model)]

    def ready(self, model: str, count: int, *, timeout: float = 90) -> list[dict[str, Any]]:
        def enough() -> list[dict[str, Any]] | None:
            reps = self.replicas(model)
            return reps if len(reps) == count and all(r["state"] == "ready" for r in reps) else None

        return wait_for(enough, timeout, f"{count} ready replicas of {model}", self.proc)

    def canaries(self, model: str, *, after: int = 0) -> list[str]:
        """Ids of the canary replicas created for ``model`` since event ``after``."""
        return [e["subject"] for e in self.events(after=after)
                if e["kind"] == "replica-created" and e["message"].startswith(f"{model}/")
                and "canary" in e["message"]]


def close(ctl: Controller | None, fleet: SshdFleet) -> None:
    """Stop the controller, then every engine it left on the nodes (a controller leaves its engines
    running on purpose: a restarted one adopts them)."""
    if ctl is not None:
        ctl.stop()
    for node in fleet:
        kill_marked(str(node.dir))


def default_tokens(endpoint: str, model: str) -> int:
    """How many tokens one engine answers when a request names no max_tokens (its
    --max-tokens-default): a version's args seen from outside, engine by engine."""
    with openai.OpenAI(base_url=endpoint + "/v1", api_key="x", max_retries=0, timeout=30) as client:
        answer = client.chat.completions.create(model=model, messages=HELLO)
    assert answer.usage is not None
    return answer.usage.completion_tokens


@dataclass(frozen=True)
class Outcome:
    started: float  # time.time()
    ended: float
    error: str | None  # None: answered
    text: str = ""  # the answer's words (a stream's, joined)
    messages: tuple[tuple[str, str], ...] = ()  # what was asked: (role, content)

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class Load:
    """Constant client load through the router: ``clients`` threads with the real openai client,
    each sending one request after another (``pause`` between), every outcome recorded."""

    base_url: str
    model: str
    clients: int = 4
    pause: float = 0.02
    max_tokens: int = 4
    stream_every: int = 2  # every n-th request of a client is streamed (0: none)
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __enter__(self) -> Load:
        for i in range(self.clients):
            t = threading.Thread(target=self._client, daemon=True, name=f"load-{i}")
            t.start()
            self._threads.append(t)
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)

    def _client(self) -> None:
        client = openai.OpenAI(base_url=self.base_url + "/v1", api_key="sk-load", max_retries=0, timeout=60)
        n = 0
        while not self._stop.is_set():
            n += 1
            t0 = time.time()
            error = None
            text = ""
            messages = opening(n)
            try:
                if self.stream_every and n % self.stream_every == 0:
                    with client.chat.completions.create(model=self.model, messages=messages, stream=True,
                                                        max_tokens=self.max_tokens) as stream:
                        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
                    if not text:
                        error = "a stream with no content"
                else:
                    answer = client.chat.completions.create(model=self.model, messages=messages,
                                                            max_tokens=self.max_tokens)
                    text = answer.choices[0].message.content or ""
                    if not text:
                        error = "an answer with no content"
            except openai.OpenAIError as exc:
                error = f"{type(exc).__name__}: {exc}"[:300]
            with self._lock:
                self.outcomes.append(Outcome(t0, time.time(), error, text,
                                             tuple((m["role"], m["content"]) for m in messages)))
            self._stop.wait(self.pause)
        client.close()

    def snapshot(self) -> list[Outcome]:
        with self._lock:
            return list(self.outcomes)

    def between(self, since: float, until: float = float("inf")) -> list[Outcome]:
        """Requests that were in flight at some moment in [since, until]."""
        return [o for o in self.snapshot() if o.ended >= since and o.started <= until]

    def wait_answered(self, count: int, *, proc: Any = None, timeout: float = 60) -> None:
        """Until ``count`` more requests have been answered (load reaches the router at all)."""
        target = sum(1 for o in self.snapshot() if o.ok) + count
        wait_for(lambda: sum(1 for o in self.snapshot() if o.ok) >= target, timeout, f"{count} answers", proc)


def failures(outcomes: Sequence[Outcome]) -> list[Outcome]:
    return [o for o in outcomes if not o.ok]


def ready_counts(events: Sequence[dict[str, Any]], model: str, start: int) -> list[int]:
    """The model's serving replicas after each of its replica events, from ``start`` serving: a
    replica-ready adds one, a replica-stopping/lost of a replica that was ready takes one away.
    Read off the controller's own ordered log, so no moment between two samples is missed."""
    ready: set[str] = set()
    counts = [start]
    prefix = f"{model} "
    for e in events:
        rid, kind, msg = e["subject"], e["kind"], e["message"]
        if kind == "replica-ready" and msg.startswith(prefix):
            ready.add(rid)
        elif kind in ("replica-stopping", "replica-lost") and msg.startswith(f"{model}:"):
            if rid in ready:
                ready.discard(rid)
            else:
                start -= 1  # one of the replicas serving when the log was taken
        else:
            continue
        counts.append(start + len(ready))
    return counts


def poll(check: Callable[[], Any], *, every: float = 0.2, stop_when: threading.Event) -> list[Any]:
    """Sample ``check`` until ``stop_when`` is set; every value seen (errors skipped)."""
    seen = []
    while not stop_when.is_set():
        try:
            seen.append(check())
        except (OSError, urllib.error.URLError, ValueError):
            pass
        stop_when.wait(every)
    return seen
