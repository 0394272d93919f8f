"""Tenants' limits shared by two routers through one real ``redis-server``, and what a router
does when Redis goes away (degraded mode: it limits on its own, says so, and does not fail)."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import AsyncExitStack

import aiohttp
import openai
import pytest

from llmgw.catalog.model import Budget, Catalog, Limits, Settings, Tenant
from llmgw.engines.testing import SimProcess, free_port
from llmgw.router import KeyRing, Router, RouterConfig, hash_key
from llmgw.tenancy.memory import Limiter, Ticket
from llmgw.tenancy.rules import Refusal, period_start
from llmgw.tenancy.shared import SharedLimits, SharedTicket, redacted
from tests.fixtures.clock import ManualClock
from tests.router.conftest import endpoint, serving, sim_metric
from tests.router.fake_controller import model
from tests.router.test_deliveries import engine, write_completion

pytestmark = pytest.mark.skipif(not shutil.which("redis-server"),
                                reason="redis-server is not installed (apt-get install redis-server)")
MESSAGES = [{"role": "user", "content": "Hello"}]


@pytest.fixture(autouse=True)
def redis_in_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Redis gets 5 s a call instead of 0.25 s: a call slower than that on a busy machine is degraded
    mode, limits counted per router, which none of these tests is about (degraded mode is seen with
    Redis killed, or busy on purpose). Routers made after this read it (their client's timeouts too)."""
    from llmgw.tenancy import shared as shared_limits

    monkeypatch.setattr(shared_limits, "TIMEOUT", 5.0)


@pytest.fixture
def redis_url() -> Iterator[tuple[str, subprocess.Popen]]:
    port = free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--daemonize", "no"], stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)
    try:
        yield f"redis://127.0.0.1:{port}/0", proc
    finally:
        proc.kill()
        proc.wait(5)


def router(chat_sim: SimProcess, url: str, limits: Limits) -> Router:
    return router_at(chat_sim.endpoint, url, limits)


def router_at(engine_url: str, url: str, limits: Limits) -> Router:
    keys = KeyRing.from_entries([{"name": "team-key", "sha256": hash_key("sk-team"), "models": ["*"]}])
    r = Router(keys=keys, config=RouterConfig(limits_redis=url))
    r.set_catalog(Catalog(models=(model("chat"),), settings=Settings(tenants=(Tenant("team", ("team-key",), limits),))))
    r.set_endpoints([endpoint("chat", engine_url)])
    return r


async def metric(base: str, name: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(base + "/metrics") as resp:
        text = await resp.text()
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


async def test_two_routers_enforce_one_tenants_limit_together(chat_sim: SimProcess, redis_url) -> None:  # noqa: ANN001
    url, _ = redis_url
    before = sim_metric(chat_sim.endpoint, "llmgw_sim_requests_total")
    async with AsyncExitStack() as stack:
        bases = [await stack.enter_async_context(serving(router(chat_sim, url, Limits(requests_per_minute=10))))
                 for _ in range(2)]
        clients = [openai.AsyncOpenAI(base_url=b + "/v1", api_key="sk-team", max_retries=0, timeout=15) for b in bases]
        ok = refused = 0
        started = time.monotonic()
        for i in range(16):  # alternating: each router alone would admit 10
            try:
                await clients[i % 2].chat.completions.create(model="chat", messages=MESSAGES, max_tokens=1)
                ok += 1
            except openai.RateLimitError as exc:
                refused += 1
                assert exc.response.headers["x-ratelimit-limit-requests"] == "10"
        # The bucket refills one request every 6 s: on a machine slow enough to take that long, the
        # one that came back is admitted too (none, on any machine that answers 16 in 6 s).
        refilled = int((time.monotonic() - started) * 10 / 60)
        for c in clients:
            await c.close()
        assert await metric(bases[0], "llmgw_router_limits_degraded") == 0
    assert 10 <= ok <= 10 + refilled and ok + refused == 16, (ok, refused, refilled)
    assert sim_metric(chat_sim.endpoint, "llmgw_sim_requests_total") - before == ok


async def test_a_budget_spent_through_one_router_is_spent_for_the_other(chat_sim: SimProcess, redis_url) -> None:  # noqa: ANN001
    url, _ = redis_url
    limits = Limits(budget=Budget(tokens=200, per="day"))
    async with AsyncExitStack() as stack:
        a = await stack.enter_async_context(serving(router(chat_sim, url, limits)))
        b = await stack.enter_async_context(serving(router(chat_sim, url, limits)))
        ca = openai.AsyncOpenAI(base_url=a + "/v1", api_key="sk-team", max_retries=0, timeout=15)
        cb = openai.AsyncOpenAI(base_url=b + "/v1", api_key="sk-team", max_retries=0, timeout=15)
        used = 0
        with pytest.raises(openai.RateLimitError) as refused:
            for _ in range(20):
                r = await ca.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=20)
                used += r.usage.total_tokens
        assert used <= 200
        with pytest.raises(openai.RateLimitError) as also:  # the other router sees the same budget
            await cb.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=20)
        assert "budget per day" in refused.value.message and "budget per day" in also.value.message
        await ca.close()
        await cb.close()


