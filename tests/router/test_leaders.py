"""A router given several controllers follows whichever leads (DESIGN §5, issue 36).

Real HTTP all the way: aiohttp servers stand in for the controllers, each the real FeedHub behind
the admin token, leading or answering as a standby (503 naming the leader, ``llmgw.contract``),
the leading ones sharing one real store for the usage ledger; a dead controller is a port nobody
listens on. Every wait is for an event (a watch attempt, a stream opened, a batch acknowledged),
bounded only against a hang, and the bounds asserted are counts of attempts, never times.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from llmgw.adminaccess import resolve_each
from llmgw.catalog.model import Catalog
from llmgw.contract import REPORT_PATH, STANDBY_STATUS, WATCH_PATH, standby_answer
from llmgw.control.feed import FeedHub
from llmgw.engines.testing import SimProcess, free_port
from llmgw.errors import AccessError
from llmgw.router import FeedClient, Router, RouterConfig
from llmgw.router.follow import standby_leader
from llmgw.router.leader import STANDBY_ROUND_MAX, STEP_WAIT, Leadership, Outcome
from llmgw.router.main import build_parser
from llmgw.state import Store
from tests.router.conftest import TOKEN, Proc, client, endpoint, fake_controller, serving, write_state
from tests.router.fake_controller import model
from tests.router.test_feed import until

CATALOG = Catalog(models=(model("chat"),))
HELLO = [{"role": "user", "content": "hi"}]
HANG = 60.0  # the bound on a wait for an event: a hang, not the machine's speed


class Stand:
    """One controller: the real FeedHub behind the admin token, leading (``leading``) or standing
    by and naming ``leader``; counts its watch requests and keeps the usage batches reported to it."""

    def __init__(self, chat_url: str, ledger: Store, name: str, *, skew: float = 0.0) -> None:
        self.name = name
        # ``skew``: this controller's clock, which its list versions start from, is that far off.
        self.hub = FeedHub(keepalive=0.2, clock=lambda: time.time() + skew)
        self.hub.set_catalog(CATALOG)
        self.hub.set_endpoints([endpoint("chat", chat_url)])
        self.hub.ledger = ledger
        self.leading = False
        self.leader: str | None = None
        self.watches = 0
        self.standby_answers = 0
        self.batches: list[tuple[str, int]] = []  # (instance, seq) of every batch that reached it
        self.applied: list[int | None] = []  # the applied_version of every report
        self.die_after_recording = False  # crash between the store's commit and the answer
        self.runner: web.AppRunner | None = None
        self.url = ""

    def app(self) -> web.Application:
        @web.middleware
        async def check_token(request: web.Request,
                              handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
            if request.headers.get("Authorization") != f"Bearer {TOKEN}":
                return web.json_response({"error": {"message": "bad admin token"}}, status=401)
            return await handler(request)

        async def watch(request: web.Request) -> web.StreamResponse:
            self.watches += 1
            if not self.leading:
                self.standby_answers += 1
                return web.json_response(standby_answer(self.leader), status=STANDBY_STATUS)
            return await self.hub.watch(request)

        async def report(request: web.Request) -> web.StreamResponse:
            body = json.loads(await request.read())
            usage = body.get("usage")
            self.applied.append(body.get("applied_version"))
            if usage is not None:
                self.batches.append((usage["instance"], usage["seq"]))
            if not self.leading:
                return web.json_response(standby_answer(self.leader), status=STANDBY_STATUS)
            answer = await self.hub.report(request)
            if usage is not None and self.die_after_recording:
                # The store has the batch; the process dies before its answer leaves.
                asyncio.get_running_loop().create_task(self.kill())
                await asyncio.Event().wait()  # cancelled by the shutdown: no answer is sent
            return answer

        app = web.Application(middlewares=[check_token])
        app.router.add_get(WATCH_PATH, watch)
        app.router.add_post(REPORT_PATH, report)
        return app

    async def start(self) -> Stand:
        self.runner = web.AppRunner(self.app(), access_log=None, shutdown_timeout=0.1)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self

    async def kill(self) -> None:
        """Gone at once: listener closed, open streams cut."""
        if self.runner is not None:
            runner, self.runner = self.runner, None
            await runner.cleanup()

    def lead(self) -> None:
        self.leading, self.leader = True, self.url


@asynccontextmanager
async def stands(chat_url: str, tmp_path: Path, *names: str) -> AsyncIterator[tuple[Store, list[Stand]]]:
    """Controllers sharing one store, none leading yet; each one's clock an hour behind the one before."""
    store = Store(tmp_path / "shared.db").open()
    started = [await Stand(chat_url, store, n, skew=-3600.0 * i).start() for i, n in enumerate(names)]
    try:
        yield store, started
    finally:
        for s in started:
            await s.kill()
        store.close()


