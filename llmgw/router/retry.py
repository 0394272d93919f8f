"""Which failed attempts may be tried again elsewhere: at most two deliveries per request, and
retries that reached an engine spend a budget shared by all live requests (DESIGN §6).

A failing fleet must not see its load multiplied by retries: as in Envoy's retry budgets and
gRPC's retry throttling, at most a share of the requests in flight may be retrying at once
(with a small floor, so a quiet router can still retry one). Pure bookkeeping, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from llmgw.router.upstream import Reason

MAX_DELIVERIES = 2  # a client request reaches engines at most twice


@dataclass
class RetryBudget:
    ratio: float = 0.2
    floor: int = 3
    live: int = 0  # requests being routed now
    retrying: int = 0  # of those, the ones on a retry that reached an engine before

    def allows(self) -> bool:
        return self.retrying < max(self.floor, self.ratio * self.live)

    def ticket(self) -> RetryTicket:
        """One request's share of the budget: ``with budget.ticket() as t:`` counts it live."""
        return RetryTicket(self)


class RetryTicket:
    """A request while it is routed: live in its budget, holding at most one retry."""

    __slots__ = ("budget", "holding")

    def __init__(self, budget: RetryBudget) -> None:
        self.budget = budget
        self.holding = False

    def __enter__(self) -> RetryTicket:
        self.budget.live += 1
        return self

    def __exit__(self, *_exc: object) -> None:
        self.budget.live -= 1
        if self.holding:
            self.budget.retrying -= 1

    def spend(self) -> bool:
        """Whether this request may retry after reaching an engine; it holds the retry from then."""
        if not self.holding:
            if not self.budget.allows():
                return False
            self.holding = True
            self.budget.retrying += 1
        return True


class Step(StrEnum):
    """What follows a failed attempt."""

    RETRY = "retry"  # free: it never reached an engine
    SPEND = "spend"  # retry, if the retry budget allows
    STOP = "stop"


def next_step(reason: Reason, *, deliveries: int, attempts: int, retries: int) -> Step:
    """After a failed attempt, the next :class:`Step`. ``deliveries`` counts attempts that
    reached an engine, this one included; ``attempts`` every attempt so far."""
    if reason == Reason.TIMEOUT:
        return Step.STOP  # the engine may still be generating: a second one would double the work
    if reason == Reason.CONNECT:
        # Never reached an engine; bounded all the same, so a dead fleet answers fast.
        return Step.RETRY if attempts <= retries + 2 else Step.STOP
    if deliveries >= MAX_DELIVERIES or deliveries > retries:
        return Step.STOP
    return Step.SPEND
