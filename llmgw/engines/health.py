"""What an engine says about itself: liveness, readiness, and load.

The reconciler asks :func:`check_health` and :func:`probe_ready` while a replica is starting
(DESIGN §5: ready means a one-token request succeeded, not only that ``/health`` said ok); the
router asks :func:`read_load` for queue depth to weigh replicas (DESIGN §6). Every call takes
the caller's ``aiohttp.ClientSession`` and carries its own timeout, so a hung engine costs
a bounded wait and never a stuck reconcile loop. None of them raises for an engine that is
down: that is an answer (``"down"``, ``False``, ``None``), not an error.

Engines answer differently and this module hides it:

- vLLM and SGLang: ``GET /health`` is 200 once serving. vLLM does not listen at all while it
  loads, so "loading" is indistinguishable from "down" from outside; the reconciler knows a
  replica is starting and waits either way.
- llama.cpp (tools/server/README.md, "GET /health"): 503 with ``{"error": {"code": 503,
  "message": "Loading model", "type": "unavailable_error"}}`` while loading, 200 ``{"status":
  "ok"}`` when ready. The built-in simulator answers the same way.
- ``/metrics`` names differ per engine; :data:`LOAD_METRICS` maps them (see there).
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass
from typing import Literal

import aiohttp

from llmgw.catalog.model import Engine, Task

Health = Literal["ok", "loading", "down"]

HEALTH_TIMEOUT = 2.0
PROBE_TIMEOUT = 30.0  # a first request after load may compile kernels or warm caches
METRICS_TIMEOUT = 2.0

PROBE_PROMPT = "Hi"


@dataclass(frozen=True)
class Load:
    """An engine's own view of its queue: requests being generated, requests waiting, and the
    share of its KV cache in use (0..1), or None where the engine does not export it; and its
    prefix cache's running totals, prompt tokens looked up and found, where it counts them."""

    running: int
    waiting: int
    kv_cache_usage: float | None = None
    prefix_queries: float | None = None
    prefix_hits: float | None = None
    generated: float | None = None  # tokens generated since the engine started (what bounds usage, issue 41)
    prompted: float | None = None  # every prompt token taken in since it started, cached ones too


@dataclass(frozen=True)
class LoadMetrics:
    """Metric names one engine exports for :class:`Load`; the first present name wins."""

    running: tuple[str, ...]
    waiting: tuple[str, ...]
    kv_cache_usage: tuple[str, ...] = ()
    prefix_queries: tuple[str, ...] = ()
    prefix_hits: tuple[str, ...] = ()
    generated: tuple[str, ...] = ()  # a counter of the tokens it generated
    prompted: tuple[str, ...] = ()  # a counter of every prompt token it took in (not only those it computed)


