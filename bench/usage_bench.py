"""bench: is the usage ledger exact, does a budget hold, and what do limits cost (issue 18).

Two parts in one run.

**Accuracy.** Two standalone routers (``llmgw router``, each its own process) follow one
controller's feed (the real FeedHub and SQLite ledger, in a process of this file) and count
tenants' limits in one real ``redis-server``. 32 clients send a mix of requests through both
routers in turn, with 12 API keys of three tenants:

    whole   non-streamed                       the client reads ``usage``
    usage   streamed, include_usage asked      the client reads the usage event
    bare    streamed, nothing asked            the client counts the content events; it must see
                                               no usage event (the router's own is taken out)
    abort   streamed, left after 3 tokens      (10 %, to a paced engine) the client counts what it read

Tenants ``alpha`` and ``beta`` have limits that are checked on every request and never reached;
``capped`` has a day's token budget that runs out early in the run. When the routers have
stopped (sending their last batches), the ledger is read from the controller's database and
compared with what the clients were told and with the engines' own counters (vLLM's
``vllm:prompt_tokens_total`` / ``vllm:generation_tokens_total``, which the simulator keeps):

- whole/usage keys: ledger prompt and completion tokens = the clients' sums (goal: 0 difference);
- bare keys: ledger completion tokens = the words the clients read (the simulator's tokens are
  words, 1-3 to an event; goal: 0);
- model ``chat`` (every request but the aborted ones): ledger = the engines' counters (goal: 0);
- aborted: the ledger's completion tokens lie between what the clients read and what the engine
  wrote before it saw them leave (a token in a socket buffer is neither read nor unsent), each
  charged the engine's own running count (continuous usage stats: its prompt too), none
  estimated from the events relayed;
- the capped tenant's ledger tokens over its budget: at most one request's reservation.

**Cost.** Three routers (each its own process, pinned to core 0), wrk and the engine on core 1,
33 connections of a non-streamed chat request, each request with the next of 200 tenants' keys
so every tenant reaches every router in turn: limits off (no tenants), local (each router
counts in its memory) and on (shared in Redis, also on core 1). Each tenant has the limits of a
team on a shared gateway (900 requests and 90,000 tokens a minute, 20 at once, 2 M tokens a
day), so allowances are small and the routers go back to Redis; Redis's script calls and
commands per request are read from INFO commandstats. Rounds rotate the order of the sides.
Goal: on ≥ 90 % of off's requests/s (median of per-round ratios).

    python bench/usage_bench.py [--quick] [--requests N]

The last line is one JSON object with every figure and ``met``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

if TYPE_CHECKING:
    from llmgw.catalog.model import Catalog, Limits

from router_bench import LOAD_CORE, SUT_CORE, free_port, have_tools, run_loop, spawn, stop, wait_port  # noqa: E402

TOKEN = "usage-bench-admin-token"
TENANTS = ("alpha", "beta", "capped")
KINDS = ("whole", "usage", "bare", "abort")
MAX_TOKENS, ABORT_MAX_TOKENS, ABORT_AFTER = 16, 48, 3
BUDGET = 4000  # capped's tokens per day: about a tenth of what its clients ask for
QUESTIONS = ["How do routers count tokens?", "Say something about budgets.", "Explain rate limits in a line.",
             "What is a tenant?", "Why would a stream stop early?"]
LLMGW = str(Path(sys.executable).parent / "llmgw")


def key(tenant: str, kind: str) -> str:
    return f"sk-{tenant}-{kind}"


def key_name(tenant: str, kind: str) -> str:
    return f"{tenant}-{kind}"


def limits_for(tenant: str) -> dict:
    if tenant == "capped":
        return {"budget": {"tokens": BUDGET, "per": "day"}}
    # Checked on every request, never reached: the cost of counting, not of refusing.
    return {"requests_per_minute": 10_000_000, "tokens_per_minute": 1_000_000_000, "concurrent": 100_000,
            "budget": {"tokens": 10 ** 12, "per": "month"}}


def catalog(with_tenants: bool):  # noqa: ANN201 - a Catalog
    """The accuracy run's catalog: the models, and (``with_tenants``) TENANTS with their keys."""
    from llmgw.catalog.model import Budget, Limits, Tenant

    def lim(t: str) -> Limits:
        d = limits_for(t)
        budget = Budget(d["budget"]["tokens"], d["budget"]["per"]) if "budget" in d else None
        return Limits(d.get("requests_per_minute"), d.get("tokens_per_minute"), d.get("concurrent"), budget)
    return catalog_of(tuple(Tenant(t, tuple(key_name(t, k) for k in KINDS), lim(t)) for t in TENANTS)
                      if with_tenants else ())