async def test_redis_going_away_degrades_to_local_limits_and_says_so(chat_sim: SimProcess, redis_url,  # noqa: ANN001
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    url, proc = redis_url
    async with serving(router(chat_sim, url, Limits(requests_per_minute=3))) as base:
        c = openai.AsyncOpenAI(base_url=base + "/v1", api_key="sk-team", max_retries=0, timeout=15)
        await c.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=1)
        proc.kill()
        proc.wait(5)
        # Still limited (locally, 3 a minute), never a 500, and the router says it is degraded.
        answers = []
        for _ in range(5):
            try:
                await c.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=1)
                answers.append(200)
            except openai.RateLimitError:
                answers.append(429)
        assert answers == [200, 200, 200, 429, 429]
        assert await metric(base, "llmgw_router_limits_degraded") == 1
        await c.close()
    assert "cannot be reached" in caplog.text and "degraded mode" in caplog.text


def test_the_redis_password_never_reaches_a_log() -> None:
    assert redacted("redis://:s3cret@10.0.0.5:6379/0") == "redis://:***@10.0.0.5:6379/0"
    assert redacted("redis://user:s3cret@cache/1") == "redis://user:***@cache/1"
    assert redacted("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


async def test_a_standalone_router_takes_the_redis_the_controller_names(chat_sim: SimProcess, redis_url) -> None:  # noqa: ANN001

    from llmgw.contract import catalog_view
    from llmgw.control.feed import FeedHub
    from llmgw.router.follow import FeedClient

    url, _ = redis_url
    hub = FeedHub()
    catalog = Catalog(models=(model("chat"),), settings=Settings(tenants=(
        Tenant("team", ("team-key",), Limits(requests_per_minute=2)),)))
    hub.set_catalog(catalog)
    hub.set_endpoints([endpoint("chat", chat_sim.endpoint)])
    hub.set_limits_redis(url)
    snap = hub.snapshot()
    assert snap is not None and snap["limits_redis"] == url and snap["catalog"] == catalog_view(catalog)
    keys = KeyRing.from_entries([{"name": "team-key", "sha256": hash_key("sk-team"), "models": ["*"]}])
    standalone = [Router(keys=keys) for _ in range(2)]
    for r in standalone:
        FeedClient(r, "http://controller.invalid", "token")._apply(json.dumps(snap).encode())
    async with AsyncExitStack() as stack:
        bases = [await stack.enter_async_context(serving(r)) for r in standalone]
        answers = []
        for i in range(4):
            async with openai.AsyncOpenAI(base_url=bases[i % 2] + "/v1", api_key="sk-team", max_retries=0,
                                          timeout=15) as c:
                try:
                    await c.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=1)
                    answers.append(200)
                except openai.RateLimitError:
                    answers.append(429)
    assert answers == [200, 200, 429, 429]  # 2 a minute over both routers together


# --- allowances: many requests at once, and a router that dies holding some ---------------------

def budget_key(budget: Budget) -> str:
    return f"llmgw:limits:team:budget:{int(period_start(budget, time.time()))}"


