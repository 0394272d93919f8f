"""bench: does a token budget hold while the Redis that shares it is away, or comes back empty (issue 39)?

Routers in this process (the real ``Router``, each on its own port, sharing one real
``redis-server``), one simulated engine, one tenant with a day's token budget. Clients ask for
whole chat answers (max_tokens 20) until refused; what a budget lets through is what the
clients were served (the engine's usage of each answer).

**away** (the issue's case: 6,000 tokens, three standalone routers and the controller's own,
8,576 served): a quarter of the budget is spent through the routers while Redis answers; the
ledger's figure (what was spent) and the router count (4) are handed to every router, as the
controller does; Redis is killed; every router spends until refused; then one router is
restarted four times, each new process spending until refused.

**emptied** (20,000 tokens, two routers; seen 21,267 served): both routers spend a fifth of the
budget, each holding an allowance the Redis granted; Redis is killed and started again without
its data before any router calls it; both spend until refused.

Goal, each case: served ≤ budget + one reservation per router (max_tokens plus the prompt's
estimate). There is no peer for this: LiteLLM's budgets live in its database, with no degraded
mode to compare. Exit 1 when a goal is not met; the last line is one JSON object.

    python bench/budget_bench.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import socket
import subprocess
import sys
import time
from contextlib import AsyncExitStack
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmgw.catalog.model import Budget, Catalog, Limits, Model, Profile, Settings, Tenant  # noqa: E402
from llmgw.contract import Endpoint, period_start  # noqa: E402
from llmgw.engines.testing import SimProcess, free_port  # noqa: E402
from llmgw.router import KeyRing, Router, RouterConfig, hash_key  # noqa: E402
from llmgw.tenancy import shared  # noqa: E402

MESSAGES = [{"role": "user", "content": "Hello"}]
MAX_TOKENS = 20
RESERVATION = MAX_TOKENS + 20  # what one request reserves: max_tokens and the prompt's estimate
KEYS = KeyRing.from_entries([{"name": "team-key", "sha256": hash_key("sk-team"), "models": ["*"]}])


def redis_server(port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError("redis-server did not start") from None
            time.sleep(0.05)


def router(engine: str, url: str, budget: Budget) -> Router:
    r = Router(keys=KEYS, config=RouterConfig(limits_redis=url))
    chat = Model(name="chat", source="sim://chat", size_gb=0.0, profiles=(Profile(name="sim", priority=0, engine="sim",
                                                                                    gpus=0),))
    r.set_catalog(Catalog(models=(chat,), settings=Settings(
        tenants=(Tenant("team", ("team-key",), Limits(budget=budget)),))))
    r.set_endpoints([Endpoint(replica_id="chat-g1", model="chat", names=("chat",), url=engine, engine="sim",
                              profile="sim", priority=0)])
    return r


async def listen(stack: AsyncExitStack, r: Router) -> str:
    await r.start()
    stack.push_async_callback(r.close)
    return f"http://127.0.0.1:{await r.listen('127.0.0.1', 0)}"


async def spend(base: str, *, until: int | None = None) -> int:
    """Requests until refused (or ``until`` tokens served); the tokens served."""
    served = 0
    async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="sk-team", max_retries=0, timeout=15) as c:
        while until is None or served < until:
            try:
                r = await c.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=MAX_TOKENS)
            except (openai.RateLimitError, openai.BadRequestError):
                return served
            served += r.usage.total_tokens if r.usage else 0
    return served


def told(routers: list[Router], budget: Budget, used: int, count: int) -> None:
    figures = {("team", ""): (period_start(budget, time.time()), used)}
    for r in routers:
        r.set_spent(figures, count)


async def away(engine: str, budget: Budget, restarts: int) -> dict:
    port = free_port()
    redis = redis_server(port)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        async with AsyncExitStack() as stack:
            routers = [router(engine, url, budget) for _ in range(4)]
            bases = [await listen(stack, r) for r in routers]
            used = 0
            for base in bases:
                used += await spend(base, until=budget.tokens // 16)
            await asyncio.sleep(shared.SYNC_EVERY * 2)  # what they hold goes back; the used stays
            told(routers, budget, used, len(routers))
            redis.kill()
            redis.wait(5)
            after = [await spend(base) for base in bases]
            for _ in range(restarts):  # the same router, started again while Redis is away
                async with AsyncExitStack() as again:
                    r = router(engine, url, budget)
                    told([r], budget, used, len(routers))
                    after.append(await spend(await listen(again, r)))
        served = used + sum(after)
        return {"budget": budget.tokens, "routers": len(routers), "restarts": restarts, "before_outage": used,
                "during": after, "served": served, "over": served - budget.tokens,
                "met": served <= budget.tokens + len(routers) * RESERVATION}
    finally:
        redis.kill()
        redis.wait(5)


async def emptied(engine: str, budget: Budget) -> dict:
    port = free_port()
    redis = redis_server(port)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        async with AsyncExitStack() as stack:
            routers = [router(engine, url, budget) for _ in range(2)]
            bases = [await listen(stack, r) for r in routers]
            used = 0
            for _ in range(5):  # both busy in turn: each holds an allowance topped up by its pace
                for base in bases:
                    used += await spend(base, until=budget.tokens // 50)
            told(routers, budget, used, len(routers))
            redis.kill()
            redis.wait(5)
            redis = redis_server(port)  # empty, and up before either router calls it
            after = [await spend(base) for base in bases]
        served = used + sum(after)
        return {"budget": budget.tokens, "routers": len(routers), "before_restart": used, "after": after,
                "served": served, "over": served - budget.tokens,
                "met": served <= budget.tokens + len(routers) * RESERVATION}
    finally:
        redis.kill()
        redis.wait(5)


async def run(quick: bool) -> dict:
    shared.TIMEOUT = 2.0  # a busy machine's slow call is not Redis away; only the killed one is
    with SimProcess("chat") as sim:
        started = time.monotonic()
        a = await away(sim.endpoint, Budget(tokens=3_000 if quick else 6_000, per="day"), 2 if quick else 4)
        e = await emptied(sim.endpoint, Budget(tokens=10_000 if quick else 20_000, per="day"))
    return {"bench": "budget", "quick": quick, "seconds": round(time.monotonic() - started, 1), "away": a,
            "emptied": e, "reservation": RESERVATION,
            "goal": "served <= budget + one reservation per router, with Redis away and routers restarted, "
                    "and with Redis restarted empty", "met": a["met"] and e["met"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller budgets, two restarts")
    args = p.parse_args(argv)
    if shutil.which("redis-server") is None:
        print(json.dumps({"bench": "budget", "error": "redis-server is not installed", "met": False}))
        return 1
    out = asyncio.run(run(args.quick))
    for case in ("away", "emptied"):
        c = out[case]
        print(f"{case:8} served {c['served']:,} of {c['budget']:,} ({c['over']:+,}): "
              f"{'ok' if c['met'] else 'NOT MET'}")
    print(json.dumps(out))
    return 0 if out["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
