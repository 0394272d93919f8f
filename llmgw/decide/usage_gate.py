"""Usage a router reports, as far as the engines bear it out (issue 41). Pure.

A router's usage rows are its own word, and they spend tenants' budgets: a router host taken over
could charge any tenant for tokens no engine saw. Engines count the tokens they generate (vLLM's
and the simulator's ``generation_tokens_total``, SGLang's, llama.cpp's ``tokens_predicted_total``)
and, most of them, every prompt token they take in (``prompt_tokens_total`` of vLLM, SGLang and
the simulator; llama.cpp counts only what it computed, not what came from its cache, so its
prompts are not bounded this way), and the controller's own router reads those counters from
every replica. So the tokens of each kind all routers together report for a model may not pass
what the model's engines counted: a batch past that waits, unacknowledged (its router sends it
again), until the engines' counts catch up (an honest router's rows come after the tokens they
count), and what never fits is dropped, counted against the router that sent it. A kind of token
a model's engines do not count is believed; a model none of whose engines was read yet (a
controller just started, or engines without metrics) is believed once its batch waited HOLD for
a reading; a model the catalog does not name and no engine was read for takes no tokens at all
(no engine served it).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from llmgw.contract import UsageRow

# Tokens beyond what the engines counted, per model and kind, over the controller's life: a replica
# stopped between two readings is never read for its last moments. (Rows that come before the
# reading of their tokens wait for the next: no slack is needed for that.)
FLOOR = 4096
HOLD = 60.0  # seconds a batch waits for the engines' counts before what does not fit is dropped
MAX_REPLICAS = 10_000  # replicas whose last reading is remembered
MAX_WAITING = 10_000  # batches remembered as waiting (their routers keep them; one forgotten waits anew)
KINDS = ("prompt", "completion")  # the tokens a row reports, each bounded by the engines' own count


def reported(row: UsageRow, kind: str) -> int:
    return row.prompt_tokens if kind == "prompt" else row.completion_tokens


@dataclass
class Counted:
    """Tokens of one kind each model's engines counted, in totals that only grow, from counters
    that restart with their engine. An engine's first reading counts whole: routers may report
    usage from before this controller started (a batch held while it was away), never from before
    the engine did."""

    last: dict[str, float] = field(default_factory=dict)  # per replica, its counter as last read
    totals: dict[str, float] = field(default_factory=dict)  # per model

    def fold(self, readings: Mapping[str, tuple[str, float]]) -> None:
        """``readings``: per replica, (its model, its engine's counter)."""
        for rid, (model, value) in readings.items():
            # A replica out of the table for a while (draining) keeps its last reading: read again,
            # only what it counted since counts.
            before = self.last.pop(rid, None)
            grew = value if before is None or value < before else value - before
            self.totals[model] = self.totals.get(model, 0.0) + grew
            self.last[rid] = value  # the most recently read last: the oldest are forgotten first
        for gone in list(self.last)[:max(0, len(self.last) - MAX_REPLICAS)]:
            del self.last[gone]  # what it counted stays in its model's total

    def allowed(self, model: str) -> float | None:
        """Tokens all routers may have reported for ``model``; None: never read (believed)."""
        total = self.totals.get(model)
        return None if total is None else total + FLOOR

    def to_json(self) -> dict[str, Any]:
        return {"last": dict(self.last), "totals": dict(self.totals)}

    @classmethod
    def from_json(cls, d: Any) -> Counted:
        def numbers(x: Any) -> dict[str, float]:
            return {str(k): float(v) for k, v in x.items() if isinstance(v, int | float)} if isinstance(x, dict) else {}
        return cls(numbers(d.get("last")), numbers(d.get("totals"))) if isinstance(d, dict) else cls()


@dataclass
class EngineCounts:
    """What the engines counted, per kind of token."""

    kinds: dict[str, Counted] = field(default_factory=lambda: {kind: Counted() for kind in KINDS})

    def fold(self, readings: Mapping[str, tuple[str, float | None, float | None]]) -> None:
        """``readings``: per replica, (its model, its prompt counter, its generation counter), None where not read."""
        prompts = {rid: (model, p) for rid, (model, p, _g) in readings.items() if p is not None}
        generated = {rid: (model, g) for rid, (model, _p, g) in readings.items() if g is not None}
        self.kinds["prompt"].fold(prompts)
        self.kinds["completion"].fold(generated)

    def allowed(self, kind: str, model: str) -> float | None:
        return self.kinds[kind].allowed(model)

    def read(self, model: str) -> bool:
        """Whether any engine of ``model`` was read."""
        return any(model in c.totals for c in self.kinds.values())

    def to_json(self) -> dict[str, Any]:
        return {kind: c.to_json() for kind, c in self.kinds.items()}

    @classmethod
    def from_json(cls, d: Any) -> EngineCounts:
        d = d if isinstance(d, dict) else {}
        return cls({kind: Counted.from_json(d.get(kind)) for kind in KINDS})


@dataclass(frozen=True)
class Waiting:
    """A batch not taken yet: when it first came, who sent it, the tokens per model it waits with."""

    since: float
    router: str
    tokens: dict[str, int]


@dataclass(frozen=True)
class Verdict:
    """What to do with a batch: record ``rows`` (and note ``dropped`` against ``router``), or, with
    ``wait``, nothing yet: it is not acknowledged, and its router sends it again."""

    rows: list[UsageRow]
    dropped: dict[str, int]  # per model, tokens taken for none
    wait: bool = False
    waits_for: frozenset[str] = frozenset()  # with ``wait``: the models whose engines' counts it waits for


@dataclass
class UsageGate:
    """Tokens reported per kind and model, and the batches waiting for the engines' counts.

    A batch is taken whole or not at all until HOLD has passed since it first came: not taken, it
    is not acknowledged, so its router keeps it and sends it again with each report, and nothing is
    lost when this controller dies meanwhile (rows held here once were acknowledged, and went with it).
    Past HOLD the rows that fit are taken and the rest dropped against the router. Deciding and
    taking note are apart: what was decided is noted once the ledger took it."""

    reported: dict[tuple[str, str], int] = field(default_factory=dict)  # (kind, model) -> tokens
    waiting: dict[tuple[str, int], Waiting] = field(default_factory=dict)  # (instance, seq) -> since when
    dropped: dict[str, int] = field(default_factory=dict)  # per router: tokens never confirmed

    def counted(self, rows: Iterable[UsageRow]) -> None:
        """Rows now in the ledger (the controller's own router's, or ones this gate let through)."""
        for row in rows:
            for kind in KINDS:
                if tokens := reported(row, kind):  # a row of refusals only names no model's tokens
                    key = (kind, row.model)
                    self.reported[key] = self.reported.get(key, 0) + tokens

    def admit(self, rows: Iterable[UsageRow], counts: EngineCounts, *, router: str, instance: str, seq: int,
              now: float, known: Collection[str] | None = None) -> Verdict:
        """What to do with batch ``seq`` of ``instance`` now (note it with :meth:`taken` once recorded).
        ``known``: the catalog's models; a row with tokens for a model it does not name, whose
        engines were never read, is dropped whatever else: no engine served it."""
        key = (instance, seq)
        late = key in self.waiting and now - self.waiting[key].since > HOLD
        running = dict(self.reported)
        out: list[UsageRow] = []
        dropped: dict[str, int] = {}
        over: dict[str, int] = {}
        for row in rows:
            tokens = row.prompt_tokens + row.completion_tokens
            if known is not None and row.model not in known and not counts.read(row.model) and tokens:
                dropped[row.model] = dropped.get(row.model, 0) + tokens
            elif _fits(row, counts, running, unread_ok=late):
                out.append(row)
            else:
                over[row.model] = over.get(row.model, 0) + tokens
        if not over:
            return Verdict(out, dropped)
        if late:
            return Verdict(out, {m: dropped.get(m, 0) + over.get(m, 0) for m in {*dropped, *over}})
        if key not in self.waiting:
            self.waiting[key] = Waiting(now, router, over)
            for old in list(self.waiting)[:max(0, len(self.waiting) - MAX_WAITING)]:
                del self.waiting[old]  # it waits HOLD again when it comes back
        return Verdict([], {}, wait=True, waits_for=frozenset(over))

    def taken(self, verdict: Verdict, *, router: str, instance: str, seq: int) -> None:
        """Note a verdict the ledger recorded."""
        self.counted(verdict.rows)
        if verdict.dropped:
            self.dropped[router] = self.dropped.get(router, 0) + sum(verdict.dropped.values())
        self.waiting.pop((instance, seq), None)

    def held_tokens(self, now: float) -> dict[str, int]:
        """Per model, tokens of batches waiting now (those not sent again for 2 x HOLD are forgotten)."""
        for key in [k for k, w in self.waiting.items() if now - w.since > 2 * HOLD]:
            del self.waiting[key]
        out: dict[str, int] = {}
        for w in self.waiting.values():
            for model, tokens in w.tokens.items():
                out[model] = out.get(model, 0) + tokens
        return out

    def reported_json(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for (kind, model), n in self.reported.items():
            out.setdefault(kind, {})[model] = n
        return out

    def restore_reported(self, d: Any) -> None:
        """What was reported, as :meth:`reported_json` said it (a controller started again, or a new leader)."""
        if not isinstance(d, dict):
            return
        self.reported = {(kind, str(model)): int(n) for kind in KINDS if isinstance(d.get(kind), dict)
                         for model, n in d[kind].items() if isinstance(n, int) and not isinstance(n, bool)}


def _fits(row: UsageRow, counts: EngineCounts, running: dict[tuple[str, str], int], *, unread_ok: bool) -> bool:
    """Whether ``row`` fits, each kind of its tokens in what the engines counted beyond ``running``
    (taken into it if so). A kind the model's engines do not count is believed; a model none of
    whose engines was read yet, only when ``unread_ok``."""
    if (row.prompt_tokens or row.completion_tokens) and not counts.read(row.model) and not unread_ok:
        return False
    for kind in KINDS:
        tokens, allowed = reported(row, kind), counts.allowed(kind, row.model)
        if tokens and allowed is not None and running.get((kind, row.model), 0) + tokens > allowed:
            return False
    for kind in KINDS:
        if tokens := reported(row, kind):
            key = (kind, row.model)
            running[key] = running.get(key, 0) + tokens
    return True