async def test_two_routers_under_load_stay_within_the_limits_and_hold_nothing_once_idle(redis_url) -> None:  # noqa: ANN001
    """20 clients at once through two routers: never more than 3 at the engine (the tenant's
    concurrent limit), the budget not overshot, and once the requests are over, nothing is left
    reserved or in flight in Redis: every allowance went back."""
    url, _ = redis_url
    budget = Budget(tokens=500, per="day")
    running = peak = 0

    async def answer(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.05)
        running -= 1
        await write_completion(w, 1, 10)

    served = 0
    refusals: set[str] = set()
    async with engine(answer) as (engine_url, _), AsyncExitStack() as stack:
        bases = []
        for _ in range(2):
            r = router_at(engine_url, url, Limits(concurrent=3, budget=budget))
            bases.append(await stack.enter_async_context(serving(r)))

        async def client(base: str) -> None:
            nonlocal served
            async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="sk-team", max_retries=0, timeout=15) as c:
                while True:
                    try:
                        await c.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=10)
                        served += 1
                    except openai.RateLimitError as exc:
                        if "budget" in exc.message:
                            refusals.add("budget")
                            return
                        refusals.add("concurrent")
                        await asyncio.sleep(0.02)

        await asyncio.gather(*(client(bases[i % 2]) for i in range(20)))
        import redis

        with redis.Redis.from_url(url) as db:
            def left() -> tuple[int, int, int, list]:
                used, reserved = (int(v or 0) for v in db.hmget(budget_key(budget), "used", "reserved"))
                held = [k for k in db.scan_iter("llmgw:limits:held:*") if db.hlen(k)]
                return used, reserved, int(db.get("llmgw:limits:team:inflight") or 0), held

            # The routers' syncs give back what they held (each within SYNC_EVERY of its last use):
            # waited for in Redis, not for a time.
            deadline = time.monotonic() + 30  # a bound on a hang
            while (now := left())[1:] != (0, 0, []) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            used, reserved, inflight, held = now
    assert peak <= 3 and refusals == {"budget", "concurrent"}
    assert used == 11 * served and 400 <= used <= 500, (served, used)
    assert (reserved, inflight, held) == (0, 0, [])


async def test_what_a_dead_router_held_goes_back_when_its_lease_runs_out(redis_url) -> None:  # noqa: ANN001
    """A router that stops calling Redis (killed, or cut off) with an allowance and a request in
    flight: once its lease has run out, the next call of another router gives back what it held;
    if it comes back, its own give-back takes nothing from the other's holdings. On a clock the
    test moves (the script runs by it): a's timers never fire, so a says nothing more."""
    from llmgw.tenancy.shared import LEASE

    url, _ = redis_url
    budget = Budget(tokens=1000, per="day")
    limiter = Limiter((Tenant("team", ("team-key",), Limits(budget=budget, concurrent=100)),))
    import redis

    db = redis.Redis.from_url(url)

    def counts() -> tuple[int, int]:
        return int(db.hget(budget_key(budget), "reserved") or 0), int(db.get("llmgw:limits:team:inflight") or 0)

    clock = ManualClock(time.time())
    a, b = (SharedLimits(url, limiter=limiter, clock=clock, wall=clock, server_clock=clock, timer=clock.later)
            for _ in range(2))
    ticket_a = await a.admit("team-key", ("chat",), 10, clock())
    assert isinstance(ticket_a, SharedTicket)
    assert counts() == (50, 5)  # a twentieth of each limit, held by a
    clock.now += LEASE + 1  # a's lease runs out; its timers never fired
    again = await b.admit("team-key", ("chat",), 10, clock())
    assert isinstance(again, SharedTicket)
    assert counts() == (50, 5)  # a's given back, b's taken
    ticket_a.settle(7)
    ticket_a.release()  # a comes back: its request ended, it gives back what it no longer holds
    await a.close()
    assert counts() == (50, 5)
    assert int(db.hget(budget_key(budget), "used") or 0) == 7  # what was used is used all the same
    again.settle(4)
    again.release()
    await b.close()
    assert counts() == (0, 0)
    assert int(db.hget(budget_key(budget), "used") or 0) == 11
    db.close()


