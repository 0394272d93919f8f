"""Tenants' limits (issue 18): the pure limiter with an injected clock, and the router answering
429 in OpenAI's format to the real openai client, whose own retry honours it."""

from __future__ import annotations

import asyncio
import contextlib
from datetime import UTC, datetime

import openai
import pytest

from llmgw.catalog.model import Budget, Catalog, Limits, Settings, Tenant
from llmgw.contract import catalog_view
from llmgw.engines.testing import SimProcess
from llmgw.router import KeyRing, Router, RouterConfig, catalog_from_view, hash_key
from llmgw.tenancy.memory import Limiter, Ticket
from llmgw.tenancy.rules import Refusal, duration, next_period, period_start
from tests.router.conftest import endpoint, serving, sim_metric
from tests.router.fake_controller import model
from tests.router.test_feed import until

try:  # the HTTP client the installed openai SDK is built on (httpx2 in its newer releases)
    import httpx2 as httpx
except ImportError:  # pragma: no cover - older openai releases
    import httpx  # type: ignore[no-redef]

MESSAGES = [{"role": "user", "content": "Hello"}]


def at(text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()


def limiter(**limits: object) -> Limiter:
    return Limiter([Tenant("team", ("k",), Limits(**limits))])  # type: ignore[arg-type]


# --- the pure limiter ---------------------------------------------------------------------------

def test_requests_per_minute_refill_continuously() -> None:
    lim = limiter(requests_per_minute=60)
    now = 1000.0
    tickets = [lim.admit("k", ("m",), 0, now) for _ in range(60)]
    assert all(isinstance(t, Ticket) for t in tickets)
    refused = lim.admit("k", ("m",), 0, now)
    assert isinstance(refused, Refusal) and "60 requests per minute" in refused.message
    assert refused.retry_after == pytest.approx(1.0)
    assert refused.headers["x-ratelimit-limit-requests"] == "60"
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert isinstance(lim.admit("k", ("m",), 0, now + 1.0), Ticket)  # one a second comes back
    assert lim.admit("other-key", ("m",), 0, now) is None  # a key in no tenant is not limited


def test_concurrency_counts_requests_in_flight() -> None:
    lim = limiter(concurrent=2)
    a, b = lim.admit("k", ("m",), 0, 0.0), lim.admit("k", ("m",), 0, 0.0)
    assert isinstance(a, Ticket) and isinstance(b, Ticket)
    assert isinstance(lim.admit("k", ("m",), 0, 0.0), Refusal)
    a.release()
    a.release()  # at most once
    assert isinstance(lim.admit("k", ("m",), 0, 0.0), Ticket)
    assert isinstance(lim.admit("k", ("m",), 0, 0.0), Refusal)


def test_tokens_are_reserved_then_settled_so_concurrent_requests_cannot_overshoot_the_budget() -> None:
    lim = limiter(budget=Budget(tokens=1000, per="day"))
    now = at("2026-12-03T12:00:00")
    running = []
    while isinstance(t := lim.admit("k", ("m",), 300, now), Ticket):
        running.append(t)
    assert len(running) == 3  # 3 × 300 reserved; a fourth would pass 1,000
    for t in running:  # each really used 310: 10 over its reservation
        t.settle(310)
        t.release()
    assert lim._scopes[("team", "")].used == 930  # at most one reservation's worth over, never more
    refused = lim.admit("k", ("m",), 300, now)
    assert isinstance(refused, Refusal)
    assert "used 930 of its 1000-token budget per day" in refused.message
    assert "resets at 2026-12-04 00:00 UTC" in refused.message
    # Settled below the reservation: the rest is given back.
    small = lim.admit("k", ("m",), 50, now)
    assert isinstance(small, Ticket)
    small.settle(5)
    small.release()
    assert lim._scopes[("team", "")].used == 935


def test_the_budget_resets_at_the_period_boundary_in_utc() -> None:
    lim = limiter(budget=Budget(tokens=100, per="day", reset="06:00"))
    before = at("2026-12-04T05:59:00")
    t = lim.admit("k", ("m",), 100, before)
    assert isinstance(t, Ticket)
    t.settle(100)
    t.release()
    refused = lim.admit("k", ("m",), 1, before)
    assert isinstance(refused, Refusal) and "resets at 2026-12-04 06:00 UTC" in refused.message
    assert refused.retry_after == pytest.approx(60.0)
    assert isinstance(lim.admit("k", ("m",), 1, at("2026-12-04T06:00:00")), Ticket)  # a new day at 06:00
    month = Budget(tokens=1, per="month", reset="00:30")
    assert period_start(month, at("2026-12-01T00:10:00")) == at("2026-11-01T00:30:00")
    assert period_start(month, at("2026-12-15T10:00:00")) == at("2026-12-01T00:30:00")
    assert next_period(month, at("2026-12-15T10:00:00")) == at("2027-01-01T00:30:00")


def test_a_request_must_fit_the_tenant_and_its_model_limits_and_a_refusal_takes_nothing() -> None:
    lim = Limiter([Tenant("team", ("k",), Limits(requests_per_minute=10), (("big", Limits(requests_per_minute=1)),))])
    assert isinstance(lim.admit("k", ("big",), 0, 0.0), Ticket)
    refused = lim.admit("k", ("big",), 0, 0.0)
    assert isinstance(refused, Refusal) and "team/big" in refused.message
    for _ in range(9):  # the refused request took nothing from the tenant-wide bucket
        assert isinstance(lim.admit("k", ("small",), 0, 0.0), Ticket)
    assert isinstance(lim.admit("k", ("small",), 0, 0.0), Refusal)


def test_a_new_catalog_keeps_what_was_used_of_limits_that_did_not_change() -> None:
    old = limiter(requests_per_minute=1)
    assert isinstance(old.admit("k", ("m",), 0, 0.0), Ticket)
    same = limiter(requests_per_minute=1)
    same.carry_over(old)
    assert isinstance(same.admit("k", ("m",), 0, 0.0), Refusal)
    raised = limiter(requests_per_minute=5)
    raised.carry_over(old)
    assert isinstance(raised.admit("k", ("m",), 0, 0.0), Ticket)


def test_durations_are_spelled_as_openai_does() -> None:
    assert [duration(x) for x in (0.02, 1.0, 59.2, 360.0, 7384.0)] == ["20ms", "1s", "1m0s", "6m0s", "2h3m4s"]


def test_tenants_travel_in_the_catalog_view() -> None:
    tenant = Tenant("team", ("k",), Limits(requests_per_minute=5, budget=Budget(9, "month", "01:00")),
                    (("m", Limits(concurrent=2)),))
    view = catalog_view(Catalog(models=(model("m"),), settings=Settings(tenants=(tenant,))))
    assert catalog_from_view(view).tenants == (tenant,)
    view["tenants"][0]["limits"]["concurrent"] = 0
    with pytest.raises(ValueError):
        catalog_from_view(view)


# --- through the router -------------------------------------------------------------------------

def keyed_router(chat_sim: SimProcess, limits: Limits, wall=None) -> Router:  # noqa: ANN001
    keys = KeyRing.from_entries([{"name": "team-key", "sha256": hash_key("sk-team"), "models": ["*"]},
                                 {"name": "free-key", "sha256": hash_key("sk-free"), "models": ["*"]}])
    router = Router(keys=keys, config=RouterConfig(), **({"wall": wall} if wall else {}))
    router.set_catalog(Catalog(models=(model("chat"),), settings=Settings(tenants=(
        Tenant("team", ("team-key",), limits),))))
    router.set_endpoints([endpoint("chat", chat_sim.endpoint)])
    return router


async def test_429_carries_openais_headers_and_the_sdk_retry_honours_them(chat_sim: SimProcess) -> None:
    # The limiter's clock stands still until the SDK has read a 429, then moves one second: the
    # burst of 60 cannot refill while a busy machine serves it (a real clock had let the retried
    # request through at its first try), and the retry is what the clock's step admits.
    clock = [at("2026-12-04T12:00:00")]

    async def step_on_429(response: httpx.Response) -> None:
        if response.status_code == 429:
            clock[0] = at("2026-12-04T12:00:01.01")

    router = keyed_router(chat_sim, Limits(requests_per_minute=60), wall=lambda: clock[0])
    before = sim_metric(chat_sim.endpoint, "llmgw_sim_requests_total")
    async with serving(router) as base:
        plain = openai.AsyncOpenAI(base_url=base + "/v1", api_key="sk-team", max_retries=0, timeout=15)
        for _ in range(60):
            await plain.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=1)
        with pytest.raises(openai.RateLimitError) as refused:
            await plain.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=1)
        r = refused.value.response
        assert r.status_code == 429 and refused.value.code == "rate_limit_exceeded"
        assert r.headers["x-ratelimit-limit-requests"] == "60" and r.headers["x-ratelimit-remaining-requests"] == "0"
        assert r.headers["retry-after"] == "1" and 0 < int(r.headers["retry-after-ms"]) <= 1000
        assert "60 requests per minute" in refused.value.message
        # The SDK's own retry waits what the headers say and then gets through.
        retrying = openai.AsyncOpenAI(base_url=base + "/v1", api_key="sk-team", max_retries=2, timeout=15,
                                      http_client=httpx.AsyncClient(event_hooks={"response": [step_on_429]}))
        answer = await retrying.chat.completions.with_raw_response.create(model="chat", messages=MESSAGES,
                                                                         max_tokens=1)
        assert answer.http_response.status_code == 200 and answer.retries_taken >= 1
        # Another key, in no tenant: not limited.
        free = openai.AsyncOpenAI(base_url=base + "/v1", api_key="sk-free", max_retries=0, timeout=15)
        await free.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=1)
        for c in (plain, retrying, free):
            await c.close()
    # Refused requests never reached the engine: 60 + 1 retried + 1 free.
    assert sim_metric(chat_sim.endpoint, "llmgw_sim_requests_total") - before == 62


