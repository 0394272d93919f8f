"""What each API key used, as the router counts it from what engines report (issue 18), and the
outbox that keeps it until the controller's ledger has it (``llmgw.contract``).

The router reads an answer's end (:mod:`llmgw.router.usage`: the engine's ``usage`` object, or
the stream's content events when it was cut short) and hands the figures to :meth:`UsageBook.answered`,
which settles the request's ticket with them (budgets count what was used, not what was
reserved) and counts them per key and model, and by minute for the ledger. Pure: no I/O.
"""

from __future__ import annotations

import secrets
from collections import deque
from dataclasses import dataclass, fields

from llmgw.contract import MAX_USAGE_ROWS, USAGE_RETAINED, UsageBatch, UsageRow
from llmgw.tenancy.admission import Admitted


@dataclass
class Usage:
    """One key's use of one model since the router started (mutable: the router adds to it)."""

    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    counted_from_stream: int = 0  # requests whose tokens were counted from the stream, not reported
    refused: int = 0  # requests the tenant's limits refused (never sent to an engine)

    def to_json(self) -> dict[str, int]:
        return {f: getattr(self, f) for f in _FIELDS}

    def add(self, other: Usage) -> None:
        for f in _FIELDS:
            setattr(self, f, getattr(self, f) + getattr(other, f))


_FIELDS = tuple(f.name for f in fields(Usage))


@dataclass(frozen=True)
class Account:
    """Whom a request is counted against: the key's name ("" when open) and its tenant's ticket,
    with the request's prompt estimate and reservation (what it is charged when the engine's
    count never comes)."""

    key: str
    ticket: Admitted | None = None
    prompt_estimate: int = 0
    reserved: int = 0


class UsageOutbox:
    """Usage counted and not yet acknowledged by the controller, as numbered batches.

    ``take()`` freezes what was counted into batch ``seq`` and gives that same batch again until
    ``acked(seq)``: what is counted meanwhile waits for the next one, so a batch the controller
    recorded but whose answer was lost is recorded once (the controller keeps each instance's
    last seq). ``instance`` is new with every router process, which makes (instance, seq) unique.
    """

    def __init__(self, instance: str | None = None) -> None:
        self.instance = instance or secrets.token_hex(8)
        self._seq = 0
        self._open: dict[tuple[int, str, str, str], Usage] = {}
        self._sent: UsageBatch | None = None
        self._done: deque[UsageBatch] = deque(maxlen=USAGE_RETAINED)  # acknowledged, newest last
        self._again: deque[UsageBatch] = deque()  # to send again, in order, before anything new

    def add(self, minute: int, tenant: str, key: str, model: str, delta: Usage) -> None:
        entry = self._open.get((minute, tenant, key, model))
        if entry is None:
            entry = self._open[(minute, tenant, key, model)] = Usage()
        entry.add(delta)

    def take(self) -> UsageBatch | None:
        """The batch to send: the one not acknowledged yet, else what was counted since (or None)."""
        if self._sent is None and self._again:
            self._sent = self._again.popleft()
        if self._sent is None and self._open:
            self._seq += 1
            # Oldest first, at most MAX_USAGE_ROWS: the rest goes in the batches after.
            taken = sorted(self._open)[:MAX_USAGE_ROWS]
            rows = tuple(UsageRow(m, t, k, mo, **self._open.pop((m, t, k, mo)).to_json()) for m, t, k, mo in taken)
            self._sent = UsageBatch(self.instance, self._seq, rows)
        return self._sent

    def acked(self, seq: int) -> None:
        if self._sent is not None and self._sent.seq == seq:
            self._done.append(self._sent)
            self._sent = None

    def resend_from(self, seq: int) -> None:
        """The controller's store lacks the batches from ``seq`` on (restored from an older copy):
        the acknowledged ones kept from there go again, in order, then the one in flight. What
        is no longer kept is lost (said in the log by the caller)."""
        again = [b for b in self._done if b.seq >= seq]
        if self._sent is not None:
            again.append(self._sent)
            self._sent = None
        self._again = deque(sorted(again, key=lambda b: b.seq))
        self._done = deque((b for b in self._done if b.seq < seq), maxlen=USAGE_RETAINED)

    def kept_from(self) -> int | None:
        """The oldest acknowledged batch kept (None: none)."""
        return self._done[0].seq if self._done else None

    @property
    def pending(self) -> int:
        """Rows not yet acknowledged."""
        return (len(self._open) + (len(self._sent.rows) if self._sent is not None else 0)
                + sum(len(b.rows) for b in self._again))


class UsageBook:
    """Usage per (API key name, model served) since the router started (``totals``), and the
    same by minute in ``outbox`` until the controller's ledger has it."""

    def __init__(self, outbox: UsageOutbox | None = None) -> None:
        self.totals: dict[tuple[str, str], Usage] = {}
        self.outbox = outbox or UsageOutbox()

    def answered(self, account: Account, model: str, *, complete: bool, reported: tuple[int, int] | None,
                 streamed: int | None, minute: int, tenant: str) -> None:
        """An answer's end: ``reported`` (prompt, completion) tokens the engine reported, else
        ``streamed`` content events (a stream cut short, or an engine that reports nothing: what
        was produced is counted, the prompt as 0) or None (nothing came). The ticket is settled
        with the real count; a stream begun without one is charged its prompt estimate too (the
        engine read the prompt)."""
        delta = Usage(requests=1, errors=0 if complete else 1)
        ticket = account.ticket
        if reported is not None:
            delta.prompt_tokens, delta.completion_tokens = reported
            if ticket is not None:
                ticket.settle(reported[0] + reported[1])
        elif streamed is not None:
            delta.completion_tokens, delta.counted_from_stream = streamed, 1
            if ticket is not None:
                ticket.settle(account.prompt_estimate + streamed)
        self.count(account.key, model, delta, minute=minute, tenant=tenant)

    def count(self, key: str, model: str, delta: Usage, *, minute: int, tenant: str) -> None:
        entry = self.totals.get((key, model))
        if entry is None:
            entry = self.totals[(key, model)] = Usage()
        entry.add(delta)
        self.outbox.add(minute, tenant, key, model, delta)