async def test_a_grant_redis_ran_after_the_router_gave_up_on_it_is_not_held_for_ever(redis_url, monkeypatch) -> None:  # noqa: ANN001
    """Redis busy for seconds (a slow command): the router's call times out, it limits alone for a
    while, and Redis then runs the grant anyway. What that grant holds goes back once the lease
    of the instance that asked runs out, though the router lives on under a new one."""
    import threading

    import redis

    from llmgw.tenancy import shared as shared_limits

    # The router's call gives up after 1 s; Redis stays busy 4 s from before that call is sent.
    # Leases and retries run by a clock the test moves (the script and both routers run by it).
    monkeypatch.setattr(shared_limits, "TIMEOUT", 1.0)
    url, _ = redis_url
    limiter = Limiter((Tenant("team", ("team-key",), Limits(concurrent=1)),))
    clock = ManualClock(time.time())
    a, b = (SharedLimits(url, limiter=limiter, clock=clock, wall=clock, server_clock=clock, timer=clock.later)
            for _ in range(2))
    first = await a.admit("team-key", ("chat",), 10, clock())  # the script is loaded
    assert isinstance(first, SharedTicket)
    first.release()
    for _ in range(int(shared_limits.KEEP / shared_limits.SYNC_EVERY) + 2):
        clock.now += shared_limits.SYNC_EVERY  # a's syncs, as its loop would run them: unused, the slot goes back
        for callback in clock.due():
            callback()
        assert await a.idle(30)
    with redis.Redis.from_url(url) as db:
        assert int(db.get("llmgw:limits:team:inflight") or 0) == 0

    script = ("local t0 = redis.call('TIME') local s = t0[1] + t0[2] / 1e6 while true do "
              "local t = redis.call('TIME') if t[1] + t[2] / 1e6 - s > 4 then break end end return 1")
    sent = threading.Event()
    replies: list[bytes] = []

    def busy() -> None:
        # Raw RESP, so the test knows when the script is in Redis's hands: a PING answered first
        # (the connection accepted and read, not left in the listen backlog behind the router's
        # call), then the script, sent before the router's call is, which queues behind it (Redis
        # serves its clients one at a time, in the order their bytes came).
        host, port = url.removeprefix("redis://").split("/")[0].split(":")

        def resp(*words: bytes) -> bytes:
            return b"*%d\r\n" % len(words) + b"".join(b"$%d\r\n%s\r\n" % (len(w), w) for w in words)

        with socket.create_connection((host, int(port)), timeout=60) as conn:
            conn.sendall(resp(b"PING"))
            replies.append(conn.recv(64))
            conn.sendall(resp(b"EVAL", script.encode(), b"0"))
            sent.set()
            replies.append(conn.recv(64))

    slow = threading.Thread(target=busy)
    slow.start()
    assert await asyncio.to_thread(sent.wait, 30)
    alone = await a.admit("team-key", ("chat",), 10, clock())
    assert a.degraded and isinstance(alone, Ticket)  # admitted in memory
    alone.release()
    slow.join()
    assert replies == [b"+PONG\r\n", b":1\r\n"], replies
    with redis.Redis.from_url(url) as db:
        assert int(db.get("llmgw:limits:team:inflight") or 0) == 1  # run by Redis, unknown to the router
        clock.now += shared_limits.RETRY_AFTER  # a asks Redis again, as a new instance
        ticket = await a.admit("team-key", ("chat",), 10, clock())
        assert isinstance(ticket, Refusal) and not a.degraded  # the lost grant's slot, held still
        clock.now += shared_limits.LEASE + 1  # past the lease of the instance that asked
        again = await b.admit("team-key", ("chat",), 10, clock())
        assert isinstance(again, SharedTicket), again
        again.release()
        await b.close()
        await a.close()
        assert int(db.get("llmgw:limits:team:inflight") or 0) == 0


# --- issue 24: one clock, and a bug is not an outage -----------------------------------------------

def skewed_router(engine_url: str, url: str, limits: Limits, skew: float) -> Router:
    keys = KeyRing.from_entries([{"name": "team-key", "sha256": hash_key("sk-team"), "models": ["*"]}])
    r = Router(keys=keys, config=RouterConfig(limits_redis=url), wall=lambda: time.time() + skew)
    r.set_catalog(Catalog(models=(model("chat"),), settings=Settings(tenants=(Tenant("team", ("team-key",), limits),))))
    r.set_endpoints([endpoint("chat", engine_url)])
    return r