async def test_a_spent_budget_says_which_and_when_it_resets(chat_sim: SimProcess) -> None:
    clock = [at("2026-12-03T23:59:00")]
    router = keyed_router(chat_sim, Limits(budget=Budget(tokens=60, per="day")), wall=lambda: clock[0])
    async with serving(router) as base:
        c = openai.AsyncOpenAI(base_url=base + "/v1", api_key="sk-team", max_retries=0, timeout=15)
        used = 0
        with pytest.raises(openai.RateLimitError) as refused:
            for _ in range(10):
                r = await c.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=5)
                used += r.usage.total_tokens
        assert "budget per day" in refused.value.message and "resets at 2026-12-04 00:00 UTC" in refused.value.message
        assert 0 < used <= 60
        # Its own type, and the budget's figures in OpenAI's token headers (seen: "type": "requests",
        # and the request headers only).
        assert (refused.value.type, refused.value.code) == ("budget", "budget_exceeded")
        headers = refused.value.response.headers
        assert headers["x-ratelimit-limit-tokens"] == "60"
        assert 0 <= int(headers["x-ratelimit-remaining-tokens"]) < 60 and headers["x-ratelimit-reset-tokens"] == "1m0s"
        clock[0] = at("2026-12-04T00:00:01")  # the next day
        r = await c.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=5)
        assert r.choices
        await c.close()
        await asyncio.sleep(0)


