"""The usage ledger against real engines' own counters (issue 35): llama.cpp's server and vLLM.

Real parts only: `llmgw controller` as a process, sshd on loopback as the node, the agent starting
llama-server (SmolLM2-135M, one slot) confined, the controller's router in front of it, the openai
client and a raw-socket client (tests/fixtures/streams.py) that can leave mid-stream. Each step is
one request; after it the ledger (`llmgw usage`) must have moved by exactly what its client was
handed, counted by the client from what the engine itself put in front of it, and by what
llama.cpp's /metrics counters say the engine did (llmgw/router/usage.py says why, from its source):

- prompt tokens: ``llamacpp:prompt_tokens_total`` + ``prompt_tokens_cached_total``, for every
  request, cut or not (counted as the prompt is read, before the first token);
- completion tokens: ``llamacpp:tokens_predicted_total`` for every answer read to its end; for a
  stream the client left, at least what it was charged (a cancelled task counts the tokens it
  decoded before its cancel took effect, some of which nobody got); for an engine killed
  mid-stream, nothing to compare (its counters die with it, and a task counts its tokens at its end).

How a client counts what it received without the router's counting: a whole answer's and a
stream's ``usage``, or a stream's last ``timings`` (the engine's report, as the client sees it); a
stream it leaves or that breaks, the engine's per-event count it asked for itself
(``timings_per_token``), or the token ids of the per-token logprobs it asked for (checked to spell
exactly the text it got, so no token was held back and merged into another event uncounted).

vLLM (scripts/build-vllm-cpu's build) is checked the same way with less around it: the engine
started directly, the router in this process, its books read where the ledger gets them
(its usage outbox, ``ledger_usage``; the controller's part is the same for every engine and checked above). Its
counters are ``vllm:prompt_tokens_total`` and ``vllm:generation_tokens_total``; a stream's running
count is its ``usage`` (``continuous_usage_stats``); a client counts what it got by the token
ids of its logprobs, or by ``usage`` it asked for itself.

Nothing here depends on the machine's speed: every wait is for something observable (the replica
ready, the engine idle, the ledger moving) within a generous deadline, and a stream that is cut
asks for 1,000 tokens with ignore_eos, so it is still running when its client has read 3 events.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import threading
import urllib.request
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from llmgw.catalog.model import Catalog
from llmgw.contract import Endpoint
from llmgw.engines.health import scan_samples
from llmgw.router import Router, RouterConfig
from tests.conftest import git
from tests.e2e.processes import LLMGW, free_port, start, stop, wait_for
from tests.e2e.test_llamacpp_fleet import BINARY, GGUF, _pids_of, requires_engine
from tests.fixtures.confinement import confined_settings
from tests.fixtures.streams import Received, stream_raw
from tests.fixtures.vllm import BUILD, one_vllm_at_a_time, requires_vllm
from tests.reconciler.fleet_e2e import nodes_yaml
from tests.router.conftest import ledger_usage
from tests.router.fake_controller import model as fake_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

TOKEN = "ledger-admin-token"
MODEL = """\
name: smollm2
source: {source}
size_gb: 0.2
scaling: {{min: 1, max: 1}}
profiles:
  - name: cpu
    engine: llama.cpp
    gpus: 0
    memory_gb: 1
    args: ["--ctx-size", "2048", "--threads", "1", "-np", "1"]
