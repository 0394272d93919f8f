"""One table of admission cases, run against both implementations of the tenants' ``Limits``:
this router's own counts (``LocalLimits``) and counts shared in a real ``redis-server``
(``SharedLimits``, where a Lua script applies the rules). Both are driven only through the
``Limits`` protocol the router uses, and each case must end the same way in both: the same
requests admitted, the same refused for the same limit with the same words (issue 29: the rules
were written three times and only end-to-end tests checked that they agreed).

Buckets refill with time (the Redis server's clock, which a test cannot hold still), so every
refusal below is one that waiting seconds would not undo: a bucket at least 5 s from the next
request that could fit."""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest

from llmgw.catalog.model import Budget, Limits, Tenant
from llmgw.tenancy.admission import Admitted
from llmgw.tenancy.admission import Limits as TenantLimits
from llmgw.tenancy.memory import LocalLimits
from llmgw.tenancy.rules import Refusal
from llmgw.tenancy.shared import SharedLimits


@dataclass(frozen=True)
class Admit:
    """Ask for ``model`` reserving ``reserve`` tokens; ``expect``: "ok", "unlimited" (no tenant),
    or the status (429, 400) and words of the refusal."""

    reserve: int
    expect: str | tuple[int, str] = "ok"
    model: str = "small"
    key: str = "k"


@dataclass(frozen=True)
class End:
    """Ticket ``n`` (counting admitted ones from 0) ends, having used ``used`` tokens (None: unsettled)."""

    n: int
    used: int | None = None


@dataclass(frozen=True)
class Precheck:
    """The check before a body is read: None expected, or the words of its refusal."""

    reserve: int
    expect: str | None


DAY = Budget(tokens=1000, per="day")
CASES: dict[str, tuple[Tenant, list[Admit | End | Precheck]]] = {
    "requests per minute": (Tenant("team", ("k",), Limits(requests_per_minute=3)), [
        Admit(1), Admit(1), Admit(1),
        Admit(1, (429, "tenant `team` reached its limit of 3 requests per minute")),
        Precheck(1, "reached its limit of 3 requests per minute"),  # refused again before a body is read
        Admit(1, "unlimited", key="someone-else"),
    ]),
    "requests in flight": (Tenant("team", ("k",), Limits(concurrent=2)), [
        Admit(5), Admit(5),
        Admit(5, (429, "2 requests of tenant `team` are in flight, its limit (concurrent: 2)")),
        End(0, 5), Admit(5),
        Admit(5, (429, "(concurrent: 2)")),
        End(1), End(2), Admit(5), Admit(5),
    ]),
    "tokens per minute": (Tenant("team", ("k",), Limits(tokens_per_minute=12)), [
        Admit(5), Admit(5),
        Admit(5, (429, "tenant `team` reached its limit of 12 tokens per minute (this request reserves 5)")),
        Admit(2),  # what is left fits a smaller one
    ]),
    "a request bigger than the tokens bucket": (Tenant("team", ("k",), Limits(tokens_per_minute=12)), [
        Admit(30),  # a full bucket admits it, and is left in debt
        Admit(1, (429, "12 tokens per minute (this request reserves 1)")),
    ]),
    "a budget, reserved then settled": (Tenant("team", ("k",), Limits(budget=DAY)), [
        Admit(300), Admit(300), Admit(300),
        Admit(300, (429, "-token budget per day (this request reserves 300")),
        End(0, 250), End(1, 250), End(2, 250),  # each gives back 50
        Admit(200),
        Admit(100, (429, "of its 1000-token budget per day")),
        Admit(50),
    ]),
    "a request that no budget could hold": (Tenant("team", ("k",), Limits(budget=Budget(tokens=100, per="day"))), [
        Admit(150, (400, "reserves 150 tokens")),
        Precheck(150, "more than tenant `team`'s whole budget of 100 per day"),
        Admit(100),
    ]),
    "the tenant's limits and its model's": (
        Tenant("team", ("k",), Limits(requests_per_minute=10), (("big", Limits(requests_per_minute=1)),)), [
            Admit(1, model="big"),
            Admit(1, (429, "tenant `team/big` reached its limit of 1 requests per minute"), model="big"),
            *[Admit(1) for _ in range(9)],  # the refusal took nothing from the tenant's own bucket
            Admit(1, (429, "tenant `team` reached its limit of 10 requests per minute")),
        ]),
}


