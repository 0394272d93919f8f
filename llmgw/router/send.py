"""An attempt: a request sent to one chosen replica, its answer passed to the client, and what
it did counted (in flight, last use, the request metric, the tenant's ticket, the replica's
stats). Whether to try again elsewhere is the caller's (:mod:`llmgw.router.attempts`): a failure
before the client saw anything comes out as :class:`~llmgw.router.upstream.UpstreamFailed`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from llmgw.router.account import Accounting
from llmgw.router.answer import stream_error
from llmgw.router.metrics import RouterMetrics
from llmgw.router.proxy import CLIENT_GONE, forward_stream, forward_whole
from llmgw.router.routes import RouteModel
from llmgw.router.table import Upstream
from llmgw.router.upstream import Reason, UpstreamFailed, UpstreamPool
from llmgw.router.usage import Relay
from llmgw.tenancy.usage import Account


@dataclass(slots=True, kw_only=True)
class Routed:
    """A request ready to route: read, parsed, resolved to a model, admitted. Each attempt sends
    it to one replica (:meth:`Sender.send`)."""

    request: web.Request  # the client's, which a stream is written to
    path: str  # the API path (/v1/chat/completions, ...)
    raw: bytes  # the body as the client sent it (limit fields set when a tenant's budget caps it)
    body: dict  # parsed (a big body's unread members as text: llmgw.router.parse)
    asked: str  # the model name the client used (an alias, maybe)
    model: RouteModel  # what it resolved to; its name is the metrics' label
    stream: bool
    t0: float  # when the router got it (monotonic)
    account: Account  # whose request, and the tenant's ticket if limited
    prompt_text: str | None = None  # the prompt already rendered by the parse worker (a big body)


class Sender:
    """Sends attempts through the engines' connection pool (``pool`` is set by ``Router.start()``)."""

    def __init__(self, accounting: Accounting, *, metrics: RouterMetrics, clock: Callable[[], float],
                 wall: Callable[[], float]) -> None:
        self.pool: UpstreamPool | None = None
        self._accounting = accounting
        self._metrics = metrics
        self._clock = clock
        self._wall = wall

    async def send(self, r: Routed, up: Upstream, *, data: bytes, served: str,
                   relay: Relay | None) -> web.StreamResponse:
        """One attempt: ``data`` (the body the engine gets) sent to ``up``, which serves the model
        ``served`` (the one asked, or a fallback); ``relay``: a stream's, what the router asked the
        engine for (taken out again) and where its running count is. The answer, passed on;
        :class:`UpstreamFailed` when it failed before the client saw any of it."""
        pool = self.pool
        assert pool is not None, "Router.start() was not awaited"
        stream, account, books, label = r.stream, r.account, self._accounting, r.model.name
        rid = up.replica_id
        last_used = books.last_used
        up.inflight += 1
        last_used[rid] = self._wall()
        status: int | None = None
        counted = books.answer_tap(served, account, up.engine)
        whole = tapped = failed = broken = False
        ticket = account.ticket
        clock = self._clock
        # This attempt's own start: time the request waited for a replica is not the replica's.
        start = clock()
        first: float | None = None  # when a stream's first chunk came
        last: float | None = None  # when its end marker came (the engine's pace, not the client's)
        events = 0
        outputs: int | None = None  # the completion tokens the answer's usage says

        def tap(tail: bytes, n: int, running: tuple[int, int] | None, complete: bool) -> None:
            nonlocal whole, tapped, events, broken, outputs
            whole, tapped, events = complete, True, n
            # A 200 stream whose engine failed after it began says so in an error event near its
            # end (vLLM's; answer.stream_error): searched for in the tail only, once per stream.
            broken = stream and stream_error(tail)
            used = counted(tail, n, running, complete)
            outputs = used[1] if used is not None else None

        def gone() -> None:
            # The client went away before any answer was counted (a whole one not yet read, a
            # stream before its first chunk, or before its response began): the engine has the
            # prompt and may be writing, how much is not known, so the whole reservation is
            # charged (a stream that began counts what it got).
            if ticket is not None:
                ticket.settle(account.reserved)
            tap(b"", 0, None, False)
        try:
            if stream:
                metrics, t0 = self._metrics, r.t0

                def on_first() -> None:
                    nonlocal first
                    first = clock()
                    metrics.first_token(label, first - t0)

                def on_end() -> None:
                    nonlocal last
                    last = clock()

                resp, status = await forward_stream(pool, up.origin, up.heads[r.path], data, served, r.request,
                                                    on_first, tap, relay, on_end)
                if status == CLIENT_GONE and not tapped:
                    gone()
            else:
                resp = await forward_whole(pool, up.origin, up.heads[r.path], data, served, tap)
                status = resp.status
            if ticket is not None:  # an engine's error, or an answer without usage: its prompt counts
                ticket.charge_at_least(account.prompt_estimate)
            return resp
        except BaseException as exc:
            if isinstance(exc, UpstreamFailed):
                failed = True
                if exc.reason not in (Reason.CONNECT, Reason.STATUS) and ticket is not None:
                    # Sent, then cut off: the engine read the prompt. Charged unless a retry's
                    # answer settles what was really used.
                    ticket.charge_at_least(account.prompt_estimate)
            else:
                # Cancelled: the client went away, before the answer's end or (a client that
                # hangs up at the end marker) after it, which is an answer served.
                status = 200 if whole else CLIENT_GONE
                if not tapped:
                    gone()
            raise
        finally:
            up.inflight -= 1
            last_used[rid] = self._wall()
            end = clock()
            if status is not None:
                self._metrics.request(label, status, rid, end - r.t0)
            books.observe(rid, failed=failed, status=status, whole=whole, tapped=tapped, start=start,
                          first=first, last=last, end=end, events=events, broken=broken, outputs=outputs)