def catalog_of(tenants: tuple) -> Catalog:
    from llmgw.catalog.model import Catalog, Model, ModelName, Profile, Settings

    profile = Profile(name="sim", priority=0, engine="sim", gpus=0)
    models = tuple(Model(name=ModelName(n), source="/bench", size_gb=1, profiles=(profile,)) for n in ("chat", "slow"))
    return Catalog(models=models, settings=Settings(tenants=tenants))


def api_keys() -> list[dict]:
    from llmgw.router import hash_key

    return [{"name": key_name(t, k), "sha256": hash_key(key(t, k)), "models": ["*"]} for t in TENANTS for k in KINDS]


def endpoints(chat: list[str], slow: str) -> list:
    from llmgw.contract import Endpoint

    eps = [Endpoint(replica_id=f"chat-g{i}", model="chat", names=("chat",), url=u, engine="sim", profile="sim",
                    priority=0) for i, u in enumerate(chat)]
    return eps + [Endpoint(replica_id="slow-g0", model="slow", names=("slow",), url=slow, engine="sim",
                           profile="sim", priority=0)]


# --- the processes this file serves ---------------------------------------------------------------

async def serve_hub(port: int, db: str, spec: dict) -> None:
    """The controller's side of the feed with its ledger: what `llmgw controller` mounts."""
    from aiohttp import web

    from llmgw.contract import REPORT_PATH, WATCH_PATH
    from llmgw.control.feed import FeedHub
    from llmgw.state import Store

    store = Store(db).open()
    hub = FeedHub()
    hub.ledger = store
    hub.set_catalog(catalog(True))
    hub.set_endpoints(endpoints(spec["chat"], spec["slow"]))
    hub.set_api_keys(api_keys())
    hub.set_limits_redis(spec["redis"])

    @web.middleware
    async def auth(request: web.Request, handler):  # noqa: ANN001, ANN202 - aiohttp middleware
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return web.json_response({"error": "bad admin token"}, status=401)
        return await handler(request)

    app = web.Application(middlewares=[auth])
    app.router.add_get(WATCH_PATH, hub.watch)
    app.router.add_post(REPORT_PATH, hub.report)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        await asyncio.Event().wait()
    finally:
        store.close()


# --- the accuracy run -------------------------------------------------------------------------------

class Tally:
    def __init__(self) -> None:
        self.by_key: dict[str, list[int]] = {}  # key name -> [requests, prompt, completion]
        self.refused: dict[str, int] = {t: 0 for t in TENANTS}
        self.errors: list[str] = []
        self.usage_leaks = 0  # usage events a client saw without asking for them

    def add(self, name: str, prompt: int, completion: int) -> None:
        row = self.by_key.setdefault(name, [0, 0, 0])
        row[0] += 1
        row[1] += prompt
        row[2] += completion


def body(kind: str, rng: random.Random) -> dict:
    b: dict = {"model": "slow" if kind == "abort" else "chat",
               "messages": [{"role": "user", "content": rng.choice(QUESTIONS)}],
               "max_tokens": ABORT_MAX_TOKENS if kind == "abort" else MAX_TOKENS}
    if kind != "whole":
        b["stream"] = True
    if kind == "usage":
        b["stream_options"] = {"include_usage": True}
    return b


async def one(session: aiohttp.ClientSession, base: str, tenant: str, kind: str, rng: random.Random,
              tally: Tally) -> None:
    name = key_name(tenant, kind)
    async with session.post(base + "/v1/chat/completions", json=body(kind, rng),
                            headers={"Authorization": f"Bearer {key(tenant, kind)}"}) as resp:
        if resp.status == 429:
            tally.refused[tenant] += 1
            await resp.read()
            return
        if resp.status != 200:
            tally.errors.append(f"{name}: {resp.status} {(await resp.read())[:200]!r}")
            return
        if kind == "whole":
            usage = (await resp.json())["usage"]
            tally.add(name, usage["prompt_tokens"], usage["completion_tokens"])
            return
        content, usage, buf = 0, None, b""
        async for chunk in resp.content.iter_any():
            buf += chunk
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                data = event.removeprefix(b"data: ").strip()
                if not data or data == b"[DONE]":
                    continue
                obj = json.loads(data)
                if obj.get("usage"):
                    usage = obj["usage"]
                if obj.get("choices") and obj["choices"][0]["delta"].get("content"):
                    # The simulator's tokens are its words (1-3 to an event): a client without a
                    # usage report counts what it read, not the events that carried it.
                    content += len(obj["choices"][0]["delta"]["content"].split())
            if kind == "abort" and content >= ABORT_AFTER:
                resp.close()  # the client leaves mid-stream
                break
        if kind == "usage":
            if usage is None:
                tally.errors.append(f"{name}: no usage event though asked for")
                return
            tally.add(name, usage["prompt_tokens"], usage["completion_tokens"])
        else:
            if usage is not None:
                tally.usage_leaks += 1
            tally.add(name, 0, content)


