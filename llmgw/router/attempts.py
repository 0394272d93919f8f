"""Choose, send, and retry: the stage that turns one admitted request into attempts on replicas.

::

    choose (priority, load, canary track, prompt prefix) ──► send ──► answer
       │ nothing left                                         │ failed before the first byte
       ▼                                                      ▼
    after a failure: 502/504; else hold (scale from zero)   cool the replica down; retry elsewhere
                                                             when retry.next_step and the budget allow

A request's canary draw is made once, so it and its retries stay on one version of a model; a
retried request's prompt blocks are counted once. What differs per engine (how a stream is
asked for its running counts) is the chosen replica's :class:`~llmgw.router.engines.EngineProfile`.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable

from aiohttp import web

from llmgw.router import respond
from llmgw.router.account import Accounting
from llmgw.router.config import RouterConfig
from llmgw.router.current import Current
from llmgw.router.demand import DemandBook
from llmgw.router.hold import Holder
from llmgw.router.metrics import UNKNOWN, RouterMetrics
from llmgw.router.paths import CHAT, EMBEDDINGS
from llmgw.router.prefix import PrefixIndex, PromptKey, conversation_draw, prompt_key
from llmgw.router.proxy import rewrite_model
from llmgw.router.retry import RetryTicket, Step, next_step
from llmgw.router.routes import RouteModel
from llmgw.router.send import Routed, Sender
from llmgw.router.table import Upstream, choose
from llmgw.router.upstream import Reason, UpstreamFailed
from llmgw.router.usage import relay_stream

log = logging.getLogger(__name__)


def refuse(metrics: RouterMetrics, resp: web.Response, label: str, seconds: float) -> web.Response:
    """``resp``, a refusal no replica saw, counted in the request metric."""
    metrics.request(label, resp.status, "", seconds)
    return resp


class Attempts:
    def __init__(self, *, current: Current, sender: Sender, holder: Holder, accounting: Accounting,
                 demand: DemandBook, metrics: RouterMetrics, config: RouterConfig, rng: random.Random,
                 clock: Callable[[], float]) -> None:
        self._current = current
        self._sender = sender
        self._holder = holder
        self._accounting = accounting
        self._demand = demand
        self._metrics = metrics
        self._config = config
        self._rng = rng
        self._clock = clock

    async def run(self, r: Routed, ticket: RetryTicket) -> web.StreamResponse:
        """The answer of the first attempt that was not a failure before the first byte, or the
        refusal when none is left to try (or the retry budget says stop)."""
        current, config, rng, clock = self._current, self._config, self._rng, self._clock
        model, asked, body = r.model, r.asked, r.body
        chain = current.chain(model)
        tried: tuple[Upstream, ...] = ()
        failure: UpstreamFailed | None = None
        deliveries = 0  # attempts that reached an engine (DESIGN §6: at most two, each engine once)
        prompt = self._prompt_key(body, r.path, chain, r.prompt_text)
        counted = False  # a retried request's blocks are counted once
        # Drawn once: a request and its retries stay on one version of a model with a canary,
        # and a conversation's turns too (its opening names it: prefix.conversation_draw).
        draw = None
        if current.table.splits and r.path != EMBEDDINGS:
            draw = conversation_draw(body, r.path == CHAT)
        if draw is None:
            draw = rng.random()
        while True:
            table = current.table
            choice = choose(table, chain, clock(), rng, tried, prompt, config.prefix_imbalance, draw=draw)
            if choice is None:
                if failure is not None:
                    return self._refuse(self._failed(model, chain, failure, len(tried)), model.name, r.t0)
                refused = await self._holder.hold(model, chain)
                if refused is not None:
                    return self._refuse(refused, model.name, r.t0)
                now_model = current.routes.model(model.name)
                if now_model is None:
                    return self._refuse(respond.not_found(asked), UNKNOWN, r.t0)
                model, chain = now_model, current.chain(now_model)
                continue
            target, up = choice
            if prompt is not None and target.routing == "prefix":
                self._note_prompt(target.name, up, prompt, count=not counted)
                counted = True
            data = r.raw if target.name == asked else rewrite_model(r.raw, body, asked, target.name)
            # Usage is counted from the engine's own report: a stream is asked for its running
            # counts (llama.cpp its own way: llmgw.router.engines), and what the client did not
            # ask for is taken out again (llmgw.router.usage).
            relay = None
            if r.stream:
                data, relay = relay_stream(data, body if target.name == asked else {**body, "model": target.name},
                                           timings=up.engine.timings)
            send = self._sender.send
            try:
                if target is model:
                    return await send(r, up, data=data, served=target.name, relay=relay)
                self._metrics.fallback(model.name, target.name)
                if table.has(model.name):  # its replicas failed: no wake-up needed
                    return await send(r, up, data=data, served=target.name, relay=relay)
                with self._demand.standing_in(model.name):
                    return await send(r, up, data=data, served=target.name, relay=relay)
            except UpstreamFailed as exc:
                failure = exc
                tried += (up,)
                self._cool_down(up, exc)
                deliveries += exc.reason != Reason.CONNECT
                step = next_step(exc.reason, deliveries=deliveries, attempts=len(tried), retries=config.retries)
                if step is Step.SPEND and not ticket.spend():
                    self._metrics.retry_denied(model.name)
                    step = Step.STOP
                if step is Step.STOP:
                    return self._refuse(self._failed(model, chain, failure, len(tried)), model.name, r.t0)
                self._metrics.retry(model.name, exc.reason)

    def _cool_down(self, up: Upstream, exc: UpstreamFailed) -> None:
        """A replica that failed an attempt is skipped for a while when anything else is left."""
        now = self._clock()
        if up.cooldown_until <= now:
            log.warning("replica %s (%s) failed (%s); cooling down %.0f s", up.replica_id, up.url, exc,
                        self._config.cooldown)
        up.cooldown_until = now + self._config.cooldown
        up.failures += 1
        if exc.reason in (Reason.CONNECT, Reason.DISCONNECT):
            up.forget_prompts()  # an engine that refuses or drops connections may be a new process

    def _refuse(self, resp: web.Response, label: str, t0: float) -> web.Response:
        return refuse(self._metrics, resp, label, self._clock() - t0)

    def _failed(self, model: RouteModel, chain: tuple[RouteModel, ...], failure: UpstreamFailed,
                attempts: int) -> web.Response:
        alts = "" if len(chain) == 1 else f" (fallbacks: {', '.join(m.name for m in chain[1:])})"
        msg = (f"The model `{model.name}`{alts} could not be served: {attempts} attempt(s) failed before an answer; "
               f"last: {failure}.")
        return respond.upstream_failed(msg, timeout=failure.timeout, retry_after=self._config.retry_after)

    # --- prefix affinity (llmgw.router.prefix) -------------------------------------------
    def _prompt_key(self, body: dict, path: str, chain: tuple[RouteModel, ...],
                    text: str | None = None) -> PromptKey | None:
        """The request's prompt key when any model it may go to is routed by prefix. ``text``: the
        prompt already rendered (a big body, by the parse worker), keyed as a plain prompt is."""
        if path == EMBEDDINGS or not any(m.routing == "prefix" for m in chain):
            return None
        if text is not None:
            return prompt_key({"prompt": text}, False, self._config.prefix_block_chars)
        return prompt_key(body, path == CHAT, self._config.prefix_block_chars)

    def _note_prompt(self, model: str, up: Upstream, prompt: PromptKey, *, count: bool) -> None:
        if up.prefixes is None:
            up.prefixes = PrefixIndex(self._config.prefix_index_blocks)
        held = up.prefixes.record(prompt.hashes)
        if count:
            self._accounting.prompt_blocks(model, routed=len(prompt.hashes), held=held)