"""
# Greedy, so the answers are plain English whatever the run (no character split over two tokens).
ASK = {"model": "smollm2", "temperature": 0}
LONG = {**ASK, "max_tokens": 1000, "ignore_eos": True, "stream": True}


def chat(text: str) -> list[Any]:
    return [{"role": "user", "content": text}]


def admin(url: str, path: str) -> Any:
    req = urllib.request.Request(url + path, headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def ledger(admin_url: str) -> dict[str, int]:
    out = subprocess.run([LLMGW, "usage", "--since", "1d", "-o", "json", "--url", admin_url, "--token", TOKEN],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    total = json.loads(out)["total"]
    return {k: int(total[k]) for k in ("requests", "errors", "prompt_tokens", "completion_tokens",
                                       "counted_from_stream")}


def counters(engine: str) -> dict[str, int]:
    """llama.cpp's own totals: prompt tokens read (computed and reused), tokens predicted, and
    the requests it is working on."""
    with urllib.request.urlopen(engine + "/metrics", timeout=30) as r:
        text = r.read().decode()

    def one(name: str) -> int:
        values = scan_samples(text, (name,))
        assert values is not None, f"{name} is not in llama.cpp's /metrics"
        return round(sum(values))

    return {"prompt": one("llamacpp:prompt_tokens_total") + one("llamacpp:prompt_tokens_cached_total"),
            "predicted": one("llamacpp:tokens_predicted_total"), "processing": one("llamacpp:requests_processing")}


def last_timings(got: Received) -> tuple[int, int]:
    """(prompt, predicted) from the last event with llama.cpp's timings that the client got."""
    t = next(e["timings"] for e in reversed(got.events) if "timings" in e)
    return t["cache_n"] + t["prompt_n"], t["predicted_n"]


def logprob_tokens(got: Received) -> int:
    """The tokens a client got, as the token ids of the logprobs it asked for: one per token the
    engine sent with its text. They must spell the text exactly, or a token was held back (part of
    a character) and merged into a later event without its own entry, and this count is not one."""
    entries = [t for e in got.events for c in e.get("choices") or [] for t in (c.get("logprobs") or {}).get("content")
               or []]
    assert b"".join(bytes(t["bytes"]) for t in entries) == got.content().encode(), "logprobs do not spell the text"
    return len(entries)