async def test_a_budget_hours_from_its_reset_tells_the_sdk_not_to_retry(chat_sim: SimProcess) -> None:
    """Retry-After of hours: the openai SDK waits at most a minute, so it would ask again at once,
    max_retries times, for nothing. ``x-should-retry: false`` stops it: one refused request."""
    import aiohttp
    from prometheus_client.parser import text_string_to_metric_families

    clock = [at("2026-12-03T12:00:00")]
    router = keyed_router(chat_sim, Limits(budget=Budget(tokens=60, per="day")), wall=lambda: clock[0])
    async with serving(router) as base:
        c = openai.AsyncOpenAI(base_url=base + "/v1", api_key="sk-team", max_retries=3, timeout=15)
        with pytest.raises(openai.RateLimitError) as refused:
            for _ in range(10):
                await c.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=5)
        await c.close()
        assert "resets at 2026-12-04 00:00 UTC" in refused.value.message
        assert refused.value.response.headers["x-should-retry"] == "false"
        async with aiohttp.ClientSession() as http, http.get(base + "/metrics") as r:
            metrics = await r.text()
    refusals = sum(s.value for f in text_string_to_metric_families(metrics) for s in f.samples
                   if s.name == "llmgw_router_requests_total" and s.labels["status"] == "429")
    assert refusals == 1  # asked once, not 1 + max_retries times


async def test_a_budget_caps_what_a_request_without_max_tokens_may_generate() -> None:
    """Unasked, an engine writes up to its context: a tenant with a budget has the reservation's
    completion sent in every limit field an engine reads; a request that sets its own limit is
    sent with it in every field too, and a key without limits goes as it came."""
    import json

    from tests.router.test_deliveries import engine, write_completion

    async def answer(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await write_completion(w, 1, 1)

    async with engine(answer) as (url, seen):
        keys = KeyRing.from_entries([{"name": "team-key", "sha256": hash_key("sk-team"), "models": ["*"]},
                                     {"name": "free-key", "sha256": hash_key("sk-free"), "models": ["*"]}])
        router = Router(keys=keys, config=RouterConfig())
        router.set_catalog(Catalog(models=(model("chat"),), settings=Settings(tenants=(
            Tenant("team", ("team-key",), Limits(budget=Budget(tokens=100_000, per="day"))),))))
        router.set_endpoints([endpoint("chat", url)])
        async with serving(router) as base:
            team = openai.AsyncOpenAI(base_url=base + "/v1", api_key="sk-team", max_retries=0, timeout=15)
            free = openai.AsyncOpenAI(base_url=base + "/v1", api_key="sk-free", max_retries=0, timeout=15)
            await team.chat.completions.create(model="chat", messages=MESSAGES)
            await team.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=9)
            await team.chat.completions.create(model="chat", messages=MESSAGES, max_completion_tokens=-1)
            await free.chat.completions.create(model="chat", messages=MESSAGES)
            await team.close()
            await free.close()
    sent = [json.loads(r.split(b"\r\n\r\n", 1)[1]) for r in seen]
    assert [(b.get("max_tokens"), b.get("max_completion_tokens")) for b in sent] == [
        (256, 256), (9, 9), (256, 256), (None, None)]
    assert all(b["messages"] == MESSAGES for b in sent)


# --- found in review -------------------------------------------------------------------------------