async def test_a_router_with_a_skewed_clock_cannot_refill_a_shared_limit(chat_sim: SimProcess, redis_url) -> None:  # noqa: ANN001
    """One router 60 s behind the other: each refilled the bucket from its own clock, undoing the
    other's (a 5-a-minute limit admitted 30 of 30 in 9 s). Refills go by Redis's clock."""
    url, _ = redis_url
    async with AsyncExitStack() as stack:
        bases = [await stack.enter_async_context(serving(skewed_router(chat_sim.endpoint, url,
                                                                       Limits(requests_per_minute=5), skew)))
                 for skew in (0.0, -60.0)]
        clients = [openai.AsyncOpenAI(base_url=b + "/v1", api_key="sk-team", max_retries=0, timeout=15) for b in bases]
        started = time.monotonic()
        ok = 0
        for i in range(30):
            try:
                await clients[i % 2].chat.completions.create(model="chat", messages=MESSAGES, max_tokens=1)
                ok += 1
            except openai.RateLimitError:
                pass
        elapsed = time.monotonic() - started
        for c in clients:
            await c.close()
    assert ok <= 5 + int(elapsed * 5 / 60), (ok, elapsed)  # the burst, and what refilled meanwhile


async def test_a_router_a_day_behind_spends_the_same_budget_period(chat_sim: SimProcess, redis_url) -> None:  # noqa: ANN001
    """Budget periods are named by Redis's clock too: a router whose clock is a day behind would
    otherwise count yesterday's budget, untouched, and hand the tenant a fresh one."""
    url, _ = redis_url
    async with AsyncExitStack() as stack:
        bases = [await stack.enter_async_context(serving(skewed_router(
            chat_sim.endpoint, url, Limits(budget=Budget(tokens=200, per="day")), skew))) for skew in (0.0, -86_400.0)]
        right, behind = (openai.AsyncOpenAI(base_url=b + "/v1", api_key="sk-team", max_retries=0, timeout=15)
                         for b in bases)
        with pytest.raises(openai.RateLimitError):
            for _ in range(50):
                await right.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=20)
        with pytest.raises(openai.RateLimitError) as refused:
            await behind.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=20)
        assert "budget" in refused.value.message
        await right.close()
        await behind.close()


async def test_a_script_error_is_refused_loudly_not_taken_for_redis_away(chat_sim: SimProcess, redis_url,  # noqa: ANN001
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    """A key of the wrong type makes the script fail (as a bug would): every router treating that
    as "Redis is down" would admit the whole limit on its own, N routers N times the limit. It is
    a 503 naming the cause, logged with its traceback and counted; not degraded mode."""
    import redis

    url, _ = redis_url
    with redis.Redis.from_url(url) as db:
        db.set("llmgw:limits:team:rpm", "not a bucket")
    before = sim_metric(chat_sim.endpoint, "llmgw_sim_requests_total")
    async with AsyncExitStack() as stack:
        bases = [await stack.enter_async_context(serving(router(chat_sim, url, Limits(requests_per_minute=30))))
                 for _ in range(2)]
        statuses = []
        for i in range(6):
            async with openai.AsyncOpenAI(base_url=bases[i % 2] + "/v1", api_key="sk-team", max_retries=0,
                                          timeout=15) as c:
                try:
                    await c.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=1)
                    statuses.append(200)
                except openai.APIStatusError as exc:
                    statuses.append(exc.status_code)
                    assert exc.code == "limits_unavailable" and "could not be checked" in exc.message
        assert statuses == [503] * 6
        assert await metric(bases[0], "llmgw_router_limits_degraded") == 0
        assert await metric(bases[0], 'llmgw_router_limits_errors_total{error="ResponseError"}') == 3
    assert sim_metric(chat_sim.endpoint, "llmgw_sim_requests_total") == before  # none reached the engine
    assert "not for want of Redis" in caplog.text and "Traceback" in caplog.text and "WRONGTYPE" in caplog.text
    assert "degraded mode" not in caplog.text