_VLLM = LoadMetrics(
    # docs.vllm.ai/en/stable/usage/metrics/; vllm:gpu_cache_usage_perc is the pre-V1 spelling,
    # kept by vLLM for a while as "DEPRECATED: Use vllm:kv_cache_usage_perc instead".
    running=("vllm:num_requests_running",),
    waiting=("vllm:num_requests_waiting",),
    kv_cache_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    # Counters of prompt tokens (V1; the gpu_ spelling is V1's first, before the CPU offload cache).
    prefix_queries=("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
    prefix_hits=("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
    generated=("vllm:generation_tokens_total",),
    # Every prompt token, those its prefix cache held too (V1 splits them in prompt_tokens_by_source).
    prompted=("vllm:prompt_tokens_total",),
)

LOAD_METRICS: dict[Engine, LoadMetrics] = {
    "vllm": _VLLM,
    # docs.sglang.io/references/production_metrics.html (needs --enable-metrics); token_usage is
    # the share of the KV pool in use.
    "sglang": LoadMetrics(
        running=("sglang:num_running_reqs",),
        waiting=("sglang:num_queue_reqs",),
        kv_cache_usage=("sglang:token_usage",),
        generated=("sglang:generation_tokens_total",),
        prompted=("sglang:prompt_tokens_total",),
    ),
    # ggml-org/llama.cpp tools/server/README.md, "GET /metrics" (needs --metrics); no KV gauge.
    "llama.cpp": LoadMetrics(
        running=("llamacpp:requests_processing",),
        waiting=("llamacpp:requests_deferred",),
        generated=("llamacpp:tokens_predicted_total",),
        # No prompted: its prompt_tokens_total counts what it computed, not what its cache held.
    ),
    "sim": _VLLM,  # the simulator speaks vLLM's names
}


async def check_health(
    session: aiohttp.ClientSession, endpoint: str, *, timeout: float = HEALTH_TIMEOUT
) -> Health:
    """``"ok"`` on 200 from ``/health``, ``"loading"`` on 503 (the engine is up but still
    loading), ``"down"`` for anything else: no connection, a timeout, another status."""
    try:
        async with session.get(_url(endpoint, "/health"), timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            await resp.read()
            if resp.status == 200:
                return "ok"
            return "loading" if resp.status == 503 else "down"
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return "down"


async def probe_ready(
    session: aiohttp.ClientSession,
    endpoint: str,
    model_name: str,
    task: Task,
    *,
    timeout: float = PROBE_TIMEOUT,
) -> bool:
    """True only when the engine answered a real one-token request for ``model_name``.

    Generative models get ``POST /v1/completions`` with ``max_tokens: 1``: every engine here
    serves it, and unlike chat it needs no chat template (a base model has none). Embedding
    models get ``POST /v1/embeddings`` with a short input. A 200 whose body is not the
    expected shape (``choices`` / ``data`` non-empty) is not ready.
    """
    body: dict[str, object]
    if task == "embedding":
        path, body, key = "/v1/embeddings", {"model": model_name, "input": PROBE_PROMPT}, "data"
    else:
        path, key = "/v1/completions", "choices"
        body = {"model": model_name, "prompt": PROBE_PROMPT, "max_tokens": 1, "temperature": 0}
    try:
        async with session.post(
            _url(endpoint, path), json=body, timeout=aiohttp.ClientTimeout(total=timeout)
        ) as resp:
            raw = await resp.read()
            if resp.status != 200:
                return False
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return False
    try:
        answer = json.loads(raw)
    except ValueError:
        return False
    return isinstance(answer, dict) and isinstance(answer.get(key), list) and len(answer[key]) > 0


async def ask(session: aiohttp.ClientSession, endpoint: str, path: str, body: dict[str, object], *,
              timeout: float) -> tuple[object | None, str | None]:
    """POST ``body`` to the engine: (its JSON answer, None), or (None, what went wrong)."""
    try:
        async with session.post(_url(endpoint, path), json=body,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            raw = await resp.read()
            if resp.status != 200:
                return None, f"the engine answered {resp.status}: {raw[:200].decode('utf-8', 'replace')}"
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        return None, f"no answer within {timeout:g} s ({type(exc).__name__})"
    try:
        return json.loads(raw), None
    except ValueError:
        return None, "the engine's answer is not JSON"


async def read_load(
    session: aiohttp.ClientSession, endpoint: str, engine: Engine | None, *, timeout: float = METRICS_TIMEOUT
) -> Load | None:
    """The engine's :class:`Load` from its ``/metrics``, or None when it cannot be read
    (unreachable, non-200, not Prometheus text, or none of the engine's names present).
    ``engine`` None (a replica of a model the catalog no longer has): the first engine's names
    its answer is in."""
    try:
        async with session.get(_url(endpoint, "/metrics"), timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            if resp.status != 200:
                await resp.read()
                return None
            text = await resp.text(errors="replace")
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return None
    if engine is not None:
        return parse_load(text, engine)
    return next((load for kind in LOAD_METRICS if (load := parse_load(text, kind)) is not None), None)


def parse_load(text: str, engine: Engine) -> Load | None:
    """:class:`Load` from Prometheus exposition ``text`` in ``engine``'s metric names.

    Running and waiting are summed over every label set (an engine with several data-parallel
    ranks or models exports one series each). KV-cache usage is a share per cache, so the
    fullest one is reported, not a sum. None when neither running nor waiting is present, so
    that "no metrics" is never mistaken for "idle". The router calls this every second per
    replica on its own core, and vLLM's /metrics runs to ~100 KB of histograms, so the few
    gauges are found by scanning for their names rather than parsing every family.
    """
    names = LOAD_METRICS[engine]
    # A gauge an engine exports as NaN or +Inf is no count: as if absent (round(nan) raised, and
    # the exception ended the router's load readings of every replica).
    running = _counter(scan_samples(text, names.running))
    waiting = _counter(scan_samples(text, names.waiting))
    if running is None and waiting is None:
        return None
    kv = [v for v in scan_samples(text, names.kv_cache_usage) or () if math.isfinite(v)]
    queries = _counter(scan_samples(text, names.prefix_queries))
    hits = _counter(scan_samples(text, names.prefix_hits))
    generated = _counter(scan_samples(text, names.generated))
    prompted = _counter(scan_samples(text, names.prompted))
    return Load(
        running=round(sum(running or ())),
        waiting=round(sum(waiting or ())),
        kv_cache_usage=max(kv) if kv else None,
        prefix_queries=sum(queries) if queries and hits else None,
        prefix_hits=sum(hits) if queries and hits else None,
        generated=sum(generated) if generated else None,
        prompted=sum(prompted) if prompted else None,
    )


def _counter(values: list[float] | None) -> list[float] | None:
    """A counter's samples, or None when any is not a finite count (an engine's +Inf or NaN would
    otherwise poison every sum taken from it)."""
    if values is None or not all(math.isfinite(v) and v >= 0 for v in values):
        return None
    return values


def scan_samples(text: str, candidates: tuple[str, ...]) -> list[float] | None:
    """Values of every sample of the first metric in ``candidates`` present in ``text``."""
    for name in candidates:
        values, start = [], 0
        while True:
            i = text.find(name, start)
            if i < 0:
                break
            start = i + len(name)
            if (i > 0 and text[i - 1] != "\n") or text[start:start + 1] not in ("{", " "):
                continue  # inside a HELP/TYPE line, or a longer name with this prefix
            end = text.find("\n", start)
            line = text[start:] if end < 0 else text[start:end]
            if line.startswith("{"):
                line = line[line.rfind("}") + 1:]
            try:
                values.append(float(line.split()[0]))
            except (IndexError, ValueError):
                continue
        if values:
            return values
    return None


def _url(endpoint: str, path: str) -> str:
    return endpoint.rstrip("/") + path