def test_lowering_a_budget_keeps_what_was_used_and_what_is_in_flight() -> None:
    old = limiter(budget=Budget(tokens=1000, per="day"), concurrent=2)
    now = at("2026-12-03T12:00:00")
    done = old.admit("k", ("m",), 100, now)
    assert isinstance(done, Ticket)
    done.settle(900)
    done.release()
    running = old.admit("k", ("m",), 50, now)
    assert isinstance(running, Ticket)
    lowered = limiter(budget=Budget(tokens=500, per="day"), concurrent=1)
    lowered.carry_over(old)
    refused = lowered.admit("k", ("m",), 1, now)
    assert isinstance(refused, Refusal) and "concurrent: 1" in refused.message
    running.settle(10)
    running.release()  # the ticket admitted under the old catalog releases the scope that goes on
    refused = lowered.admit("k", ("m",), 1, now)
    assert isinstance(refused, Refusal) and "used 910 of its 500-token budget" in refused.message


def test_huge_or_odd_max_tokens_are_read_as_engines_read_them_and_never_overflow() -> None:
    from llmgw.tenancy.asked import MAX_RESERVATION, reservation

    assert reservation({"max_tokens": 10 ** 400}, 0) == MAX_RESERVATION
    assert reservation({"max_tokens": "300"}, 0) == 300 and reservation({"max_tokens": 300.0}, 0) == 300
    assert reservation({"max_completion_tokens": None, "max_tokens": 3000}, 0) == 3000
    assert reservation({"max_tokens": -1}, 0) == 256  # llama.cpp's "unlimited": the default is reserved
    assert reservation({"max_tokens": 10, "n": 5}, 40) == 70  # and a token per 2 bytes of the body
    lim = limiter(tokens_per_minute=1000)
    t = lim.admit("k", ("m",), reservation({"max_tokens": 10 ** 400}, 0), 0.0)
    assert isinstance(t, Ticket)
    refused = lim.admit("k", ("m",), 10, 1.0)  # no OverflowError: a refusal with a finite wait
    assert isinstance(refused, Refusal) and refused.retry_after < float("inf")
    t.settle(5)
    t.release()


def test_a_fallback_must_fit_its_own_model_limits() -> None:
    lim = Limiter([Tenant("team", ("k",), Limits(), (("big", Limits(requests_per_minute=1)),))])
    assert isinstance(lim.admit("k", ("small", "big"), 0, 0.0), Ticket)
    assert isinstance(lim.admit("k", ("small", "big"), 0, 0.0), Refusal)  # big may serve it: big's limit holds
    assert isinstance(lim.admit("k", ("small",), 0, 0.0), Ticket)


def test_a_request_larger_than_the_whole_budget_is_refused_as_such() -> None:
    lim = limiter(budget=Budget(tokens=100, per="day"))
    refused = lim.admit("k", ("m",), 500, 0.0)
    assert isinstance(refused, Refusal) and refused.fits_never and "lower max_tokens" in refused.message
    assert isinstance(lim.admit("k", ("m",), 50, 0.0), Ticket)  # and it took nothing


async def test_the_router_answers_400_for_a_request_no_wait_can_admit(chat_sim: SimProcess) -> None:
    router = keyed_router(chat_sim, Limits(budget=Budget(tokens=100, per="day")))
    async with serving(router) as base:
        c = openai.AsyncOpenAI(base_url=base + "/v1", api_key="sk-team", max_retries=0, timeout=15)
        with pytest.raises(openai.BadRequestError) as refused:
            await c.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=5000)
        assert refused.value.code == "exceeds_budget"
        assert (await c.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=5)).choices
        await c.close()


def test_a_tenant_naming_an_unknown_key_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    keys = KeyRing.from_entries([{"name": "team-key", "sha256": hash_key("sk-team"), "models": ["*"]}])
    router = Router(keys=keys)
    with caplog.at_level("WARNING"):
        router.set_catalog(Catalog(models=(model("chat"),), settings=Settings(tenants=(
            Tenant("team", ("team-key", "tean-key"), Limits(concurrent=1)),))))
    assert "tenant team names API key(s) this router does not have: tean-key (known: team-key)" in caplog.text


def test_an_unknown_tenant_key_is_logged_once_not_at_every_snapshot(caplog: pytest.LogCaptureFixture) -> None:
    keys = KeyRing.from_entries([{"name": "team-key", "sha256": hash_key("sk-team"), "models": ["*"]}])
    router = Router(keys=keys)
    catalog = Catalog(models=(model("chat"),), settings=Settings(tenants=(
        Tenant("team", ("team-key", "tean-key"), Limits(concurrent=1)),)))
    with caplog.at_level("WARNING"):
        for _ in range(3):
            router.set_catalog(catalog)
    assert caplog.text.count("names API key(s) this router does not have") == 1


# --- issue 24: every completion-limit field an engine honours -----------------------------------