async def drive(bases: list[str], requests: int, clients: int, seed: int) -> tuple[Tally, float]:
    rng = random.Random(seed)
    plan = []
    for i in range(requests):
        kind = "abort" if i % 10 == 0 else "whole" if i % 2 else ("usage" if i % 4 == 2 else "bare")
        plan.append((TENANTS[rng.randrange(3)], kind))
    tally = Tally()
    queue: asyncio.Queue = asyncio.Queue()
    for i, p in enumerate(plan):
        queue.put_nowait((i, p))

    async def worker(session: aiohttp.ClientSession) -> None:
        while not queue.empty():
            i, (tenant, kind) = queue.get_nowait()
            try:
                await one(session, bases[i % len(bases)], tenant, kind, rng, tally)
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                tally.errors.append(f"{tenant}/{kind}: {type(exc).__name__}: {exc}")

    t0 = time.monotonic()
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(worker(session) for _ in range(clients)))
    return tally, time.monotonic() - t0


def engine_counts(url: str) -> tuple[int, int]:
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(("vllm:prompt_tokens_total", "vllm:generation_tokens_total"))}
    return int(values["vllm:prompt_tokens_total"]), int(values["vllm:generation_tokens_total"])


def start_redis(tmp: Path, core: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = spawn(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                  "--dir", str(tmp)], core)
    wait_port(port, proc, 10)
    return proc, f"redis://127.0.0.1:{port}/0"


