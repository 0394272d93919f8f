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
- bare keys: ledger completion tokens = the content events the clients counted (goal: 0);
- model ``chat`` (every request but the aborted ones): ledger = the engines' counters (goal: 0);
- aborted: the ledger's completion tokens lie between what the clients read and what the engine
  wrote before it saw them leave (a token in a socket buffer is neither read nor unsent), and
  their prompts are counted as 0 (no engine reported them; see llmgw/router/usage.py);
- the capped tenant's ledger tokens over its budget: at most one request's reservation.

**Cost.** One router pinned to core 0, wrk and the engine on core 1, 32 connections of a
non-streamed chat request with an API key: limits off (no tenants), and on (the key's tenant has
requests/tokens per minute, concurrency and a budget, counted in Redis, also on core 1).
Goal: on ≥ 90 % of off's requests/s.

    python bench/usage_bench.py [--quick] [--requests N]

The last line is one JSON object with every figure and ``met``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from router_bench import LOAD_CORE, SUT_CORE, free_port, have_tools, run_loop, spawn, stop, wait_port, wrk  # noqa: E402

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
    from llmgw.catalog.model import Budget, Catalog, Limits, Model, ModelName, Profile, Settings, Tenant

    profile = Profile(name="sim", priority=0, engine="sim", gpus=0)
    models = tuple(Model(name=ModelName(n), source="/bench", size_gb=1, profiles=(profile,)) for n in ("chat", "slow"))
    tenants = ()
    if with_tenants:
        def lim(t: str) -> Limits:
            d = limits_for(t)
            budget = Budget(d["budget"]["tokens"], d["budget"]["per"]) if "budget" in d else None
            return Limits(d.get("requests_per_minute"), d.get("tokens_per_minute"), d.get("concurrent"), budget)
        tenants = tuple(Tenant(t, tuple(key_name(t, k) for k in KINDS), lim(t)) for t in TENANTS)
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


async def serve_router(port: int, engine: str, redis: str) -> None:
    """One router with the 12 keys; with ``redis`` ("local": in memory), their tenants' limits."""
    from llmgw.router import KeyRing, Router, RouterConfig

    url = "" if redis == "local" else redis
    router = Router(keys=KeyRing.from_entries(api_keys()), config=RouterConfig(limits_redis=url))
    router.set_catalog(catalog(bool(redis)))
    router.set_endpoints(endpoints([engine], engine))
    await router.start()
    await router.listen("127.0.0.1", port)
    await asyncio.Event().wait()


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
                    content += 1
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

