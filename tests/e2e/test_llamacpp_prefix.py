"""Prefix routing in front of two real llama.cpp servers: the engine's own ``timings.cache_n``
proves that a tenant's next request reached the replica that still holds its prompt.

Each server has one slot and no prompt cache in RAM (``-np 1 --cache-ram 0``), so it keeps
exactly the last prompt it computed: a request that reaches the other replica, or the same one
after another tenant, recomputes everything (``cache_n`` of a few tokens, the chat template's
start). The router runs in this process on a real port; the client is the real openai client.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace

import openai
import pytest

from llmgw.catalog.model import Catalog
from llmgw.contract import Endpoint
from llmgw.engines.testing import LlamaServers
from llmgw.router import Router, RouterConfig
from tests.e2e.test_llamacpp_fleet import BINARY, GGUF, requires_engine
from tests.router.conftest import ledger_usage, serving
from tests.router.fake_controller import model

pytestmark = [pytest.mark.slow, requires_engine, pytest.mark.timeout(240)]  # real inference: ~12 s on a busy box

WORDS = "river stone cloud paper green light market winter signal garden".split()


def manual(tenant: int, words: int = 220) -> str:
    """A tenant's long shared system prompt (~250 tokens of SmolLM2's tokenizer)."""
    return f"Tenant {tenant} handbook. " + " ".join(WORDS[(tenant * 7 + i * 3) % len(WORDS)] for i in range(words))


@pytest.fixture(scope="module")
def two_llama_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    assert BINARY is not None and GGUF is not None
    servers = LlamaServers(BINARY, GGUF, tmp_path_factory.mktemp("llama"),
                           extra=("--cache-ram", "0", "--ctx-size", "2048", "--metrics"))
    try:
        yield servers.urls
    finally:
        servers.close()


def llama_endpoint(rid: str, url: str) -> Endpoint:
    return Endpoint(replica_id=rid, model="smol", names=("smol",), url=url, engine="llama.cpp", profile="cpu",
                    priority=0)


async def test_a_tenants_next_request_reaches_the_replica_that_caches_its_prompt(two_llama_servers) -> None:  # noqa: ANN001
    a, b = two_llama_servers
    router = Router(config=RouterConfig(load_interval=0.5))
    router.set_catalog(Catalog(models=(replace(model("smol"), routing="prefix"),)))
    router.set_endpoints([llama_endpoint("a", a), llama_endpoint("b", b)])
    cached: list[tuple[int, int, int]] = []  # (tenant, cache_n, prompt_n) per request
    async with serving(router) as base, openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0,
                                                            timeout=120) as c:
        for round_ in range(3):
            for tenant in (0, 1):
                messages = [{"role": "system", "content": manual(tenant)},
                            {"role": "user", "content": f"Question {round_}: what is first?"}]
                if round_ == 2:  # streamed: the timings come in the last event, read from the stream's end
                    timings = None
                    async for chunk in await c.chat.completions.create(model="smol", messages=messages,
                                                                       max_tokens=2, stream=True):
                        timings = (chunk.model_extra or {}).get("timings") or timings
                else:
                    raw = await c.chat.completions.with_raw_response.create(model="smol", messages=messages,
                                                                            max_tokens=2)
                    timings = json.loads(raw.text)["timings"]
                assert timings is not None
                cached.append((tenant, timings["cache_n"], timings["prompt_n"]))
    first = cached[:2]
    later = cached[2:]
    # First sight of each tenant: computed from scratch (at most the template's first tokens reused).
    assert all(cache_n < 20 for _, cache_n, _ in first), cached
    # Every later request found its whole manual cached: the same replica, which served nobody
    # else in between. Least-outstanding would have sent about half of them to the other one.
    for tenant, cache_n, prompt_n in later:
        assert cache_n > 150 and cache_n > 5 * prompt_n, (tenant, cached)
    # The tenants were spread over both replicas, each replica's index holding one manual.
    ups = router.table.upstreams
    assert ups["a"].prefixes is not None and ups["b"].prefixes is not None
    # The router's engine-reported counts are the engines' own, summed.
    pc = router.usage.prompt_cache()["smol"]
    assert pc.cached_tokens == sum(c for _, c, _ in cached)
    assert pc.prompt_tokens == sum(c + p for _, c, p in cached)
    assert pc.matched > 0 and pc.estimated_hit_ratio is not None and pc.estimated_hit_ratio > 0.5
    # Usage counted from the engine's own numbers, streamed answers included (llama.cpp's timings:
    # asking it for a usage event would move them out of the event the client reads).
    used = ledger_usage(router)[("", "smol")]
    assert (used.requests, used.errors, used.counted_from_stream) == (6, 0, 0)
    assert used.prompt_tokens == pc.prompt_tokens and used.completion_tokens == 6 * 2