def sim(core: str, model: str, *extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = spawn([sys.executable, "-m", "llmgw.engines.sim", "--model", model, "--port", str(port), *extra], core,
                 env={"PYTHONPATH": str(REPO)})
    wait_port(port, proc, 15)
    return proc, f"http://127.0.0.1:{port}"


def accuracy(tmp: Path, requests: int, clients: int) -> dict:
    from llmgw.state import Store
    from llmgw.tenancy.asked import reservation

    procs: list[subprocess.Popen] = []
    try:
        redis, redis_url = start_redis(tmp, LOAD_CORE)
        procs.append(redis)
        chat = [sim(LOAD_CORE, "chat") for _ in range(2)]
        slow = sim(LOAD_CORE, "slow", "--tokens-per-second", "200")
        procs += [p for p, _ in chat] + [slow[0]]
        hub_port, db = free_port(), str(tmp / "llmgw.db")
        spec = {"chat": [u for _, u in chat], "slow": slow[1], "redis": redis_url}
        hub = spawn([sys.executable, __file__, "--serve", "hub", "--port", str(hub_port), "--db", db, "--spec",
                     json.dumps(spec)], LOAD_CORE, env={"PYTHONPATH": str(REPO)}, log=tmp / "hub.log")
        procs.append(hub)
        wait_port(hub_port, hub, 15)
        bases, routers = [], []
        for i in range(2):
            port = free_port()
            r = spawn([LLMGW, "router", "--controller", f"http://127.0.0.1:{hub_port}", "--listen",
                       f"127.0.0.1:{port}", "--report-interval", "0.5", "--router-id", f"bench-{i}"],
                      SUT_CORE if i == 0 else LOAD_CORE, env={"LLMGW_ADMIN_TOKEN": TOKEN}, log=tmp / f"router{i}.log")
            procs.append(r)
            routers.append(r)
            wait_port(port, r, 20)
            bases.append(f"http://127.0.0.1:{port}")
        asyncio.run(wait_ready(bases))
        tally, elapsed = asyncio.run(drive(bases, requests, clients, seed=18))
        for r in routers:
            stop(r)  # SIGTERM: each sends its last batch before it exits
        engines = [engine_counts(u) for _, u in chat]
        slow_engine = engine_counts(slow[1])
        stop(hub)
        store = Store(db).open()
        ledger = {r["key"]: r for r in store.usage(0, 2 ** 40, by=("key",))}
        store.close()
    finally:
        for p in reversed(procs):
            stop(p)
        for r in (tmp / "router0.log", tmp / "router1.log", tmp / "hub.log"):
            if r.exists() and "Traceback" in r.read_text():
                print(f"--- {r.name}\n{r.read_text()[-3000:]}", file=sys.stderr)

    def led(name: str, field: str) -> int:
        return int(ledger.get(name, {}).get(field, 0))

    def told(name: str, i: int) -> int:
        return tally.by_key.get(name, [0, 0, 0])[i]

    diff_clients = 0
    for t in TENANTS:
        for k in ("whole", "usage"):
            n = key_name(t, k)
            diff_clients += abs(led(n, "prompt_tokens") - told(n, 1)) + abs(led(n, "completion_tokens") - told(n, 2))
            diff_clients += abs(led(n, "requests") - told(n, 0))
        n = key_name(t, "bare")
        diff_clients += abs(led(n, "completion_tokens") - told(n, 2)) + abs(led(n, "requests") - told(n, 0))
    chat_keys = [key_name(t, k) for t in TENANTS for k in ("whole", "usage", "bare")]
    ledger_chat = (sum(led(n, "prompt_tokens") for n in chat_keys), sum(led(n, "completion_tokens") for n in chat_keys))
    engine_chat = (sum(p for p, _ in engines), sum(g for _, g in engines))
    diff_engines = abs(ledger_chat[0] - engine_chat[0]) + abs(ledger_chat[1] - engine_chat[1])
    abort_keys = [key_name(t, "abort") for t in TENANTS]
    abort_ledger = sum(led(n, "completion_tokens") for n in abort_keys)
    abort_read = sum(told(n, 2) for n in abort_keys)
    abort_requests = sum(told(n, 0) for n in abort_keys)
    abort_from_stream = sum(led(n, "counted_from_stream") for n in abort_keys)
    capped = sum(led(key_name("capped", k), "prompt_tokens") + led(key_name("capped", k), "completion_tokens")
                 for k in KINDS)
    rng = random.Random(0)
    one_reservation = max(reservation(b, len(json.dumps(b))) for b in (body(k, rng) for k in KINDS))
    served = sum(v[0] for v in tally.by_key.values())
    return {
        "requests": requests, "clients": clients, "seconds": round(elapsed, 2),
        "served": served, "refused_429": tally.refused, "errors": len(tally.errors), "error_sample": tally.errors[:3],
        "usage_leaks": tally.usage_leaks,
        "tokens_ledger_vs_clients_diff": diff_clients, "tokens_ledger_vs_engines_diff": diff_engines,
        "ledger_chat_prompt_completion": list(ledger_chat), "engines_chat_prompt_completion": list(engine_chat),
        "aborted": abort_requests, "aborted_counted_from_stream": abort_from_stream,
        "aborted_tokens_client_read": abort_read, "aborted_tokens_ledger": abort_ledger,
        "aborted_tokens_engine_wrote": slow_engine[1],
        "capped_budget": BUDGET, "capped_ledger_tokens": capped, "capped_overshoot": max(0, capped - BUDGET),
        "one_reservation": one_reservation,
    }


async def wait_ready(bases: list[str]) -> None:
    """Both routers have the controller's snapshot: the keys, the tenants and the replicas."""
    deadline = time.monotonic() + 20
    async with aiohttp.ClientSession() as s:
        for base in bases:
            while True:
                async with s.get(base + "/v1/models", headers={"Authorization": f"Bearer {key('alpha', 'whole')}"}
                                 ) as r:
                    if r.status == 200 and any(m.get("ready") for m in (await r.json())["data"]):
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{base} never had a ready replica")
                await asyncio.sleep(0.1)


# --- the cost run -----------------------------------------------------------------------------------

ROUTERS = 3  # routers on each side of the cost run, each its own process
TEAMS = 200  # tenants of the cost run, one API key each
CONNECTIONS = 33  # wrk's, 11 to each router
SIDES = ("off", "local", "on")


def team_limits() -> Limits:
    """Each tenant's limits in the cost run: a team of a shared gateway. A router's allowance is a
    twentieth of a limit (45 requests, 4,500 tokens, one slot, 100,000 budget tokens) and what it
    did not use goes back every 0.25 s, so at a few requests a second per tenant and router the
    routers go back to Redis for a good share of requests. 200 of them admit 3,000 requests/s, more
    than three routers on one core answer: nobody is refused, what is measured is the counting."""
    from llmgw.catalog.model import Budget, Limits

    return Limits(requests_per_minute=900, tokens_per_minute=90_000, concurrent=20, budget=Budget(2_000_000, "day"))


def team_key(i: int) -> str:
    return f"sk-team{i:03d}"


def serve_teams_router(port: int, engine: str, limits: str, teams: int) -> None:
    """One router of the cost run: ``teams`` keys; limits "off" (no tenants), "local" (each tenant's
    limits counted in this router's memory) or a Redis URL (counted there for every router)."""
    from llmgw.catalog.model import Tenant
    from llmgw.router import KeyRing, Router, RouterConfig, hash_key

    keys = [{"name": f"team{i:03d}", "sha256": hash_key(team_key(i)), "models": ["*"]} for i in range(teams)]
    tenants = () if limits == "off" else tuple(Tenant(f"team{i:03d}", (f"team{i:03d}",), team_limits())
                                               for i in range(teams))

    async def serve() -> None:
        router = Router(keys=KeyRing.from_entries(keys), config=RouterConfig(
            limits_redis="" if limits in ("off", "local") else limits))
        router.set_catalog(catalog_of(tenants))
        router.set_endpoints(endpoints([engine], engine))
        await router.start()
        await router.listen("127.0.0.1", port)
        await asyncio.Event().wait()

    run_loop(serve())


def rotating_script(script: Path, ports: list[int], teams: int) -> Path:
    """wrk's script: thread i sends to router i, each request with the next tenant's key (thread i
    starts i/ROUTERS of the way along), so every tenant reaches every router in turn. The requests
    are formatted once per thread; the same script drives every side."""
    body = json.dumps({"model": "chat", "messages": [{"role": "user", "content": "Say something."}],
                       "max_tokens": 16})
    keys = ", ".join(json.dumps(team_key(i)) for i in range(teams))
    script.write_text(f"""
local ports = {{{", ".join(str(p) for p in ports)}}}
local keys = {{{keys}}}
local body = {json.dumps(body)}
local started = 0
function setup(thread)
  started = started + 1
  thread.addr = wrk.lookup("127.0.0.1", tostring(ports[started]))[1]
  thread:set("id", started)
end
function init(args)
  reqs = {{}}
  for i, k in ipairs(keys) do
    reqs[i] = wrk.format("POST", "/v1/chat/completions", {{["Host"] = "127.0.0.1",
      ["Content-Type"] = "application/json", ["Authorization"] = "Bearer " .. k}}, body)
  end
  at = (id - 1) * math.floor(#reqs / #ports)
end
function request()
  at = at % #reqs + 1
  return reqs[at]
end
""")
    return script


def wrk_routers(ports: list[int], script: Path, duration: float) -> dict:
    """One wrk run, a thread per router: requests answered, requests/s, latency, errors."""
    out = subprocess.run(["taskset", "-c", LOAD_CORE, "wrk", f"-t{len(ports)}", f"-c{CONNECTIONS}",
                          f"-d{max(1, round(duration))}s", "--timeout", "10s", "--latency", "-s", str(script),
                          f"http://127.0.0.1:{ports[0]}/v1/chat/completions"],
                         capture_output=True, text=True, timeout=duration + 60, check=True).stdout

    def ms(value: str, unit: str) -> float:
        return float(value) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit]
    lat = {m.group(1): ms(m.group(2), m.group(3))
           for m in re.finditer(r"^\s+(50|99)%\s+([\d.]+)(us|ms|s)\s*$", out, re.M)}
    answered = re.search(r"(\d+) requests in", out)
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    if answered is None or rps is None:
        raise RuntimeError(f"wrk said nothing measurable: {out[-500:]!r}")
    return {"answered": int(answered.group(1)), "rps": float(rps.group(1)),
            "p50_ms": lat.get("50", float("nan")), "p99_ms": lat.get("99", float("nan")),
            "errors": (int(non2xx.group(1)) if non2xx else 0) + (sum(map(int, sock.groups())) if sock else 0)}