def test_a_request_reserves_the_largest_limit_any_engine_reads_and_its_answers() -> None:
    from llmgw.tenancy.asked import BadLimitField, asked_for, capped_fields, reservation

    # vLLM and SGLang: max_completion_tokens or max_tokens (0 falls through); llama.cpp: n_predict first.
    assert reservation({"max_completion_tokens": 1, "max_tokens": 50_000}, 0) == 50_000
    assert reservation({"max_completion_tokens": 0, "max_tokens": 700}, 0) == 700
    assert reservation({"max_tokens": 5, "n_predict": 900}, 0) == 900
    assert reservation({"max_tokens": 10, "n_cmpl": 3}, 0) == 30
    assert reservation({"max_tokens": 10, "best_of": 4}, 0) == 40
    assert reservation({"prompt": ["a", "b", "c"], "max_tokens": 10}, 0) == 30  # a batch: each prompt answered
    assert reservation({"prompt": [[1, 2], [3]], "max_tokens": 10, "n": 2}, 0) == 40
    assert reservation({"prompt": [1, 2, 3], "max_tokens": 10}, 0) == 10  # token ids: one prompt
    for body, field in (({"n": 129}, "n"), ({"best_of": 1000}, "best_of"), ({"n_cmpl": 0}, "n_cmpl"),
                        ({"max_tokens": "lots"}, "max_tokens"), ({"n_predict": True}, "n_predict"),
                        ({"max_completion_tokens": [1]}, "max_completion_tokens")):
        with pytest.raises(BadLimitField) as bad:
            reservation(body, 0)
        assert bad.value.field == field and f"`{field}`" in str(bad.value)
    # A 0 is "unset" to vLLM's ``or``: the default is reserved (and sent), not 0.
    assert reservation({"max_completion_tokens": 0}, 0) == reservation({"n_predict": 0}, 0) == 256
    # What is sent: every field the endpoint's engines read (and any other the body names), as the
    # reserved limit, whatever the body said.
    chat_all = ("max_tokens", "max_completion_tokens", "n_predict")
    assert capped_fields(asked_for({"max_completion_tokens": 1, "max_tokens": 500}), chat=True,
                         cap_unasked=False) == dict.fromkeys(chat_all, 500)
    assert capped_fields(asked_for({"max_tokens": "300"}), chat=True, cap_unasked=False) == dict.fromkeys(chat_all, 300)
    assert capped_fields(asked_for({"max_tokens": 30}), chat=True, cap_unasked=True) == dict.fromkeys(chat_all, 30)
    assert capped_fields(asked_for({"n_predict": 5}), chat=True, cap_unasked=False) == dict.fromkeys(chat_all, 5)
    assert capped_fields(asked_for({"max_completion_tokens": 0}), chat=True,
                         cap_unasked=False) == dict.fromkeys(chat_all, 256)
    assert capped_fields(asked_for({"n_predict": -1}), chat=True, cap_unasked=False) == dict.fromkeys(chat_all, 256)
    assert capped_fields(asked_for({}), chat=True, cap_unasked=True) == dict.fromkeys(chat_all, 256)
    assert capped_fields(asked_for({}), chat=True, cap_unasked=False) is None  # no budget, nothing named
    # Completions: vLLM's and SGLang's read max_tokens alone; a chat-only field named is set too.
    assert capped_fields(asked_for({"n_predict": 1}), chat=False, cap_unasked=False) == {
        "max_tokens": 1, "n_predict": 1}
    assert capped_fields(asked_for({"max_completion_tokens": 1}), chat=False, cap_unasked=False) == {
        "max_tokens": 1, "n_predict": 1, "max_completion_tokens": 1}


async def test_contradictory_limit_fields_cannot_spend_past_a_budget(chat_sim: SimProcess) -> None:
    """The attack of issue 24: ``max_completion_tokens: 1`` reserved 1 while the engine wrote
    ``max_tokens``. Through the real openai client, the simulator writing the most any engine
    would: what it generated stays within the budget, and a request bigger than the budget, or
    with more answers than the bound, is refused up front naming the field."""
    budget = 2_000
    router = keyed_router(chat_sim, Limits(budget=Budget(tokens=budget, per="day")))
    before = sim_metric(chat_sim.endpoint, "vllm:generation_tokens_total")
    async with serving(router) as base:
        c = openai.AsyncOpenAI(base_url=base + "/v1", api_key="sk-team", max_retries=0, timeout=15)
        with pytest.raises(openai.BadRequestError) as refused:
            await c.chat.completions.create(model="chat", messages=MESSAGES, max_completion_tokens=1,
                                            max_tokens=50_000)
        assert refused.value.code == "exceeds_budget" and "reserves 500" in refused.value.message
        with pytest.raises(openai.BadRequestError) as refused:
            await c.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=1, n=129)
        assert refused.value.code == "invalid_value" and "`n`" in refused.value.message
        served = 0
        with pytest.raises(openai.RateLimitError):
            for i in range(10):
                extra = {"max_tokens": 1_200}
                if i % 2:  # a stream, the same way
                    s = await c.chat.completions.create(model="chat", messages=MESSAGES, max_completion_tokens=0,
                                                        stream=True, stream_options={"include_usage": True},
                                                        extra_body=extra)
                    async for chunk in s:
                        served += chunk.usage.completion_tokens if chunk.usage else 0
                else:
                    r = await c.chat.completions.create(model="chat", messages=MESSAGES, max_completion_tokens=1,
                                                        extra_body=extra)
                    served += r.usage.completion_tokens
        await c.close()
    generated = sim_metric(chat_sim.endpoint, "vllm:generation_tokens_total") - before
    assert served == generated == 1_200  # one request: a second would have gone past the budget
    assert generated <= budget