@requires_engine
def test_the_ledger_is_what_each_client_was_handed_and_what_llama_cpp_counted(sshd_fleet, tmp_path: Path) -> None:  # noqa: ANN001
    confined = confined_settings()
    assert BINARY is not None and GGUF is not None
    fleet = sshd_fleet(1, agent_extra={"engines": {"llama.cpp": str(BINARY)},
                                       "sandbox_paths": [*confined["sandbox_paths"], str(BINARY.parents[1])]})
    node = fleet[0]
    repo = tmp_path / "catalog"
    (repo / "models").mkdir(parents=True)
    git(repo, "init", "-q", "-b", "main")
    (repo / "nodes.yaml").write_text(nodes_yaml(fleet))
    (repo / "models" / "smollm2.yaml").write_text(MODEL.format(source=f"file://{GGUF}"))
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "Serve SmolLM2 on llama.cpp")
    router_port, admin_port = free_port(), free_port()
    config = tmp_path / "controller.yaml"
    config.write_text(json.dumps({
        "repo": str(repo), "data_dir": str(tmp_path / "data"), "fetch_interval": "1s",
        "listen": {"router": f"127.0.0.1:{router_port}", "admin": f"127.0.0.1:{admin_port}"},
        "ssh": {"key": str(fleet.client_key), "known_hosts": str(fleet.known_hosts)},
        "admin_token": TOKEN, "reconciler": {"tick_interval": "500ms", "stop_grace": "5s"},
    }))
    proc = start(["controller", "--config", str(config)], tmp_path / "controller.log")
    admin_url, router = f"http://127.0.0.1:{admin_port}", f"http://127.0.0.1:{router_port}"
    chat_url = router + "/v1/chat/completions"
    try:
        [replica] = wait_for(lambda: [r for r in admin(admin_url, "/api/v1/replicas") if r["state"] == "ready"],
                             300, "the llama.cpp replica ready", proc)
        engine = replica["endpoint"]
        client = openai.OpenAI(base_url=router + "/v1", api_key="unused", timeout=120, max_retries=0)
        wait_for(lambda: any(m.id == "smollm2" and getattr(m, "ready", False) for m in client.models.list().data),
                 60, "the router lists smollm2 as ready", proc)

        books = Books(admin_url, engine, proc)

        # Whole answers: the usage each client was told is what the ledger has, and what llama.cpp counted.
        for text in ("Name a colour.", "What is a river?"):
            answer = client.chat.completions.create(model="smollm2", messages=chat(text), max_tokens=12,
                                                    temperature=0)
            assert answer.usage is not None
            books.step(f"a whole answer to {text!r}", prompt=answer.usage.prompt_tokens,
                       completion=answer.usage.completion_tokens)

        # A stream whose client asked for the usage event: the event it got is what it is charged.
        usage = None
        for chunk in client.chat.completions.create(model="smollm2", messages=chat("Tell me about boats."),
                                                    max_tokens=20, temperature=0, stream=True,
                                                    stream_options={"include_usage": True}):
            assert chunk.usage is None or not chunk.choices  # no running counts in its events
            usage = chunk.usage or usage
        assert usage is not None
        books.step("a stream with its usage event", prompt=usage.prompt_tokens, completion=usage.completion_tokens)

        # A stream whose client asked for nothing: it sees what llama.cpp writes unasked (timings in
        # its last event only: the ones the router asked for in every event are taken out), and is
        # charged what those say.
        got = stream_raw(chat_url, {**ASK, "messages": chat("Describe a market."), "max_tokens": 20, "stream": True})
        assert got.done and [("timings" in e) for e in got.events][-2:] == [False, True]
        assert sum("timings" in e for e in got.events) == 1 and not any("usage" in e for e in got.events)
        prompt, predicted = last_timings(got)
        books.step("a stream without its usage event", prompt=prompt, completion=predicted)

        # A client that leaves after three events, having asked for llama.cpp's count in each.
        got = stream_raw(chat_url, {**LONG, "messages": chat("Tell a long story about a garden."),
                                    "timings_per_token": True}, leave_after=3)
        assert not got.done and got.content_events() >= 3, "the stream was not cut"
        prompt, predicted = last_timings(got)
        books.step("a stream its client left (counts asked for)", prompt=prompt, completion=predicted, cut=True)

        # A client that leaves having asked for no count (the router's are taken out of what it
        # sees): counted by the token ids of the logprobs it asked for instead.
        got = stream_raw(chat_url, {**LONG, "messages": chat("Tell a long story about a winter."),
                                    "logprobs": True, "top_logprobs": 1}, leave_after=3)
        assert not got.done and got.content_events() >= 3, "the stream was not cut"
        assert not any("timings" in e or "usage" in e for e in got.events)
        books.step("a stream its client left (no counts asked for)", prompt=None, completion=logprob_tokens(got),
                   cut=True)

        # The engine is killed (SIGKILL) mid-stream: the client gets what the router relayed and an
        # error event, and is charged that; the prompt as llama.cpp had counted it before it died.
        [pid] = _pids_of(str(BINARY), node.cache_dir)
        before_kill: list[dict[str, int]] = []

        def kill() -> None:
            before_kill.append(counters(engine))
            os.kill(pid, signal.SIGKILL)

        got = stream_raw(chat_url, {**LONG, "messages": chat("Tell a long story about a signal."),
                                    "logprobs": True, "top_logprobs": 1}, call_after=(3, kill))
        assert not got.done and "error" in got.events[-1], got.events[-1:]
        books.step("a stream whose engine was killed", prompt=None, completion=logprob_tokens(got), cut=True,
                   engine_at_end=before_kill[0])
        print(books.report())
    finally:
        stop(proc, signal.SIGTERM, timeout=60)
        for pid in _pids_of(str(BINARY), node.cache_dir):
            os.kill(pid, signal.SIGKILL)