def redis_counts(db: Any) -> tuple[int, int]:
    """Script calls (EVALSHA, EVAL: one round trip each) and every command Redis ran, the scripts'
    own included, from INFO commandstats (the bench's own INFO left out)."""
    stats = db.info("commandstats")
    calls = sum(v["calls"] for k, v in stats.items() if k in ("cmdstat_evalsha", "cmdstat_eval"))
    commands = sum(v["calls"] for k, v in stats.items() if k != "cmdstat_info")
    return calls, commands


def cost(tmp: Path, duration: float, rounds: int, teams: int) -> dict:
    """Requests/s of ROUTERS routers with ``teams`` tenants' limits off, counted in each router's
    memory, and shared in Redis, measured in turn ``rounds`` times, each round in another order;
    a ratio is the median of its per-round ratios (both sides from the same round, so the drift
    of a shared machine's load falls on both alike)."""
    import redis as redis_client

    procs: list[subprocess.Popen] = []
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    loads: list[float] = []
    try:
        redis, redis_url = start_redis(tmp, LOAD_CORE)
        engine_proc, engine = sim(LOAD_CORE, "chat")
        procs += [redis, engine_proc]
        routers: dict[str, list[subprocess.Popen]] = {}
        ports: dict[str, list[int]] = {}
        for side in SIDES:
            ports[side] = [free_port() for _ in range(ROUTERS)]
            routers[side] = [spawn([sys.executable, __file__, "--serve", "router", "--port", str(port), "--engine",
                                    engine, "--limits", redis_url if side == "on" else side, "--teams", str(teams)],
                                   SUT_CORE, env={"PYTHONPATH": str(REPO)}, log=tmp / f"cost-{side}-{i}.log")
                             for i, port in enumerate(ports[side])]
            procs += routers[side]
        for side in SIDES:
            for port, proc in zip(ports[side], routers[side], strict=True):
                wait_port(port, proc, 30)
        scripts = {side: rotating_script(tmp / f"teams-{side}.lua", ports[side], teams) for side in SIDES}
        db = redis_client.Redis.from_url(redis_url)
        for i in range(rounds):
            # Idle routers cost nothing: one side at a time is measured, each round starting one
            # further along (whoever goes first in a round is not always the same one).
            for side in SIDES[i % 3:] + SIDES[:i % 3]:
                # A second of the same traffic first: what is measured is steady traffic (with
                # limits on, each tenant's first grant on each router, and what the routers gave
                # back while another side ran, falls here), on every side alike.
                wrk_routers(ports[side], scripts[side], 1.0)
                loads.append(os.getloadavg()[0])
                cpu = sum(cpu_seconds(p.pid) for p in routers[side])
                redis_cpu, engine_cpu, wrk_cpu = cpu_seconds(redis.pid), cpu_seconds(engine_proc.pid), children_cpu()
                calls, commands = redis_counts(db)
                started = time.monotonic()
                run = wrk_routers(ports[side], scripts[side], duration)
                calls_after, commands_after = redis_counts(db)
                answered = max(1, run["answered"])
                # How busy core 1 was with the engine, wrk and Redis (1.0: all of it): the routers'
                # core is the one measured only while this stays below 1.
                run["load_core_busy"] = (cpu_seconds(redis.pid) - redis_cpu + cpu_seconds(engine_proc.pid) - engine_cpu
                                         + children_cpu() - wrk_cpu) / (time.monotonic() - started)
                # The routers' own CPU per request answered: what limits cost them, whatever else
                # the machine runs meanwhile (requests/s on a shared box moves by a third between
                # rounds; CPU time per request far less).
                run["cpu_us"] = (sum(cpu_seconds(p.pid) for p in routers[side]) - cpu) / answered * 1e6
                run["redis_cpu_us"] = (cpu_seconds(redis.pid) - redis_cpu) / answered * 1e6
                run["redis_calls"] = (calls_after - calls) / answered
                run["redis_commands"] = (commands_after - commands) / answered
                runs[side].append(run)
        db.close()
        loads.append(os.getloadavg()[0])
    finally:
        for p in reversed(procs):
            stop(p)
        for log_file in sorted(tmp.glob("cost-*.log")):
            if "Traceback" in log_file.read_text():
                print(f"--- {log_file.name}\n{log_file.read_text()[-3000:]}", file=sys.stderr)
    return cost_figures(runs, rounds=rounds, teams=teams, loads=loads)