def cost(tmp: Path, duration: float, rounds: int) -> dict:
    """Requests/s of one router with limits off, local and in Redis: the three measured in turn,
    ``rounds`` times, each figure the median of its rounds (so a machine's drift during the run
    falls on all three alike)."""
    procs: list[subprocess.Popen] = []
    script = tmp / "post.lua"
    b = json.dumps({"model": "chat", "messages": [{"role": "user", "content": "Say something."}],
                    "max_tokens": 16})
    script.write_text('wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
                      f'wrk.headers["Authorization"] = "Bearer {key("alpha", "whole")}"\nwrk.body = {json.dumps(b)}\n')
    runs: dict[str, list[dict]] = {"off": [], "local": [], "on": []}
    routers: dict[str, subprocess.Popen] = {}
    try:
        redis, redis_url = start_redis(tmp, LOAD_CORE)
        engine_proc, engine = sim(LOAD_CORE, "chat")
        procs += [redis, engine_proc]
        targets = {}
        for name, url in (("off", ""), ("local", "local"), ("on", redis_url)):
            port = free_port()
            r = spawn([sys.executable, __file__, "--serve", "router", "--port", str(port), "--engine", engine,
                       "--redis", url], SUT_CORE, env={"PYTHONPATH": str(REPO)}, log=tmp / f"cost-{name}.log")
            procs.append(r)
            routers[name] = r
            wait_port(port, r, 15)
            targets[name] = f"http://127.0.0.1:{port}/v1/chat/completions"
            wrk(targets[name], script, 8, 1.0)  # warm-up
        order = list(targets)
        for i in range(rounds):
            # Idle routers cost nothing: one at a time is measured, each round in another order
            # (whoever goes first in a round is not always the same one).
            for name in order[i % 3:] + order[:i % 3]:
                cpu = cpu_seconds(routers[name].pid)
                run = wrk(targets[name], script, 32, duration)
                # The router's own CPU per request answered: what limits cost it, whatever else
                # the machine runs meanwhile (requests/s on a shared box moves by a third between
                # rounds; CPU time per request far less).
                answered = run["rps"] * max(1, round(duration))  # wrk's -d, as router_bench.wrk rounds it
                run["cpu_us"] = (cpu_seconds(routers[name].pid) - cpu) / max(1.0, answered) * 1e6
                runs[name].append(run)
    finally:
        for p in reversed(procs):
            stop(p)
    med = {name: {k: statistics.median(r[k] for r in rs) for k in ("rps", "p50_ms", "p99_ms", "cpu_us")}
           for name, rs in runs.items()}
    for name, m in med.items():
        each = ", ".join(f"{r['rps']:.0f}" for r in runs[name])
        print(f"limits {name:5s}: {m['rps']:.0f} req/s (median of {rounds}: {each}), p50 {m['p50_ms']:.2f} ms, "
              f"p99 {m['p99_ms']:.2f} ms, router CPU {m['cpu_us']:.0f} us a request", flush=True)
    return {"rps_limits_off": med["off"]["rps"], "rps_limits_local": med["local"]["rps"],
            "rps_limits_on": med["on"]["rps"], "p99_ms_limits_off": med["off"]["p99_ms"],
            "p99_ms_limits_on": med["on"]["p99_ms"], "rounds": rounds,
            "local_vs_off": round(med["local"]["rps"] / med["off"]["rps"], 3),
            "on_vs_off": round(med["on"]["rps"] / med["off"]["rps"], 3),
            "cpu_us_per_request_limits_off": round(med["off"]["cpu_us"], 1),
            "cpu_us_per_request_limits_local": round(med["local"]["cpu_us"], 1),
            "cpu_us_per_request_limits_on": round(med["on"]["cpu_us"], 1),
            # Requests a CPU second serves with limits on, as a share of off's (the rps ratio's
            # counterpart that the machine's other load moves less).
            "cpu_on_vs_off": round(med["off"]["cpu_us"] / med["on"]["cpu_us"], 3),
            "cost_errors": sum(r["non2xx"] for rs in runs.values() for r in rs)}


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds process ``pid`` has used (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="under a minute")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--duration", type=float, default=None, help="seconds per wrk run (default 5, quick 2)")
    p.add_argument("--serve", choices=("hub", "router"), help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--db", help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--engine", help=argparse.SUPPRESS)
    p.add_argument("--redis", default="", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.serve == "hub":
        run_loop(serve_hub(a.port, a.db, json.loads(a.spec)))
        return 0
    if a.serve == "router":
        run_loop(serve_router(a.port, a.engine, a.redis))
        return 0
    if not have_tools(("redis-server", "wrk", "taskset"), "redis-server wrk util-linux"):
        return 2
    started = time.monotonic()
    os.sched_setaffinity(0, {int(LOAD_CORE)})
    with tempfile.TemporaryDirectory(prefix="llmgw-usage-bench-") as d:
        tmp = Path(d)
        acc = accuracy(tmp, a.requests, a.clients)
        print(f"{acc['served']} answered, {sum(acc['refused_429'].values())} refused (429) in {acc['seconds']} s; "
              f"ledger vs clients {acc['tokens_ledger_vs_clients_diff']} tokens apart, vs engines "
              f"{acc['tokens_ledger_vs_engines_diff']}; aborted {acc['aborted']}: read "
              f"{acc['aborted_tokens_client_read']} ≤ ledger {acc['aborted_tokens_ledger']} ≤ engine "
              f"{acc['aborted_tokens_engine_wrote']}; capped tenant {acc['capped_ledger_tokens']} tokens of "
              f"{acc['capped_budget']} (one reservation {acc['one_reservation']})", flush=True)
        c = cost(tmp, a.duration or (2.0 if a.quick else 5.0), 3 if a.quick else 5)
    checks = {
        "ledger = clients (0 tokens apart)": acc["tokens_ledger_vs_clients_diff"] == 0,
        "ledger = engines (0 tokens apart)": acc["tokens_ledger_vs_engines_diff"] == 0,
        "aborted: client read <= ledger <= engine wrote": acc["aborted_tokens_client_read"]
        <= acc["aborted_tokens_ledger"] <= acc["aborted_tokens_engine_wrote"],
        "aborted: each counted from the stream": acc["aborted_counted_from_stream"] == acc["aborted"],
        "budget overshoot <= one reservation": acc["capped_overshoot"] <= acc["one_reservation"],
        "the budget refused requests": acc["refused_429"]["capped"] > 0,
        "no other tenant refused": acc["refused_429"]["alpha"] == acc["refused_429"]["beta"] == 0,
        "no errors, no usage event leaked": acc["errors"] == 0 and acc["usage_leaks"] == 0 and c["cost_errors"] == 0,
        "limits on >= 90 % of off": c["on_vs_off"] >= 0.9,
    }
    for name, ok in checks.items():
        print(f"  {'ok  ' if ok else 'FAIL'} {name}")
    out = {"bench": "usage", "quick": a.quick, **acc, **c, "elapsed_s": round(time.monotonic() - started, 1),
           "checks": checks, "met": all(checks.values())}
    print(json.dumps(out))
    return 0 if out["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