class Books:
    """The ledger and the engine's counters, read after each step and compared with what the
    step's client was handed."""

    name = "llama.cpp"

    def __init__(self, admin_url: str, engine: str, proc: subprocess.Popen | None) -> None:
        self.admin_url, self.engine, self.proc = admin_url, engine, proc
        self.ledger = self.read_ledger()
        self.counted = self._idle()
        self.rows: list[str] = []

    def read_ledger(self) -> dict[str, int]:
        return ledger(self.admin_url)

    def read_engine(self) -> dict[str, int]:
        return counters(self.engine)

    def _idle(self) -> dict[str, int]:
        """The engine's counters once it works on nothing (a cancelled task is counted at its end)."""
        return wait_for(lambda: (c := self.read_engine())["processing"] == 0 and c, 120, f"{self.name} idle",
                        self.proc)

    def step(self, what: str, *, prompt: int | None, completion: int, cut: bool = False,
             engine_at_end: dict[str, int] | None = None) -> None:
        """One request's client got ``completion`` tokens (and was told ``prompt``, when it was):
        the ledger must move by exactly that, one request (an error when ``cut``), nothing counted
        from the stream; by the prompt the engine read; and, for an answer read to its end, by the
        tokens the engine generated (for a cut one, those are at least what was charged)."""
        engine = engine_at_end or self._idle()
        read = engine["prompt"] - self.counted["prompt"]
        predicted = engine["predicted"] - self.counted["predicted"]
        assert prompt is None or prompt == read, \
            f"{what}: the client was told {prompt} prompt tokens, {self.name} read {read}"
        want = {**self.ledger, "requests": self.ledger["requests"] + 1, "errors": self.ledger["errors"] + cut,
                "prompt_tokens": self.ledger["prompt_tokens"] + read,
                "completion_tokens": self.ledger["completion_tokens"] + completion}
        seen: list[dict[str, int]] = []

        def moved() -> bool:
            seen.append(self.read_ledger())
            return seen[-1] == want

        try:
            wait_for(moved, 60, what, self.proc)
        except AssertionError:
            raise AssertionError(f"{what}: the ledger should be {want} (the client got {completion} tokens, "
                                 f"{self.name} read {read} and generated {predicted}); it is {seen[-1:]}") from None
        if engine_at_end is None:
            if cut:
                assert predicted >= completion, f"{what}: charged {completion}, {self.name} generated {predicted}"
            else:
                assert predicted == completion, f"{what}: charged {completion}, {self.name} generated {predicted}"
        self.rows.append(f"{self.name}, {what}: ledger +{read} prompt +{completion} completion; the engine read "
                         f"{read}, generated {'(killed: its counters died with it)' if engine_at_end else predicted}")
        self.ledger, self.counted = want, engine

    def report(self) -> str:
        return "\n".join(self.rows)


# --- vLLM ------------------------------------------------------------------------------------------

def vllm_counters(engine: str) -> dict[str, int]:
    with urllib.request.urlopen(engine + "/metrics", timeout=30) as r:
        text = r.read().decode()

    def one(name: str) -> int:
        values = scan_samples(text, (name,))
        assert values is not None, f"{name} is not in vLLM's /metrics"
        return round(sum(values))

    return {"prompt": one("vllm:prompt_tokens_total"), "predicted": one("vllm:generation_tokens_total"),
            "processing": one("vllm:num_requests_running") + one("vllm:num_requests_waiting")}


@pytest.fixture(scope="module")
def vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, subprocess.Popen]]:
    """vLLM serving SmolLM2 as ``smol`` on a free port, its own process group (its engine core is a
    child process), stopped at the end; (its URL, the process)."""
    assert BUILD is not None
    port = free_port()
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "DO_NOT_TRACK": "1"}
    with log.open("wb") as out:
        proc = subprocess.Popen([str(BUILD / "bin" / "vllm"), "serve", str(BUILD / "model"), "--served-model-name",
                                 "smol", "--host", "127.0.0.1", "--port", str(port), "--enforce-eager",
                                 "--max-model-len", "2048", "--max-num-seqs", "2"],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        def up() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"vLLM exited ({proc.returncode}): {log.read_text()[-3000:]}")
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                return r.status == 200
        wait_for(up, 900, "vLLM healthy")  # a bound on a hung load, not a speed
        yield url, proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