def cost_figures(runs: dict[str, list[dict]], *, rounds: int, teams: int, loads: list[float]) -> dict:
    """The cost run's figures: per side the medians over its rounds, ratios as medians of the
    per-round ratios; a ratio some round could not give (a side that answered nothing) is None."""
    def med(side: str, k: str) -> float:
        return statistics.median(r[k] for r in runs[side])

    def paired(num: str, den: str, k: str = "rps", invert: bool = False) -> tuple[float | None, list]:
        each = []
        for a, b in zip(runs[num], runs[den], strict=True):
            x, y = (b[k], a[k]) if invert else (a[k], b[k])
            each.append(round(x / y, 3) if y else None)
        return (None if not each or None in each else round(statistics.median(each), 3)), each

    on_vs_off, on_rounds = paired("on", "off")
    local_vs_off, local_rounds = paired("local", "off")
    cpu_on_vs_off, cpu_rounds = paired("on", "off", "cpu_us", invert=True)
    for side in SIDES:
        each = ", ".join(f"{r['rps']:.0f}" for r in runs[side])
        print(f"limits {side:5s}: {med(side, 'rps'):.0f} req/s (median of {rounds}: {each}), p50 "
              f"{med(side, 'p50_ms'):.2f} ms, p99 {med(side, 'p99_ms'):.2f} ms, routers' CPU "
              f"{med(side, 'cpu_us'):.0f} us a request" + (f", Redis {med(side, 'redis_calls'):.3f} calls and "
                                                            f"{med(side, 'redis_cpu_us'):.0f} us of CPU a request"
                                                            if side == "on" else ""), flush=True)
    out: dict[str, Any] = {"routers": ROUTERS, "tenants": teams, "connections": CONNECTIONS, "rounds": rounds,
                           "tenant_limits": {"requests_per_minute": 900, "tokens_per_minute": 90_000,
                                             "concurrent": 20, "budget_tokens_per_day": 2_000_000}}
    for side in SIDES:
        out[f"rps_limits_{side}"] = med(side, "rps")
        out[f"rps_limits_{side}_rounds"] = [r["rps"] for r in runs[side]]
        out[f"p50_ms_limits_{side}"] = med(side, "p50_ms")
        out[f"p99_ms_limits_{side}"] = med(side, "p99_ms")
        out[f"cpu_us_per_request_limits_{side}"] = round(med(side, "cpu_us"), 1)
    out.update({
        "on_vs_off": on_vs_off, "on_vs_off_rounds": on_rounds,
        "local_vs_off": local_vs_off, "local_vs_off_rounds": local_rounds,
        # Requests a CPU second of the routers serves with limits on, as a share of off's (the rps
        # ratio's counterpart that the machine's other load moves less).
        "cpu_on_vs_off": cpu_on_vs_off, "cpu_on_vs_off_rounds": cpu_rounds,
        "redis_calls_per_request": round(med("on", "redis_calls"), 4),
        "redis_calls_per_request_rounds": [round(r["redis_calls"], 4) for r in runs["on"]],
        "redis_commands_per_request": round(med("on", "redis_commands"), 3),
        "redis_cpu_us_per_request": round(med("on", "redis_cpu_us"), 1),
        "load_core_busy": {side: round(med(side, "load_core_busy"), 2) for side in SIDES},
        # The routers with limits on giving back what they held once idle (KEEP seconds after
        # their run), while another side was measured.
        "redis_calls_per_request_off_local": round(max((r["redis_calls"] for s in ("off", "local")
                                                        for r in runs[s]), default=0.0), 4),
        "cost_errors": sum(r["errors"] for rs in runs.values() for r in rs),
        "load_avg_1m": [round(x, 2) for x in loads],
    })
    return out


