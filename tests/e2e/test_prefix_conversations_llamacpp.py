"""Multi-turn conversations through the router in front of two real llama.cpp servers (issue 30):
every turn after the first reaches the replica that served the previous turn, and that engine
reports the whole previous prompt cached (``timings.cache_n``).

Each turn's prompt is the whole conversation so far, the answers as the engine wrote them. Four
conversations are interleaved, one request at a time; two of them open with the same system
prompt (a chat application's), two with their own. Each server has one slot, a ``--cache-ram``
that holds the conversations it serves, and ``--slot-prompt-similarity 0`` (README, "Routing by
prompt prefix": with llama.cpp's default a new conversation that shares only the system prompt
takes over the slot of another one without saving it). Which server answered is read from the
servers themselves (``llamacpp:tokens_predicted_total`` in their ``/metrics``), not from the router.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from dataclasses import replace

import openai
import pytest

from llmgw.catalog.model import Catalog
from llmgw.contract import Endpoint
from llmgw.engines.testing import LlamaServers
from llmgw.router import Router, RouterConfig
from tests.e2e.test_llamacpp_fleet import BINARY, GGUF, requires_engine
from tests.router.conftest import serving
from tests.router.fake_controller import model

# Four conversations of real inference on one core each: ~25 s on a busy 2-core box, far more on a
# busier one than the default 60 s timeout allows for.
pytestmark = [pytest.mark.slow, requires_engine, pytest.mark.timeout(300)]

WORDS = "river stone cloud paper green light market winter signal garden".split()


def opening(seed: int, words: int = 180) -> str:
    return f"Notes {seed}. " + " ".join(WORDS[(seed * 7 + i * 3 + i // 10) % len(WORDS)] for i in range(words))


@pytest.fixture(scope="module")
def two_llama_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    assert BINARY is not None and GGUF is not None
    # ~48 MiB: four conversations of ~450 tokens at ~23 KB per token, with room to spare.
    servers = LlamaServers(BINARY, GGUF, tmp_path_factory.mktemp("llama"),
                           extra=("--cache-ram", "48", "--ctx-size", "2048", "--metrics",
                                  "--slot-prompt-similarity", "0"))
    try:
        yield servers.urls
    finally:
        servers.close()


def predicted(url: str) -> float:
    """The server's count of tokens it generated: it moves only on the server that answered."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("llamacpp:tokens_predicted_total"):
                return float(line.split()[-1])
    raise AssertionError(f"{url}/metrics has no llamacpp:tokens_predicted_total")


async def test_each_turn_of_a_conversation_reaches_the_replica_that_caches_it(two_llama_servers) -> None:  # noqa: ANN001
    urls = two_llama_servers
    router = Router(config=RouterConfig(load_interval=0.5))
    router.set_catalog(Catalog(models=(replace(model("smol"), routing="prefix"),)))
    router.set_endpoints([Endpoint(replica_id=f"r{i}", model="smol", names=("smol",), url=u, engine="llama.cpp",
                                   profile="cpu", priority=0) for i, u in enumerate(urls)])
    systems = [opening(0), opening(0), opening(1), opening(2)]  # conversations 0 and 1 share theirs
    histories: list[list[dict]] = [[{"role": "system", "content": s}] for s in systems]
    served: dict[int, list[int]] = {c: [] for c in range(4)}        # replica index per turn
    seen: dict[int, list[tuple[int, int]]] = {c: [] for c in range(4)}  # (cache_n, prompt_n) per turn
    async with serving(router) as base, openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0,
                                                            timeout=300) as client:
        for turn in range(3):
            for c, history in enumerate(histories):
                history.append({"role": "user", "content": f"Turn {turn}: which words come after "
                                + " ".join(WORDS[(c + turn + i) % 10] for i in range(12)) + "?"})
                before = [predicted(u) for u in urls]
                raw = await client.chat.completions.with_raw_response.create(
                    model="smol", messages=history, max_tokens=8, temperature=0)  # type: ignore[arg-type]
                answer = json.loads(raw.text)
                moved = [i for i, u in enumerate(urls) if predicted(u) > before[i]]
                assert len(moved) == 1, (c, turn, moved)
                served[c].append(moved[0])
                seen[c].append((answer["timings"]["cache_n"], answer["timings"]["prompt_n"]))
                history.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
    for c in range(4):
        # Every turn after the first went where the previous one did ...
        assert served[c] == [served[c][0]] * 3, (c, served)
        for turn in (1, 2):
            cache_n, prompt_n = seen[c][turn]
            previous = sum(seen[c][turn - 1])
            # ... and that engine still held the whole previous prompt: only the last answer and
            # the new question were computed.
            assert cache_n >= previous and cache_n > 4 * prompt_n, (c, turn, seen[c])
    # New conversations were spread over both replicas (the one remembering least takes a new one).
    assert {served[c][0] for c in range(4)} == {0, 1}, served
    pc = router.usage.prompt_cache()["smol"]
    assert pc.cached_tokens == sum(n for turns in seen.values() for n, _ in turns)