@requires_vllm
@one_vllm_at_a_time
def test_the_routers_books_are_what_each_client_was_handed_and_what_vllm_counted(vllm) -> None:  # noqa: ANN001
    url, proc = vllm
    runner = RouterThread(Endpoint(replica_id="v-1", model="smol", names=("smol",), url=url, engine="vllm",
                                   profile="cpu", priority=0))
    with runner:
        chat_url = runner.base + "/v1/chat/completions"
        books = RouterBooks(runner, url)
        client = openai.OpenAI(base_url=runner.base + "/v1", api_key="unused", timeout=300, max_retries=0)

        answer = client.chat.completions.create(model="smol", messages=chat("Name a colour."), max_tokens=12,
                                                temperature=0)
        assert answer.usage is not None
        books.step("a whole answer", prompt=answer.usage.prompt_tokens, completion=answer.usage.completion_tokens)

        # Asked for the usage event only: it gets that, and no running count in its other events.
        got = stream_raw(chat_url, {"model": "smol", "messages": chat("Tell me about boats."), "max_tokens": 20,
                                    "temperature": 0, "stream": True, "stream_options": {"include_usage": True}})
        assert got.done and [("usage" in e) for e in got.events][-2:] == [False, True]
        assert sum("usage" in e for e in got.events) == 1
        usage = got.events[-1]["usage"]
        books.step("a stream with its usage event", prompt=usage["prompt_tokens"],
                   completion=usage["completion_tokens"])

        # Asked for nothing: no usage at all; counted by its logprobs' token ids.
        got = stream_raw(chat_url, {"model": "smol", "messages": chat("Describe a market."), "max_tokens": 20,
                                    "temperature": 0, "stream": True, "logprobs": True})
        assert got.done and not any("usage" in e for e in got.events)
        books.step("a stream without its usage event", prompt=None, completion=logprob_tokens(got))

        got = stream_raw(chat_url, {**LONG, "model": "smol", "messages": chat("Tell a long story about a garden."),
                                    "logprobs": True}, leave_after=3)
        assert not got.done and got.content_events() >= 3 and not any("usage" in e for e in got.events)
        books.step("a stream its client left", prompt=None, completion=logprob_tokens(got), cut=True)

        before_kill: list[dict[str, int]] = []

        def kill() -> None:
            before_kill.append(vllm_counters(url))
            os.killpg(proc.pid, signal.SIGKILL)

        got = stream_raw(chat_url, {**LONG, "model": "smol", "messages": chat("Tell a long story about a signal."),
                                    "logprobs": True}, call_after=(3, kill))
        assert not got.done and "error" in got.events[-1], got.events[-1:]
        books.step("a stream whose engine was killed", prompt=None, completion=logprob_tokens(got), cut=True,
                   engine_at_end=before_kill[0])
        print(books.report())


class RouterThread:
    """llmgw's Router on a free port in a thread of its own (its own event loop), serving one
    replica: the test's clients block, and must not block the router."""

    def __init__(self, replica: Endpoint) -> None:
        self.replica = replica
        self.router = Router(config=RouterConfig())
        self.base = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def __enter__(self) -> RouterThread:
        self._thread.start()

        async def go() -> int:
            self.router.set_catalog(Catalog(models=(fake_model("smol"),)))
            self.router.set_endpoints([self.replica])
            await self.router.start()
            return await self.router.listen("127.0.0.1", 0)

        self.base = f"http://127.0.0.1:{self.call(go())}"
        return self

    def call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(120)

    def __exit__(self, *_exc: object) -> None:
        try:
            self.call(self.router.close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)
            self._loop.close()

    def usage(self) -> dict[str, int]:
        async def read() -> dict[str, int]:
            u = ledger_usage(self.router).get(("", "smol"))
            if u is None:
                return {"requests": 0, "errors": 0, "prompt_tokens": 0, "completion_tokens": 0,
                        "counted_from_stream": 0}
            return {"requests": u.requests, "errors": u.errors, "prompt_tokens": u.prompt_tokens,
                    "completion_tokens": u.completion_tokens, "counted_from_stream": u.counted_from_stream}

        out: dict[str, int] = self.call(read())
        return out


class RouterBooks(Books):
    """:class:`Books` kept by the router itself (what it hands the ledger), against vLLM's counters."""

    name = "vLLM"

    def __init__(self, runner: RouterThread, engine: str) -> None:
        self.runner = runner
        super().__init__("", engine, None)

    def read_ledger(self) -> dict[str, int]:
        return self.runner.usage()

    def read_engine(self) -> dict[str, int]:
        return vllm_counters(self.engine)