def children_cpu() -> float:
    """User and system CPU seconds of this process's children that ended (wrk's runs)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds process ``pid`` has used (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="under a minute")
    p.add_argument("--requests", type=int, default=2000, help="requests of the accuracy run")
    p.add_argument("--clients", type=int, default=32, help="clients of the accuracy run")
    p.add_argument("--duration", type=float, default=None, help="seconds per wrk run (default 5, quick 2)")
    p.add_argument("--rounds", type=int, default=None, help="rounds of the cost run (default 5, quick 3)")
    p.add_argument("--teams", type=int, default=TEAMS, help="tenants of the cost run")
    p.add_argument("--only", choices=("accuracy", "cost"), help="one part (the other's checks are then not met)")
    p.add_argument("--serve", choices=("hub", "router"), help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--db", help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--engine", help=argparse.SUPPRESS)
    p.add_argument("--limits", default="off", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.serve == "hub":
        run_loop(serve_hub(a.port, a.db, json.loads(a.spec)))
        return 0
    if a.serve == "router":
        serve_teams_router(a.port, a.engine, a.limits, a.teams)
        return 0
    if not have_tools(("redis-server", "wrk", "taskset"), "redis-server wrk util-linux"):
        return 2
    started = time.monotonic()
    os.sched_setaffinity(0, {int(LOAD_CORE)})
    acc: dict[str, Any] = {}
    c: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="llmgw-usage-bench-") as d:
        tmp = Path(d)
        if a.only != "cost":
            acc = accuracy(tmp, a.requests, a.clients)
            print(f"{acc['served']} answered, {sum(acc['refused_429'].values())} refused (429) in {acc['seconds']} "
                  f"s; ledger vs clients {acc['tokens_ledger_vs_clients_diff']} tokens apart, vs engines "
                  f"{acc['tokens_ledger_vs_engines_diff']}; aborted {acc['aborted']}: read "
                  f"{acc['aborted_tokens_client_read']} ≤ ledger {acc['aborted_tokens_ledger']} ≤ engine "
                  f"{acc['aborted_tokens_engine_wrote']}; capped tenant {acc['capped_ledger_tokens']} tokens of "
                  f"{acc['capped_budget']} (one reservation {acc['one_reservation']})", flush=True)
        if a.only != "accuracy":
            c = cost(tmp, a.duration or (2.0 if a.quick else 5.0), a.rounds or (3 if a.quick else 5), a.teams)
    checks = judge(acc, c)
    for name, ok in checks.items():
        print(f"  {'ok  ' if ok else 'FAIL'} {name}")
    out = {"bench": "usage", "quick": a.quick, **acc, **c, "elapsed_s": round(time.monotonic() - started, 1),
           "goal": f"limits shared in Redis by {ROUTERS} routers, {a.teams} tenants at hundreds of requests a minute: "
                   "requests/s >= 0.90 x limits off (median of per-round ratios); the ledger exact",
           "checks": checks, "not_measured": [k for k, v in checks.items() if v is None],
           "met": all(v is True for v in checks.values())}
    print(json.dumps(out))
    return 0 if out["met"] else 1


def judge(acc: dict[str, Any], c: dict[str, Any]) -> dict[str, bool | None]:
    """Each check: True, False, or None when its figures were not measured (then not met either)."""
    def given(d: dict[str, Any], *keys: str) -> bool:
        return all(d.get(k) is not None for k in keys)

    checks: dict[str, bool | None] = {}
    if given(acc, "tokens_ledger_vs_clients_diff"):
        checks.update({
            "ledger = clients (0 tokens apart)": acc["tokens_ledger_vs_clients_diff"] == 0,
            "ledger = engines (0 tokens apart)": acc["tokens_ledger_vs_engines_diff"] == 0,
            # An abort check with nothing aborted would hold whatever the router does.
            "aborted: client read <= ledger <= engine wrote": acc["aborted"] > 0
            and acc["aborted_tokens_client_read"] <= acc["aborted_tokens_ledger"] <= acc["aborted_tokens_engine_wrote"],
            # A cut stream is charged the engine's running count (continuous usage), not an
            # estimate from the events the router relayed.
            "aborted: each charged the engine's own count": acc["aborted"] > 0
            and acc["aborted_counted_from_stream"] == 0,
            "budget overshoot <= one reservation": acc["capped_overshoot"] <= acc["one_reservation"],
            "the budget refused requests": acc["refused_429"]["capped"] > 0,
            "no other tenant refused": acc["refused_429"]["alpha"] == acc["refused_429"]["beta"] == 0,
            "accuracy run: no errors, no usage event leaked": acc["errors"] == 0 and acc["usage_leaks"] == 0,
        })
    else:
        checks["the ledger's accuracy"] = None
    checks["cost run: no errors, nobody refused"] = c["cost_errors"] == 0 if given(c, "cost_errors") else None
    # The routers went back to Redis while measured (what the old cost run never did).
    checks["cost run: Redis on the path (limits on)"] = (
        c["redis_calls_per_request"] > 0 if given(c, "redis_calls_per_request") else None)
    checks["limits on (shared in Redis) >= 0.90 x off"] = c["on_vs_off"] >= 0.9 if given(c, "on_vs_off") else None
    return checks


if __name__ == "__main__":
    sys.exit(main())