async def test_every_limit_field_is_sent_as_the_reserved_limit() -> None:
    import json

    from tests.router.test_deliveries import engine, write_completion

    async def answer(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await write_completion(w, 1, 1)

    async with engine(answer) as (url, seen):
        keys = KeyRing.from_entries([{"name": "team-key", "sha256": hash_key("sk-team"), "models": ["*"]}])
        router = Router(keys=keys, config=RouterConfig())
        router.set_catalog(Catalog(models=(model("chat"),), settings=Settings(tenants=(
            Tenant("team", ("team-key",), Limits(tokens_per_minute=1_000_000)),))))
        router.set_endpoints([endpoint("chat", url)])
        async with serving(router) as base:
            team = openai.AsyncOpenAI(base_url=base + "/v1", api_key="sk-team", max_retries=0, timeout=15)
            await team.chat.completions.create(model="chat", messages=MESSAGES, max_completion_tokens=1,
                                               extra_body={"max_tokens": 50, "n_predict": 9})
            await team.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=7)
            await team.close()
    sent = [json.loads(r.split(b"\r\n\r\n", 1)[1]) for r in seen]
    assert [(b.get("max_completion_tokens"), b.get("max_tokens"), b.get("n_predict")) for b in sent] == [
        (50, 50, 50), (7, 7, 7)]


# How each engine reads the completion limit of a body (None: it writes up to its context).
def vllm_chat_limit(body: dict) -> int | None:
    return body.get("max_completion_tokens") or body.get("max_tokens")  # SGLang's chat alike


def vllm_completions_limit(body: dict) -> int:
    return body.get("max_tokens", 16)  # vLLM's CompletionRequest default; other fields unread


def llama_limit(body: dict) -> int | None:
    for f in ("n_predict", "max_completion_tokens", "max_tokens"):
        if body.get(f) is not None:
            return None if body[f] < 0 else body[f]
    return None