async def test_a_reply_the_router_does_not_understand_is_not_read_as_a_grant(redis_url, monkeypatch) -> None:  # noqa: ANN001
    from llmgw.tenancy import shared as shared_limits

    url, _ = redis_url
    limiter = Limiter((Tenant("team", ("team-key",), Limits(requests_per_minute=100)),))
    monkeypatch.setattr(shared_limits, "_STEPS", "return '{\"t\": 1, \"r\": [[0, [[5, 0]]]]}'")
    shared = SharedLimits(url, limiter=limiter)
    got = await shared.admit("team-key", ("chat",), 1, time.time())
    assert isinstance(got, Refusal) and got.unavailable and not shared.degraded
    monkeypatch.setattr(shared_limits, "_STEPS", "return 'not json'")
    shared2 = SharedLimits(url, limiter=limiter)
    got = await shared2.admit("team-key", ("chat",), 1, time.time())
    assert isinstance(got, Refusal) and got.unavailable and not shared2.degraded
    await shared.close()
    await shared2.close()


async def test_a_tenant_redis_refused_is_refused_before_its_next_body_is_read(chat_sim: SimProcess, redis_url) -> None:  # noqa: ANN001
    """Cheap refusals with shared limits: what Redis refused a tenant is answered again, for as
    long as the refusal said (at most a second; a budget spent to the last token, a minute),
    before the body of its next request is read. A router Redis has not refused yet asks."""
    from tests.router.test_limits import half_a_body

    url, _ = redis_url
    async with AsyncExitStack() as stack:
        bases = [await stack.enter_async_context(serving(router(chat_sim, url, Limits(requests_per_minute=2))))
                 for _ in range(2)]
        async with openai.AsyncOpenAI(base_url=bases[0] + "/v1", api_key="sk-team", max_retries=0, timeout=15) as c:
            for _ in range(2):
                await c.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=1)
            with pytest.raises(openai.RateLimitError):
                await c.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=1)
        assert await half_a_body(bases[0], "sk-team", 30_000_000, wait=10) == (True, 429)
        assert await half_a_body(bases[1], "sk-team", 2_000, wait=0.3) == (False, 429)  # read, then asked
        assert await half_a_body(bases[1], "sk-team", 30_000_000, wait=10) == (True, 429)


@pytest.mark.parametrize("shared", [False, True])
async def test_a_small_request_that_fits_is_not_refused_for_a_big_ones_sake(chat_sim: SimProcess, redis_url,  # noqa: ANN001
                                                                            shared: bool) -> None:
    """Review 2: the pre-body check replayed Redis's last refusal whatever the next request's
    size: a 600-token request refused for tokens per minute made the next 5-token one, which
    fits the ~400 left, a 429 with the big one's Retry-After. A refusal for tokens is replayed
    only for requests that reserve at least as much (in memory as with Redis)."""
    limits = Limits(tokens_per_minute=1_000)
    r = router(chat_sim, redis_url[0], limits) if shared else router_at(chat_sim.endpoint, "", limits)
    async with serving(r) as base, openai.AsyncOpenAI(base_url=base + "/v1", api_key="sk-team",
                                                      max_retries=0, timeout=15) as c:
        await c.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=600)
        with pytest.raises(openai.RateLimitError):
            await c.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=600)
        small = await c.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=5)
        assert small.choices[0].message.content


async def test_a_router_that_starts_while_redis_is_away_grants_no_budget_until_it_answers(redis_url) -> None:  # noqa: ANN001
    """Issue 39: each restart while Redis was away took a fresh share of what was left (four
    restarts: 8,576 tokens served of a 6,000 budget). A router that has not reached Redis since it
    started grants no budget; rates and concurrency it limits alone, as in degraded mode."""
    url, proc = redis_url
    budget = Budget(tokens=6000, per="day")
    tenants = (Tenant("team", ("team-key",), Limits(budget=budget)),
               Tenant("rated", ("rated-key",), Limits(requests_per_minute=100)))
    proc.kill()
    proc.wait(10)
    for _ in range(3):  # the same router, started again and again while Redis is away
        limiter = Limiter(tenants)
        limiter.set_spent({}, routers=3)
        fresh = SharedLimits(url, limiter=limiter)
        got = await fresh.admit("team-key", ("chat",), 10, time.time())
        assert isinstance(got, Refusal) and "started while the routers cannot share limits" in got.message, got
        rated = await fresh.admit("rated-key", ("chat",), 10, time.time())
        assert isinstance(rated, Ticket), rated  # a limit that is no budget: applied alone
        rated.release()
        await fresh.close()