@asynccontextmanager
async def following(router: Router, urls: list[str]) -> AsyncIterator[FeedClient]:
    feed = FeedClient(router, urls, TOKEN, router_id="r1", report_interval=0.2, backoff_max=0.5)
    router.wake = feed.report_soon
    await feed.start()
    try:
        yield feed
    finally:
        await feed.close()


def dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nobody listens there


async def metrics(base: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    async with aiohttp.ClientSession() as s, s.get(base + "/metrics") as resp:
        text = await resp.text()
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


# --- over HTTP --------------------------------------------------------------------------------

async def test_a_standby_names_the_leader_and_the_router_goes_straight_there(chat_sim: SimProcess,
                                                                              tmp_path: Path) -> None:
    async with stands(chat_sim.endpoint, tmp_path, "a", "b") as (_, (a, b)):
        a.lead()
        b.leader = a.url + "/"  # spelled a little differently from the router's list: the same controller
        router = Router()
        # b first, a dead one second: b's hint takes the router to a without trying the dead one.
        async with following(router, [b.url, dead_url(), a.url]) as feed, serving(router) as base:
            await until(lambda: feed.connected and router.table.has("chat"), HANG)
            assert feed.controller == a.url and feed.attempts == 2
            assert (b.watches, a.watches) == (1, 1) and feed.leader_switches == 0
            async with client(base) as c:
                assert (await c.chat.completions.create(model="chat", messages=HELLO)).choices
            m = await metrics(base)
            assert m["llmgw_router_controller_following"] == {(("controller", "1"),): 0.0,
                                                             (("controller", "2"),): 0.0,
                                                             (("controller", "3"),): 1.0}
            assert m["llmgw_router_leader_switches_total"] == {(): 0.0}


async def test_the_leader_dies_mid_stream_and_the_router_follows_the_next_one(chat_sim: SimProcess,
                                                                             tmp_path: Path) -> None:
    async with stands(chat_sim.endpoint, tmp_path, "a", "b") as (store, (a, b)):
        a.lead()
        b.leader = a.url
        router = Router(config=RouterConfig(hold_timeout=5))
        async with following(router, [a.url, b.url, dead_url()]) as feed, serving(router) as base, \
                client(base) as c:
            await until(lambda: feed.connected and router.table.has("chat"), HANG)
            assert feed.controller == a.url and b.watches == 0
            await a.kill()
            # Until its lease runs out, the standby still names the dead leader: the router goes on
            # looking (and serving from the last snapshot) without going back and forth for ever.
            await until(lambda: b.standby_answers >= 3, HANG)
            for _ in range(3):
                assert (await c.chat.completions.create(model="chat", messages=HELLO)).choices
            attempts = feed.attempts
            b.lead()
            await until(lambda: feed.connected, HANG)
            assert feed.controller == b.url and feed.leader_switches == 1
            # Dead a, dead third, at most once each per round, then b: within two rounds.
            assert feed.attempts - attempts <= 2 * len(feed.controllers)
            # a's list numbers (an hour ahead of b's) mean nothing to b: until the router has b's
            # list it says it serves from one b did not send (0), not that it is ahead of b's.
            await until(lambda: b.applied and b.applied[-1] == b.hub.version, HANG)
            assert set(b.applied) <= {0, b.hub.version} and a.hub.version > b.hub.version
            # The usage of the requests served meanwhile reaches the new leader's store, once.
            await until(lambda: router.usage.outbox.pending == 0, HANG)
            assert store.usage(0, 2 ** 40, by=())[0]["requests"] == 3
            m = await metrics(base)
            assert m["llmgw_router_controller_following"][(("controller", "2"),)] == 1.0
            assert m["llmgw_router_leader_switches_total"] == {(): 1.0}


async def test_a_leader_named_outside_the_list_is_never_contacted(chat_sim: SimProcess, tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    seen: list[str | None] = []

    async def trap(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization"))
        return web.json_response({})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", trap)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    elsewhere = f"http://127.0.0.1:{runner.addresses[0][1]}"
    caplog.set_level(logging.WARNING, logger="llmgw.router.follow")
    try:
        async with stands(chat_sim.endpoint, tmp_path, "a", "b") as (_, (a, b)):
            b.leader = elsewhere  # a wrong (or hostile) hint
            router = Router()
            async with following(router, [b.url, a.url]) as feed:
                await until(lambda: b.standby_answers >= 2 and a.standby_answers >= 2, HANG)
                a.lead()
                await until(lambda: feed.connected, HANG)
                assert feed.controller == a.url
            assert seen == []
            said = [r.getMessage() for r in caplog.records if "not contacting it" in r.getMessage()]
            assert len(said) == 1 and elsewhere in said[0]  # said once, not per attempt
    finally:
        await runner.cleanup()


async def test_a_batch_the_dead_leader_recorded_but_never_acknowledged_is_counted_once(
        chat_sim: SimProcess, tmp_path: Path) -> None:
    async with stands(chat_sim.endpoint, tmp_path, "a", "b") as (store, (a, b)):
        a.lead()
        a.die_after_recording = True
        b.leader = a.url
        router = Router()
        async with following(router, [a.url, b.url]) as feed, serving(router) as base, client(base) as c:
            await until(lambda: feed.connected and router.table.has("chat"), HANG)
            answer = await c.chat.completions.create(model="chat", messages=HELLO)
            assert answer.usage is not None
            await until(lambda: a.batches and a.runner is None, HANG)  # recorded, then died unanswered
            assert router.usage.outbox.pending > 0  # kept: no answer said the store has it
            sent = a.batches[0]
            await until(lambda: b.batches, HANG)  # sent to b while it stands by: kept again
            b.lead()
            await until(lambda: router.usage.outbox.pending == 0, HANG)
            assert b.batches[-1] == sent  # the same router instance and batch number
            await until(lambda: feed.connected, HANG)  # the report may have reached b before the watch
            assert feed.controller == b.url and feed.leader_switches == 1
        totals = store.usage(0, 2 ** 40, by=())[0]
        assert (totals["requests"], totals["prompt_tokens"], totals["completion_tokens"]) == \
            (1, answer.usage.prompt_tokens, answer.usage.completion_tokens)


async def test_a_router_stopping_while_its_leader_is_away_hands_its_usage_to_the_one_that_leads(
        chat_sim: SimProcess, tmp_path: Path) -> None:
    async with stands(chat_sim.endpoint, tmp_path, "a", "b") as (store, (a, b)):
        a.lead()
        b.leader = a.url
        router = Router()
        # Reports only when the watch connects: the usage below goes out with the stop, not before.
        feed = FeedClient(router, [a.url, b.url], TOKEN, router_id="r1", report_interval=3600, backoff_max=0.5)
        async with serving(router) as base:
            await feed.start()
            try:
                await until(lambda: feed.connected and router.table.has("chat"), HANG)
                await a.kill()
                await until(lambda: b.standby_answers >= 1, HANG)
                async with client(base) as c:
                    assert (await c.chat.completions.create(model="chat", messages=HELLO)).choices
                await router.drain()
                assert router.usage.outbox.pending > 0 and not b.batches
            finally:
                b.lead()  # leads now; with no await before the stop, the router has not found out
                await feed.close()
        assert router.usage.outbox.pending == 0 and len(b.batches) == 1
        assert store.usage(0, 2 ** 40, by=())[0]["requests"] == 1


# --- the choice of the next controller, pure -----------------------------------------------------

class Even(random.Random):
    """Jitter factor 1: every wait as planned."""

    def random(self) -> float:
        return 0.5


A, B, C = "http://ctl-a:9090", "http://ctl-b:9090", "http://ctl-c:9090"


def test_a_named_leader_in_the_list_is_tried_at_once_and_one_outside_is_not() -> None:
    lead = Leadership([A, B, C], rng=Even())
    step = lead.after(Outcome.STANDBY, hint="HTTP://CTL-C:9090/")
    assert (step.url, step.wait, step.ignored_hint) == (C, 0.0, None)
    step = lead.after(Outcome.STANDBY, hint="http://ctl-c.evil:9090")
    assert step.url == B and step.ignored_hint == "http://ctl-c.evil:9090" and step.wait == STEP_WAIT


def test_standbys_naming_each_other_cannot_keep_the_router_going_round() -> None:
    lead = Leadership([A, B], rng=Even(), backoff_max=10)
    assert lead.after(Outcome.STANDBY, hint=B).url == B
    step = lead.after(Outcome.STANDBY, hint=A)  # a was tried in this round: a round's wait first
    assert step.wait == 0.25
    for _ in range(10):
        lead.after(Outcome.STANDBY, hint=B)
        step = lead.after(Outcome.STANDBY, hint=A)
        assert 0 < step.wait <= STANDBY_ROUND_MAX  # a handover under way: never backoff_max


def test_nobody_answering_backs_off_per_round_up_to_the_cap_and_a_stream_resets_it() -> None:
    lead = Leadership([A, B, C], rng=Even(), backoff_max=2)
    waits = [lead.after(Outcome.FAILED).wait for _ in range(12)]
    assert waits == [STEP_WAIT, STEP_WAIT, 0.25, STEP_WAIT, STEP_WAIT, 0.5, STEP_WAIT, STEP_WAIT, 1.0,
                     STEP_WAIT, STEP_WAIT, 2.0]
    assert lead.connected() is None and lead.switches == 0  # the first stream is no switch
    followed = lead.url
    step = lead.after(Outcome.FOLLOWED)
    assert step.url != followed and step.wait == 0.25  # the next controller, soon
    assert lead.connected() == followed and lead.switches == 1
    lead.after(Outcome.FOLLOWED)
    lead.after(Outcome.FAILED)
    lead.after(Outcome.STANDBY, hint=step.url)
    assert lead.connected() is None and lead.switches == 1  # back to the same one: no switch


def test_one_controller_backs_off_as_a_router_always_did() -> None:
    lead = Leadership([A + "/"], rng=Even(), backoff_max=1)
    assert lead.controllers == (A,)
    assert [lead.after(Outcome.FAILED).wait for _ in range(4)] == [0.25, 0.5, 1.0, 1.0]
    assert all(lead.after(Outcome.FAILED).url == A for _ in range(3))


@pytest.mark.parametrize(("status", "body", "expected"), [
    (503, json.dumps(standby_answer(B)).encode(), (True, B)),
    (503, json.dumps(standby_answer(None)).encode(), (True, None)),
    (503, json.dumps(standby_answer("file:///etc/passwd")).encode(), (True, None)),
    (503, b'{"error": {"message": "overloaded", "type": "server_error"}}', (False, None)),
    (503, b"<html>bad gateway</html>", (False, None)),
    (503, b"\xff\xfe", (False, None)),
    (401, json.dumps(standby_answer(B)).encode(), (False, None)),
])
def test_what_counts_as_a_standby_answer(status: int, body: bytes, expected: tuple[bool, str | None]) -> None:
    assert standby_leader(status, body) == expected


# --- the command line -----------------------------------------------------------------------------

@pytest.mark.slow
async def test_the_router_process_follows_the_live_one_of_its_controllers(chat_sim: SimProcess,
                                                                           tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    write_state(state, [{"name": "chat"}], [endpoint("chat", chat_sim.endpoint)])
    ctl = fake_controller(tmp_path, state).start("/test/usage")
    port = free_port()
    router = Proc("llmgw.router.main", "--url", dead_url(), "--url", ctl.url, "--token", TOKEN,
                  "--listen", f"127.0.0.1:{port}", "--report-interval", "0.5", port=port,
                  log=tmp_path / "router.log")
    try:
        router.start("/v1/models")
        await until(lambda: (tmp_path / "router.log").read_text().count(f"following {ctl.url}") == 1, HANG)
        m = await metrics(router.url)
        assert m["llmgw_router_controller_following"] == {(("controller", "1"),): 0.0, (("controller", "2"),): 1.0}
        async with client(router.url) as c:
            assert (await c.chat.completions.create(model="chat", messages=HELLO)).choices
    finally:
        router.stop()
        ctl.stop()
    log = (tmp_path / "router.log").read_text()
    assert TOKEN not in log



def test_the_router_takes_every_controller_comma_separated_or_repeated() -> None:
    args = build_parser().parse_args(["--url", f"{A},{B}", "--controller", C, "--url", A + "/", "--token", "t"])
    assert args.url == f"{A},{B},{C},{A}/"
    accesses = resolve_each(args.url, args.token, None, env={})
    assert [a.url for a in accesses] == [A, B, C] and {a.token for a in accesses} == {"t"}
    args = build_parser().parse_args(["--controller", A, "--admin-token", "t"])  # the older spelling
    assert [a.url for a in resolve_each(args.url, args.token, None, env={})] == [A]
    only_env_token: dict[str, Any] = {"LLMGW_ADMIN_TOKEN": "e"}
    assert [a.token for a in resolve_each(f"{A},{B}", None, None, env=only_env_token)] == ["e", "e"]
    # A token that came with an address of its own is not sent to the others.
    with pytest.raises(AccessError, match="is not sent there"):
        resolve_each(f"{A},{B}", None, None, env={"LLMGW_ADMIN_URL": A, "LLMGW_ADMIN_TOKEN": "e"})
    with pytest.raises(AccessError, match="names no address"):
        resolve_each(",", "t", None, env={})