@pytest.mark.parametrize(("path", "extra"), [
    ("/v1/chat/completions", {"max_completion_tokens": 0}),
    ("/v1/chat/completions", {"n_predict": 5}),
    ("/v1/chat/completions", {"n_predict": 0}),
    ("/v1/chat/completions", {"max_tokens": 0, "n_predict": -1}),
    ("/v1/chat/completions", {}),
    ("/v1/completions", {"max_completion_tokens": 1}),
    ("/v1/completions", {"n_predict": 1}),
    ("/v1/completions", {"max_tokens": 0}),
])
async def test_no_engine_reads_a_limit_past_what_was_reserved(path: str, extra: dict) -> None:
    """Review 2: fields vLLM does not read (``n_predict``; ``max_completion_tokens`` on
    completions) or reads as unset (a 0) were reserved as the limit, and vLLM wrote up to its
    context. Whatever the body, every engine's rule finds the reserved limit in what is sent."""
    import json

    import aiohttp

    from tests.router.test_deliveries import engine, write_completion

    async def answer(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await write_completion(w, 1, 1)

    budget = 1_000
    async with engine(answer) as (url, seen):
        keys = KeyRing.from_entries([{"name": "team-key", "sha256": hash_key("sk-team"), "models": ["*"]}])
        router = Router(keys=keys, config=RouterConfig())
        router.set_catalog(Catalog(models=(model("chat"),), settings=Settings(tenants=(
            Tenant("team", ("team-key",), Limits(budget=Budget(tokens=budget, per="day"))),))))
        router.set_endpoints([endpoint("chat", url)])
        prompt = {"messages": MESSAGES} if path.endswith("chat/completions") else {"prompt": "hi"}
        async with serving(router) as base, aiohttp.ClientSession() as s, s.post(
                base + path, json={"model": "chat", **prompt, **extra},
                headers={"Authorization": "Bearer sk-team"}) as r:
            assert r.status == 200, await r.text()
    sent = json.loads(seen[0].split(b"\r\n\r\n", 1)[1])
    named = [v for v in extra.values() if v > 0]
    reserved = max(named) if named else 256
    limits = [llama_limit(sent)]
    limits.append(vllm_chat_limit(sent) if path.endswith("chat/completions") else vllm_completions_limit(sent))
    assert limits == [reserved, reserved], sent


# --- issue 24: cheap refusals first ---------------------------------------------------------------

async def half_a_body(base: str, key: str, length: int, *, wait: float) -> tuple[bool, int]:
    """POST headers announcing a valid ``length``-byte body and only its first half. An answer
    within ``wait`` came without the body being read (or parsed): (True, its status). Otherwise
    the rest is sent, and the answer to the whole request is (False, its status)."""
    import json
    from urllib.parse import urlsplit

    u = urlsplit(base)
    head = json.dumps({"model": "chat", "messages": MESSAGES, "max_tokens": 1, "pad": ""})[:-2]
    body = (head + " " * (length - len(head) - 2) + '"}').encode()
    assert len(body) == length
    reader, writer = await asyncio.open_connection(u.hostname, u.port)
    writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {u.netloc}\r\nAuthorization: Bearer {key}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n".encode()
                 + body[:length // 2])
    await writer.drain()
    try:
        try:
            async with asyncio.timeout(wait):
                return True, int((await reader.readline()).split()[1])
        except TimeoutError:
            writer.write(body[length // 2:])
            async with asyncio.timeout(30):
                return False, int((await reader.readline()).split()[1])
    finally:
        writer.close()


async def test_a_tenant_over_its_limits_is_refused_before_its_body_is_read(chat_sim: SimProcess) -> None:
    router = keyed_router(chat_sim, Limits(requests_per_minute=3, budget=Budget(tokens=100_000_000, per="day")))
    async with serving(router) as base:
        assert await half_a_body(base, "sk-team", 2_000, wait=0.3) == (False, 200)  # within limits: read
        c = openai.AsyncOpenAI(base_url=base + "/v1", api_key="sk-team", max_retries=0, timeout=15)
        for _ in range(2):
            await c.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=1)
        with pytest.raises(openai.RateLimitError) as refused:  # the same 429 as ever
            await c.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=1)
        assert "3 requests per minute" in refused.value.message
        assert await half_a_body(base, "sk-team", 30_000_000, wait=10) == (True, 429)  # 30 MB never read
        assert await half_a_body(base, "sk-free", 2_000, wait=0.3) == (False, 200)  # another key: not limited
        await c.close()


async def test_a_spent_budget_or_full_concurrency_is_refused_before_the_body(chat_sim: SimProcess) -> None:
    router = keyed_router(chat_sim, Limits(budget=Budget(tokens=1_000, per="day")))
    async with serving(router) as base:
        # A body bigger than the whole budget could ever admit: the 400 it would get, at once.
        assert await half_a_body(base, "sk-team", 1_000, wait=0.3) == (False, 200)
        assert await half_a_body(base, "sk-team", 8_000, wait=10) == (True, 400)
        c = openai.AsyncOpenAI(base_url=base + "/v1", api_key="sk-team", max_retries=0, timeout=15)
        with pytest.raises(openai.RateLimitError):
            for _ in range(20):
                await c.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=200)
        scope = router._admission.limits.limiter.tenant_scope("team-key")  # noqa: SLF001
        assert scope is not None
        left = 1_000 - scope.spent()  # less than one more request's reservation
        assert left < 250
        # A body's size alone is reserved as a token per 2 bytes (limits.prompt_estimate).
        assert (await half_a_body(base, "sk-team", 2 * left, wait=0.3))[0] is False  # it could still fit
        assert await half_a_body(base, "sk-team", 2 * (left + 1), wait=10) == (True, 429)  # it cannot
        await c.close()
    router = keyed_router(chat_sim, Limits(concurrent=1))
    async with serving(router) as base:
        running = router._admission.limits.limiter.admit("team-key", ("chat",), 1, 0.0)  # noqa: SLF001 - a request in flight
        assert isinstance(running, Ticket)
        assert await half_a_body(base, "sk-team", 2_000, wait=10) == (True, 429)
        running.release()
        assert await half_a_body(base, "sk-team", 2_000, wait=0.3) == (False, 200)


# --- review 2: a request sent to an engine is charged, whichever way it ends ----------------------

@pytest.mark.slow
async def test_a_stream_dropped_before_its_first_token_is_charged_its_reservation() -> None:
    """The engine read the prompt (and may be writing): a client gone before the stream's first
    chunk is charged the whole reservation, as a client gone before a whole answer is. It was
    charged nothing: a tenant could have engines read any number of prompts for free."""
    import json

    from llmgw.tenancy.asked import reservation

    with SimProcess("chat", "--ttft", "600") as sim:
        router = keyed_router(sim, Limits(budget=Budget(tokens=100_000, per="day")))
        body = {"model": "chat", "stream": True, "max_tokens": 10,
                "messages": [{"role": "user", "content": "word " * 2_000}]}
        raw = json.dumps(body).encode()
        async with serving(router) as base:
            port = int(base.rsplit(":", 1)[1])
            scope = router._admission.limits.limiter.tenant_scope("team-key")  # noqa: SLF001
            assert scope is not None
            for i in range(2):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-team\r\n"
                             b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(raw), raw))
                await writer.drain()
                await until(lambda: sim_metric(sim.endpoint, "vllm:num_requests_running") >= 1, timeout=30)
                writer.transport.abort()
                await until(lambda: scope.inflight == 0 and
                            sim_metric(sim.endpoint, "vllm:num_requests_running") == 0, timeout=30)
                assert scope.used == (i + 1) * reservation(body, len(raw))