@pytest.fixture(params=["memory", "redis"])
def store(request: pytest.FixtureRequest) -> str:
    """Where the counts are kept: "" in memory, else a real redis-server's URL (tests/tenancy/conftest.py)."""
    return "" if request.param == "memory" else request.getfixturevalue("redis_url")


@pytest.mark.parametrize("case", list(CASES))
async def test_admission_table(store: str, case: str) -> None:
    tenant, steps = CASES[case]
    limits: TenantLimits = SharedLimits(store) if store else LocalLimits()
    limits.set_tenants((tenant,))
    try:
        await run(limits, tenant, case, steps)
    finally:
        await limits.close()


async def run(limits: TenantLimits, tenant: Tenant, case: str, steps: list[Admit | End | Precheck]) -> None:
    tickets: list[Admitted] = []
    for i, step in enumerate(steps):
        where = f"{case}, step {i} ({step})"
        if isinstance(step, End):
            if step.used is not None:
                tickets[step.n].settle(step.used)
            tickets[step.n].release()
            continue
        if isinstance(step, Precheck):
            refused = limits.precheck("k", step.reserve, time.time())
            if step.expect is None:
                assert refused is None, where
            else:
                assert refused is not None and step.expect in refused.message, (where, refused)
            continue
        models = (step.model,)
        got = await limits.admit(step.key, models, step.reserve, time.time())
        if step.expect == "unlimited":
            assert got is None, (where, got)
        elif step.expect == "ok":
            assert got is not None and not isinstance(got, Refusal), (where, got)
            tickets.append(got)
        else:
            status, words = step.expect
            assert isinstance(got, Refusal), (where, got)
            assert (400 if got.fits_never else 503 if got.unavailable else 429) == status, (where, got)
            assert words in got.message, (where, got.message)
            if status == 429:
                assert got.retry_after > 0 and got.message.startswith("Rate limit reached: "), (where, got)
                lim = (tenant.limits if "/" not in got.message.split("`")[1] else dict(tenant.models)[step.model])
                if lim.requests_per_minute:
                    assert got.headers["x-ratelimit-limit-requests"] == str(lim.requests_per_minute), where
                if lim.tokens_per_minute:
                    assert got.headers["x-ratelimit-limit-tokens"] == str(lim.tokens_per_minute), where
    for t in tickets:
        t.release()
    assert not limits.degraded


def test_a_bucket_new_with_a_catalog_is_full_in_a_refusal_of_another_limit() -> None:
    """A new catalog changing a tenant's requests per minute while its requests in flight fill its
    concurrency: the new bucket had never been read, and the concurrency refusal's headers read
    its level (NaN): a ValueError, a 500 instead of a 429."""
    from llmgw.tenancy.memory import Limiter

    old = Limiter([Tenant("team", ("k",), Limits(requests_per_minute=5, concurrent=1))])
    running = old.admit("k", ("m",), 0, 100.0)
    assert running is not None and not isinstance(running, Refusal)
    new = Limiter([Tenant("team", ("k",), Limits(requests_per_minute=10, concurrent=1))])
    new.carry_over(old)
    refused = new.admit("k", ("m",), 0, 101.0)
    assert isinstance(refused, Refusal) and "(concurrent: 1)" in refused.message
    assert refused.headers["x-ratelimit-remaining-requests"] == "10"  # a new bucket is full
    assert refused.headers["x-ratelimit-reset-requests"] == "0ms"
    running.release()
    assert not isinstance(new.admit("k", ("m",), 0, 101.0), Refusal)
