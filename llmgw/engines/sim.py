"""The built-in engine simulator: an OpenAI-compatible server with no model behind it.

``python -m llmgw.engines.sim --model NAME --host H --port P`` answers the way vLLM does on the
wire, so every part of llmgw above the engine — agent, reconciler, router, benchmarks — runs on
a machine without GPUs: ``/v1/models``, ``/v1/chat/completions`` and ``/v1/completions`` (JSON or
SSE; ``stream_options.include_usage`` and ``continuous_usage_stats`` as vLLM reads them: a usage
event at the end, and each event's running count per answer), ``/v1/embeddings``, ``/health``
(503 "Loading model" during ``--startup-delay``, like llama.cpp, then 200) and ``/metrics`` in
vLLM's names plus counters of its own (``llmgw_sim_requests_total``,
``llmgw_sim_requests_cancelled_total``) so a test can see that a client going away cancelled the
request upstream.

``--fail-rate F`` (0 to 1) makes it a bad version that still becomes ready: the first inference
request (chat, completions or embeddings; the reconciler's one-token readiness probe) is answered,
and of the ones after it, request i (counted from 1) is answered 500 with an OpenAI-style error
exactly when floor(i*F) > floor((i-1)*F), so any n of them hold floor(n*F) failures, spread
evenly, and a test can count on the number. Requests refused for their own sake (a malformed
body, an unknown model, still loading) take no turn; /health, /metrics and /v1/models never fail.

Output is deterministic: the words (one token each) are drawn from a fixed vocabulary by the
sha256 of the prompt, and a stream carries 1 to 3 of them per SSE event, as real engines merge
tokens into one event (an incomplete UTF-8 character, text held back while it may be a stop
string), the grouping drawn from the same digest. ``--ttft`` passes before the first token and
``1/--tokens-per-second`` between the next ones (0 = as fast as possible); an event is written
when its last token is. Embeddings are unit vectors derived from the input's hash.

Its token counters do not mark its own homework: ``vllm:generation_tokens_total`` counts the
tokens in what it wrote (the words of each event or answer written, a stream cut short counting
its written part), while the ``usage`` and running counts it reports are the number of words it
drew. So a ledger compared with the counter is compared with what went out, not with the figure
the router relayed: a router that counts events for tokens, or a stream that loses a word, shows.
``vllm:prompt_tokens_total`` counts prompts as they are taken in, as vLLM counts prefill.

It must never be the bottleneck of a benchmark of the router, so the hot path stays small:
constant parts are pre-encoded, chunks are byte templates, a prompt's plan (words, events) is
cached by its digest, nothing is logged per request, and a zero-latency stream is written in one
piece. uvloop is used when installed.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import functools
import hashlib
import itertools
import json
import math
import signal
import struct
import sys
import time
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from aiohttp import web

VOCAB = (
    "the of and to in is that for it as with was on be by at this from or an are not have but "
    "which one all were when we there can more if out so what up about into them some time only "
    "new very after most also made over did many before must through back years where much way "
    "well down should because each just those people how too little state good"
).split()
VOCAB_JSON = tuple(json.dumps(w).encode() for w in VOCAB)
VOCAB_JSON_SPACED = tuple(json.dumps(" " + w).encode() for w in VOCAB)

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
DONE = b"data: [DONE]\n\n"
LOADING = json.dumps({"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}).encode()
HEALTH_OK = b'{"status":"ok"}'


@dataclass(frozen=True)
class SimConfig:
    model: str
    aliases: tuple[str, ...] = ()
    task: str = "chat"
    startup_delay: float = 0.0
    ttft: float = 0.0
    tokens_per_second: float = 0.0
    max_tokens_default: int = 16
    max_running: int = 0  # 0 = no limit: nothing ever waits
    embedding_dim: int = 64
    # A file that gets the `user` field of each accepted generation request, one per line: how a
    # benchmark counts how many times one client request reached an engine (bench/soak_bench.py).
    request_log: str | None = None
    # Blocks of 16 prompt words the simulated prefix cache keeps (LRU), counted as vLLM counts its
    # own (vllm:prefix_cache_queries_total / _hits_total, in tokens); 0 turns it off.
    prefix_cache_blocks: int = 4096
    # Each generation waits before its first token until this many run at once (0: never), or
    # until hold_timeout has passed: how a test proves a router carries N streams together
    # whatever the machine's speed (a pace of tokens per second proves it only on an idle box).
    hold_until_running: int = 0
    hold_timeout: float = 60.0
    # Share of inference requests after the first answered 500 (see the module docstring).
    fail_rate: float = 0.0
    # Which "weights" it answers as: another value, other words for the same prompt (a change that
    # serves the wrong model behind the same name; what acceptance prompts catch). "": the default.
    weights: str = ""


class Rejected(Exception):
    """A request answered with an OpenAI-style error instead of a completion."""

    def __init__(self, status: int, message: str, kind: str) -> None:
        super().__init__(message)
        self.response = _error(status, message, kind)


def _error(status: int, message: str, kind: str) -> web.Response:
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": status}})
    return web.Response(status=status, body=body.encode(), content_type="application/json")


def prompt_words(seed_text: str, count: int) -> tuple[int, ...]:
    """``count`` vocabulary indexes, a pure function of the prompt text."""
    return _plan(_digest(seed_text), count).words


def _digest(seed_text: str) -> bytes:
    return hashlib.sha256(seed_text.encode("utf-8", "surrogatepass")).digest()


@dataclass(frozen=True, slots=True)
class Plan:
    """What the simulator writes for one prompt and limit: the words it drew (its ``usage``), and a
    stream's events, each a JSON string of 1 to 3 of those words (the first without its leading
    space) and the number of tokens in it, counted from the text written."""

    words: tuple[int, ...]
    pieces: tuple[bytes, ...]
    sizes: tuple[int, ...]
    written: int  # sum(sizes): the tokens a whole stream of one answer writes


# Cached by the prompt's digest, not its text, and few: router benchmarks send one prompt thousands
# of times a second and the simulator must never be what they measure, but a cache keyed by
# prompts would hold megabytes of them.
@functools.lru_cache(maxsize=256)
def _plan(digest: bytes, count: int) -> Plan:
    size = len(VOCAB)
    words = tuple((digest[i % 32] + 7 * (i // 32)) % size for i in range(count))
    texts: list[str] = []
    i = 0
    while i < count:
        take = 1 + digest[(7 * len(texts) + 5) % 32] // 7 % 3  # 1 to 3, from the same digest
        texts.append(" ".join(VOCAB[w] for w in words[i:i + take]))
        i += take
    pieces = tuple(json.dumps(t if j == 0 else " " + t).encode() for j, t in enumerate(texts))
    sizes = tuple(len(t.split()) for t in texts)
    return Plan(words, pieces, sizes, sum(sizes))


@functools.lru_cache(maxsize=256)
def _whole_rest(model_json: bytes, chat: bool, words: tuple[int, ...], finish: str, prompt_tokens: int,
                answers: int) -> tuple[bytes, int]:
    """A whole answer's body after its id and time (the same for the same prompt, so cached), and
    the tokens it writes, counted from its text."""
    joined = " ".join([VOCAB[w] for w in words])
    text = json.dumps(joined)
    n = len(words) * answers
    if chat:
        choice = '{"index":%d,"message":{"role":"assistant","content":%s},"logprobs":null,"finish_reason":"%s"}'
    else:
        choice = '{"index":%d,"text":%s,"logprobs":null,"finish_reason":"%s"}'
    choices = ",".join(choice % (i, text, finish) for i in range(answers))
    body = (',"model":%s,"choices":[%s],"usage":{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}}'
            % (model_json.decode(), choices, prompt_tokens, n, prompt_tokens + n)).encode()
    return body, len(joined.split()) * answers


@functools.lru_cache(maxsize=4096)
def embedding_vector(text: str, dim: int) -> tuple[float, ...]:
    """A unit vector of ``dim`` floats derived from sha256-family hashing of ``text``."""
    raw = array("H", hashlib.shake_256(text.encode("utf-8", "surrogatepass")).digest(2 * dim))
    vec = [v - 32767.5 for v in raw]
    norm = math.sqrt(sum(v * v for v in vec)) or 1.0
    return tuple(v / norm for v in vec)


class Simulator:
    """One simulated engine: its configuration, its counters, and its request handlers."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.names = frozenset((config.model, *config.aliases))
        self.model_json = json.dumps(config.model).encode()
        self.ready = config.startup_delay <= 0
        self.running = 0
        self.waiting = 0
        self.requests_total = 0
        self.cancelled_total = 0
        self.failed_total = 0
        self._inference_seen = 0  # inference requests accepted so far, the readiness probe included
        self.prefix_queries = 0
        self.prefix_hits = 0
        # vLLM's own token counters: prompts taken in, tokens written out (a stream cut short
        # counts the tokens it wrote before the client left, as vLLM counts what it generated).
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self._prefix_cache: OrderedDict[int, None] = OrderedDict()
        self.interval = 1.0 / config.tokens_per_second if config.tokens_per_second > 0 else 0.0
        self._slots = asyncio.Semaphore(config.max_running) if config.max_running > 0 else None
        self._gathered = asyncio.Event()  # hold_until_running reached; cleared when all have ended
        self._ids = itertools.count(1)
        self._log = open(config.request_log, "a", buffering=1) if config.request_log else None  # noqa: SIM115
        self._models_body = json.dumps({"object": "list", "data": [
            {"id": n, "object": "model", "created": int(time.time()), "owned_by": "llmgw-sim"}
            for n in (config.model, *config.aliases)]}).encode()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/embeddings", self.embeddings)
        return app

    def _look_up_prefix(self, seed: str, prompt_tokens: int) -> None:
        """Count the prompt against the simulated prefix cache, then keep its blocks."""
        capacity = self.config.prefix_cache_blocks
        if capacity <= 0:
            return
        cache = self._prefix_cache
        blocks = _prefix_blocks(seed)
        held = 0
        for h in blocks:
            if h not in cache:
                break
            held += 1
        self.prefix_queries += prompt_tokens
        self.prefix_hits += min(prompt_tokens, held * 16)
        for h in reversed(blocks):
            cache[h] = None
            cache.move_to_end(h)
        while len(cache) > capacity:
            cache.popitem(last=False)

    def mark_ready(self) -> None:
        self.ready = True

    def _failing(self) -> web.Response | None:
        """The simulated failure for the request just accepted, or None to serve it.

        Taken as the request is accepted, with no await in between, so concurrent requests each
        take one turn, in the order they were accepted, and the number failed is exact whatever
        the interleaving.
        """
        i = self._inference_seen  # 0: the first, the readiness probe, always served
        self._inference_seen += 1
        rate = self.config.fail_rate
        if i == 0 or math.floor(i * rate) <= math.floor((i - 1) * rate):
            return None
        self.failed_total += 1
        return _error(500, f"simulated engine failure (--fail-rate {rate:g}): request {i} after the first",
                      "InternalServerError")

    # -- plain endpoints ---------------------------------------------------------------

    async def health(self, _request: web.Request) -> web.Response:
        if not self.ready:
            return web.Response(status=503, body=LOADING, content_type="application/json")
        return web.Response(body=HEALTH_OK, content_type="application/json")

    async def models(self, _request: web.Request) -> web.Response:
        if not self.ready:
            return web.Response(status=503, body=LOADING, content_type="application/json")
        return web.Response(body=self._models_body, content_type="application/json")

    async def metrics(self, _request: web.Request) -> web.Response:
        label = '{model_name=%s}' % self.model_json.decode()
        limit = self.config.max_running
        kv = min(1.0, self.running / limit) if limit else 0.0
        text = (
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running{label} {float(self.running)}\n"
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            f"vllm:num_requests_waiting{label} {float(self.waiting)}\n"
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n"
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f"vllm:kv_cache_usage_perc{label} {kv}\n"
            "# HELP vllm:prefix_cache_queries Prefix cache queries, in terms of number of queried tokens.\n"
            "# TYPE vllm:prefix_cache_queries counter\n"
            f"vllm:prefix_cache_queries_total{label} {float(self.prefix_queries)}\n"
            "# HELP vllm:prefix_cache_hits Prefix cache hits, in terms of number of cached tokens.\n"
            "# TYPE vllm:prefix_cache_hits counter\n"
            f"vllm:prefix_cache_hits_total{label} {float(self.prefix_hits)}\n"
            "# HELP vllm:prompt_tokens Number of prefill tokens processed.\n"
            "# TYPE vllm:prompt_tokens counter\n"
            f"vllm:prompt_tokens_total{label} {float(self.prompt_tokens)}\n"
            "# HELP vllm:generation_tokens Number of generation tokens processed.\n"
            "# TYPE vllm:generation_tokens counter\n"
            f"vllm:generation_tokens_total{label} {float(self.generation_tokens)}\n"
            "# HELP llmgw_sim_requests_total Requests accepted by the simulator.\n"
            "# TYPE llmgw_sim_requests_total counter\n"
            f"llmgw_sim_requests_total{label} {float(self.requests_total)}\n"
            "# HELP llmgw_sim_requests_cancelled_total Requests whose client went away before the end.\n"
            "# TYPE llmgw_sim_requests_cancelled_total counter\n"
            f"llmgw_sim_requests_cancelled_total{label} {float(self.cancelled_total)}\n"
            "# HELP llmgw_sim_requests_failed_total Requests answered 500 by --fail-rate.\n"
            "# TYPE llmgw_sim_requests_failed_total counter\n"
            f"llmgw_sim_requests_failed_total{label} {float(self.failed_total)}\n"
        )
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    # -- generation ----------------------------------------------------------------------

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def embeddings(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await self._accept(request, want_task="embedding")
            inputs = _embedding_inputs(body.get("input"))
            dim = body.get("dimensions") or self.config.embedding_dim
            if not isinstance(dim, int) or isinstance(dim, bool) or not 0 < dim <= 8192:
                raise Rejected(400, "dimensions must be an integer between 1 and 8192", "BadRequestError")
            b64 = body.get("encoding_format") == "base64"
        except Rejected as exc:
            return exc.response
        self.requests_total += 1
        if (failure := self._failing()) is not None:
            return failure
        data, tokens = [], 0
        for i, text in enumerate(inputs):
            vec = embedding_vector(text, dim)
            emb: Any = base64.b64encode(struct.pack(f"<{dim}f", *vec)).decode() if b64 else vec
            data.append({"object": "embedding", "index": i, "embedding": emb})
            tokens += max(1, len(text.split()))
        answer = {"object": "list", "data": data, "model": self.config.model,
                  "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
        return web.Response(body=json.dumps(answer).encode(), content_type="application/json")

    async def _accept(self, request: web.Request, *, want_task: str) -> dict[str, Any]:
        """The request's JSON body once the simulator is ready, the body parses, the model is
        served here and the endpoint fits the task; otherwise :class:`Rejected`."""
        if not self.ready:
            raise Rejected(503, "Loading model", "unavailable_error")
        try:
            body = json.loads(await request.read())
        except ValueError as exc:
            raise Rejected(400, f"malformed JSON body: {exc}", "BadRequestError") from None
        if not isinstance(body, dict):
            raise Rejected(400, "the request body must be a JSON object", "BadRequestError")
        name = body.get("model")
        if name not in self.names:
            raise Rejected(404, f"The model `{name}` does not exist.", "NotFoundError")
        if (self.config.task == "embedding") != (want_task == "embedding"):
            api = "Embeddings" if want_task == "embedding" else "generation"
            raise Rejected(400, f"The model `{name}` does not support the {api} API", "BadRequestError")
        return body

    async def _serve(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        try:
            body = await self._accept(request, want_task="chat")
            seed, prompt_tokens = _chat_seed(body) if chat else _completion_seed(body)
            requested = _completion_limit(body, chat=chat)
            answers = _answers(body)
        except Rejected as exc:
            return exc.response
        count = self.config.max_tokens_default if requested is None else requested
        finish = "length" if requested is not None else "stop"
        plan = _plan(_digest(self.config.weights + "\0" + seed if self.config.weights else seed), count)
        self.requests_total += 1
        if self._log is not None:  # a failed request reached the engine all the same
            self._log.write(f"{str(body.get('user', '')).replace(chr(10), ' ')}\n")
        if (failure := self._failing()) is not None:
            return failure  # before any work: what a router sees of an engine erroring at once
        self._look_up_prefix(seed, prompt_tokens)
        resp: web.StreamResponse | None = None
        try:
            if self._slots is not None:
                self.waiting += 1
                try:
                    await self._slots.acquire()
                finally:
                    self.waiting -= 1
            self.running += 1
            self.prompt_tokens += prompt_tokens
            try:
                await self._hold()
                if body.get("stream"):
                    resp = web.StreamResponse(headers=SSE_HEADERS)
                    await resp.prepare(request)
                    options = body.get("stream_options")
                    usage = type(options) is dict and bool(options.get("include_usage"))
                    # As vLLM reads it: a running count in every event only with the usage event.
                    running = usage and type(options) is dict and bool(options.get("continuous_usage_stats"))
                    await self._stream(resp, chat, plan, finish, prompt_tokens, usage=usage, running=running,
                                       answers=answers)
                    return resp
                await self._pace(len(plan.words))
                return self._whole(chat, plan.words, finish, prompt_tokens, answers)
            finally:
                self.running -= 1
                if self.running == 0:
                    self._gathered.clear()
                if self._slots is not None:
                    self._slots.release()
        except asyncio.CancelledError:
            self.cancelled_total += 1
            raise
        except ConnectionResetError:
            self.cancelled_total += 1  # the client went away mid-stream; nothing left to answer
            if resp is None:
                raise
            return resp

    async def _hold(self) -> None:
        want = self.config.hold_until_running
        if want <= 0:
            return
        if self.running >= want:
            self._gathered.set()
        try:
            await asyncio.wait_for(self._gathered.wait(), self.config.hold_timeout)
        except TimeoutError:
            pass  # the caller sees fewer at once than it wanted, and says so; never a hang

    async def _pace(self, count: int) -> None:
        delay = self.config.ttft + max(0, count - 1) * self.interval
        if delay > 0:
            await asyncio.sleep(delay)

    def _whole(self, chat: bool, words: tuple[int, ...], finish: str, prompt_tokens: int, answers: int = 1,
               ) -> web.Response:
        head = (b'{"id":"chatcmpl-sim-%d","object":"chat.completion","created":%d' if chat else
                b'{"id":"cmpl-sim-%d","object":"text_completion","created":%d') % (next(self._ids), int(time.time()))
        rest, written = _whole_rest(self.model_json, chat, words, finish, prompt_tokens, answers)
        self.generation_tokens += written
        return web.Response(body=head + rest, content_type="application/json")

    async def _stream(self, resp: web.StreamResponse, chat: bool, plan: Plan, finish: str, prompt_tokens: int, *,
                      usage: bool, running: bool, answers: int = 1) -> None:
        """The stream's events, 1 to 3 tokens each (``plan``); ``usage``: a usage event at the end;
        ``running``: each event carries the running count of its answer (continuous_usage_stats).
        The generation counter counts the tokens of each event written, as it is written."""
        rid = next(self._ids)
        created = int(time.time())
        if chat:
            head = b'data: {"id":"chatcmpl-sim-%d","object":"chat.completion.chunk","created":%d,"model":%s,' \
                   b'"choices":[{"index":0,"delta":' % (rid, created, self.model_json)
            token_pre, token_post = head + b'{"content":', b'},"logprobs":null,"finish_reason":null}]'
            first = head + b'{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]'
            last = head + b'{},"logprobs":null,"finish_reason":"%s"}]' % finish.encode()
            usage_head = b'data: {"id":"chatcmpl-sim-%d","object":"chat.completion.chunk","created":%d,' \
                         b'"model":%s,"choices":[],' % (rid, created, self.model_json)
        else:
            head = b'data: {"id":"cmpl-sim-%d","object":"text_completion","created":%d,"model":%s,' \
                   b'"choices":[{"index":0,"text":' % (rid, created, self.model_json)
            token_pre, token_post = head, b',"logprobs":null,"finish_reason":null}]'
            first = b""
            last = head + b'"","logprobs":null,"finish_reason":"%s"}]' % finish.encode()
            usage_head = b'data: {"id":"cmpl-sim-%d","object":"text_completion","created":%d,"model":%s,' \
                         b'"choices":[],' % (rid, created, self.model_json)
        sizes = plan.sizes
        if running:
            count = b',"usage":{"prompt_tokens":%d,"completion_tokens":%%d,"total_tokens":%%d}}\n\n' % prompt_tokens
            done, chunks = 0, []
            for piece, n in zip(plan.pieces, sizes, strict=True):
                done += n
                chunks.append(token_pre + piece + token_post + count % (done, prompt_tokens + done))
            first = first and first + count % (0, prompt_tokens)
            last += count % (done, prompt_tokens + done)
        else:
            end = token_post + b"}\n\n"
            chunks = [token_pre + piece + end for piece in plan.pieces]
            first = first and first + b"}\n\n"
            last += b"}\n\n"
        if answers > 1:  # each further answer streams after the first, under its own index
            chunks += [c.replace(b'"index":0', b'"index":%d' % a, 1) for a in range(1, answers) for c in chunks]
            sizes *= answers
            last = b"".join(last.replace(b'"index":0', b'"index":%d' % a, 1) for a in range(answers))
        tail = last
        if usage:
            n = len(plan.words) * answers  # what it drew, not what it wrote (the module's docstring)
            tail += usage_head + b'"usage":{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}}\n\n' % (
                prompt_tokens, n, prompt_tokens + n)
        tail += DONE
        if self.interval == 0:
            if self.config.ttft > 0:
                await asyncio.sleep(self.config.ttft)
            await resp.write(first + b"".join(chunks) + tail)
            self.generation_tokens += plan.written * answers
        else:
            # An event goes out when its last token is made: the first after ttft and its other tokens.
            delay = self.config.ttft + (sizes[0] - 1 if sizes else 0) * self.interval
            if delay > 0:
                await asyncio.sleep(delay)
            await resp.write(first + (chunks[0] if chunks else b""))
            self.generation_tokens += sizes[0] if sizes else 0
            for chunk, n in zip(chunks[1:], sizes[1:], strict=True):
                await asyncio.sleep(n * self.interval)
                await resp.write(chunk)
                self.generation_tokens += n
            await resp.write(tail)
        await resp.write_eof()


def _completion_limit(body: dict[str, Any], *, chat: bool) -> int | None:
    """The completion limit as vLLM reads it (None: none set, the default), or :class:`Rejected`.
    Chat: ``max_completion_tokens or max_tokens`` (a 0 falls through, as Python's ``or`` does);
    completions: ``max_tokens`` alone. Other engines' fields (llama.cpp's ``n_predict``) are
    ignored, as vLLM ignores them: a router that reserves one field while vLLM reads another is
    caught here, by what the simulator writes (llmgw.tenancy.asked)."""
    names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    for name in names:
        v = body.get(name)
        if v is None:
            continue
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise Rejected(400, f"{name} must be a non-negative integer", "BadRequestError")
    for name in names:
        v = body.get(name)
        if v or (v == 0 and not chat):  # completions read max_tokens as it is, 0 included
            return int(v)
    return None


def _answers(body: dict[str, Any]) -> int:
    """Answers asked for (``n``, as vLLM reads it), 1 to 128."""
    n = body.get("n", 1)
    if n is None:
        return 1
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 128:
        raise Rejected(400, "n must be an integer from 1 to 128", "BadRequestError")
    return n


def _prefix_blocks(seed: str) -> list[int]:
    words = seed.split()
    out, h = [], 0
    for i in range(0, len(words) - len(words) % 16, 16):
        h = hash((h, tuple(words[i:i + 16])))
        out.append(h)
    return out


def _text_of(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def _chat_seed(body: dict[str, Any]) -> tuple[str, int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise Rejected(400, "messages must be a non-empty list of objects", "BadRequestError")
    parts = [f"{m.get('role')}\x00{_text_of(m.get('content'))}" for m in messages]
    seed = "\x01".join(parts)
    return seed, sum(max(1, len(p.split())) for p in parts)


def _completion_seed(body: dict[str, Any]) -> tuple[str, int]:
    prompt = body.get("prompt")
    if prompt is None or prompt == "" or prompt == []:
        raise Rejected(400, "prompt must be a non-empty string or list", "BadRequestError")
    seed = _text_of(prompt)
    return seed, max(1, len(seed.split()))


def _embedding_inputs(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(v, int) for v in value):
            return [json.dumps(value)]  # one input given as token ids
        if all(isinstance(v, (str, list)) for v in value):
            return [_text_of(v) for v in value]
    raise Rejected(400, "input must be a string, a list of strings or a list of token lists", "BadRequestError")


# -- process -------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> tuple[SimConfig, str, int]:
    p = argparse.ArgumentParser(prog="python -m llmgw.engines.sim", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="the name served and echoed in responses")
    p.add_argument("--alias", action="append", default=[], help="another accepted model name (repeatable)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--task", choices=("chat", "completion", "embedding"), default="chat")
    p.add_argument("--startup-delay", type=float, default=0.0, help="seconds of 503 'Loading model'")
    p.add_argument("--ttft", type=float, default=0.0, help="seconds before the first token")
    p.add_argument("--tokens-per-second", type=float, default=0.0, help="pace after the first token; 0 = no wait")
    p.add_argument("--max-tokens-default", type=int, default=16, help="tokens when a request sets no max_tokens")
    p.add_argument("--max-running", type=int, default=0, help="concurrent generations; beyond it requests wait")
    p.add_argument("--embedding-dim", type=int, default=64)
    p.add_argument("--request-log", default=None, help="append each generation request's `user` field here")
    p.add_argument("--prefix-cache-blocks", type=int, default=4096,
                   help="16-word blocks the simulated prefix cache keeps (0: none)")
    # Accepted so sharded profiles can be exercised without GPUs; every rank serves on its own.
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--dist-init-addr", default=None)
    p.add_argument("--hold-until-running", type=int, default=0,
                   help="hold each first token until this many generations run at once (tests)")
    p.add_argument("--hold-timeout", type=float, default=60.0, help="seconds a held generation waits at most")
    p.add_argument("--fail-rate", type=_rate, default=0.0, metavar="F",
                   help="answer this share (0 to 1) of inference requests after the first 500, evenly spread")
    p.add_argument("--weights", default="", help="answer as these weights: other words for the same prompt")
    a = p.parse_args(argv)
    task = "chat" if a.task == "completion" else a.task
    config = SimConfig(model=a.model, aliases=tuple(a.alias), task=task, startup_delay=a.startup_delay,
                       ttft=a.ttft, tokens_per_second=a.tokens_per_second,
                       max_tokens_default=a.max_tokens_default, max_running=a.max_running,
                       embedding_dim=a.embedding_dim, request_log=a.request_log,
                       prefix_cache_blocks=a.prefix_cache_blocks, hold_until_running=a.hold_until_running,
                       hold_timeout=a.hold_timeout, fail_rate=a.fail_rate, weights=a.weights)
    return config, a.host, a.port


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.0 <= value <= 1.0:  # NaN fails this too
        raise argparse.ArgumentTypeError(f"{text!r} is not a share from 0 to 1 (0.3: 30 % of requests fail)")
    return value


async def serve(config: SimConfig, host: str, port: int, *, stop: asyncio.Event) -> None:
    """Serve until ``stop`` is set, then close within a fraction of a second: open streams are
    given 0.2 s and then cut, because an engine told to stop should stop."""
    sim = Simulator(config)
    runner = web.AppRunner(sim.app(), access_log=None, handler_cancellation=True, shutdown_timeout=0.2)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, reuse_address=True).start()
        if not sim.ready:
            asyncio.get_running_loop().call_later(config.startup_delay, sim.mark_ready)
        await stop.wait()
    finally:
        await runner.cleanup()


async def _main(config: SimConfig, host: str, port: int) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await serve(config, host, port, stop=stop)


def main(argv: list[str] | None = None) -> int:
    config, host, port = parse_args(argv)
    try:
        import uvloop  # optional: faster event loop when installed
    except ImportError:
        asyncio.run(_main(config, host, port))
    else:
        uvloop.run(_main(config, host, port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