async def test_an_engine_error_after_the_prompt_was_sent_is_charged_its_prompt() -> None:
    """An engine that answers an error (or a stream that fails) was still sent the prompt: at
    least the prompt estimate is charged, never nothing."""
    from llmgw.tenancy.asked import prompt_estimate
    from tests.router.test_deliveries import engine

    async def answer(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        err = b'{"error": {"message": "bad", "type": "BadRequestError"}}'
        w.write(b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                % (len(err), err))
        await w.drain()

    async with engine(answer) as (url, _seen):
        keys = KeyRing.from_entries([{"name": "team-key", "sha256": hash_key("sk-team"), "models": ["*"]}])
        router = Router(keys=keys, config=RouterConfig())
        router.set_catalog(Catalog(models=(model("chat"),), settings=Settings(tenants=(
            Tenant("team", ("team-key",), Limits(budget=Budget(tokens=100_000, per="day"))),))))
        router.set_endpoints([endpoint("chat", url)])
        async with serving(router) as base:
            team = openai.AsyncOpenAI(base_url=base + "/v1", api_key="sk-team", max_retries=0, timeout=15)
            for stream in (False, True):
                with pytest.raises(openai.BadRequestError):
                    await team.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=5, stream=stream)
            await team.close()
        scope = router._admission.limits.limiter.tenant_scope("team-key")  # noqa: SLF001
        assert scope is not None and scope.inflight == 0
        assert scope.used >= 2 * prompt_estimate(60)


# --- review 2: the prompt is reserved conservatively ----------------------------------------------

def test_the_prompt_estimate_is_never_below_what_a_tokenizer_may_count() -> None:
    """bytes/4 under-reserved text of short words ("a a a": a token per 2 bytes), token-id
    prompts ("0,0,0": the same) and non-ASCII text (byte-fallback: up to a token a byte), so
    requests in flight together overshot a budget. A token per 2 bytes of ASCII, one a byte
    otherwise; an id list counts at least its ids."""
    import json

    from llmgw.tenancy.asked import prompt_estimate

    words = json.dumps({"messages": [{"role": "user", "content": "a " * 1000}]}).encode()
    assert prompt_estimate(words) >= 1000
    ids = json.dumps({"prompt": [0] * 1000}).encode()
    assert prompt_estimate(ids) >= 1000
    emoji = json.dumps({"prompt": "\U0001F600" * 100}, ensure_ascii=False).encode()
    assert prompt_estimate(emoji) >= 400  # 4 bytes each: up to 4 byte tokens
    escaped = json.dumps({"prompt": "\U0001F600" * 100}).encode()  # \ud83d\ude00: 12 bytes each
    assert prompt_estimate(escaped) >= 400
    # Before the body is read, its size alone: the least any body of that size is estimated at.
    assert prompt_estimate(len(words)) <= prompt_estimate(words)
    assert prompt_estimate(len(emoji)) <= prompt_estimate(emoji)


@pytest.mark.slow
async def test_requests_in_flight_together_cannot_use_more_than_the_budget() -> None:
    """Eight requests held until five run at once, each a 1,000-token prompt: the engine's own
    count of what it processed for the tenant stays within its 3,000-token budget (5,000 were
    served when the prompt was reserved as bytes/4)."""
    budget = 3_000
    # Held until five run at once, or (fewer admitted, as they should be) for 5 s.
    with SimProcess("chat", "--hold-until-running", "5", "--hold-timeout", "5") as sim:
        router = keyed_router(sim, Limits(budget=Budget(tokens=budget, per="day")))
        before = sim_metric(sim.endpoint, "vllm:prompt_tokens_total") + sim_metric(
            sim.endpoint, "vllm:generation_tokens_total")
        async with serving(router) as base, openai.AsyncOpenAI(base_url=base + "/v1", api_key="sk-team",
                                                               max_retries=0, timeout=60) as c:
            async def one() -> None:
                with contextlib.suppress(openai.RateLimitError):
                    await c.chat.completions.create(model="chat", max_tokens=1,
                                                    messages=[{"role": "user", "content": "a " * 1000}])
            await asyncio.gather(*(one() for _ in range(8)))
        engine = sim_metric(sim.endpoint, "vllm:prompt_tokens_total") + sim_metric(
            sim.endpoint, "vllm:generation_tokens_total") - before
    assert 0 < engine <= budget
