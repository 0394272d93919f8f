"""Usage routers report, as far as the engines bear it out (issue 41): a router credential's
batches are recorded in a real SQLite ledger only up to the prompt and completion tokens the
model's engines counted (read by the controller's own router). A batch past that waits,
unacknowledged (its router sends it again), until the engines' counts catch up; past HOLD what
does not fit is dropped, counted against the router that sent it."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.contract import UsageBatch, UsageRow
from llmgw.control.usage import GatedLedger, UsageDeferred, UsageGateCollector
from llmgw.decide.usage_gate import FLOOR, HOLD
from llmgw.state import Store
from tests.control.test_feed_replica_stats import Clock


def row(key: str, completion: int, model: str = "chat", prompt: int = 10) -> UsageRow:
    return UsageRow(600, "lab", key, model, requests=1, prompt_tokens=prompt, completion_tokens=completion)


def charged(store: Store, key: str) -> int:
    """Completion tokens the ledger charged ``key`` (what its budget is spent by)."""
    return sum(r["completion_tokens"] for r in store.usage(0, 10 ** 10, by=("key",)) if r["key"] == key)


MODELS = {"chat", "gguf", "no-metrics"}  # the catalog's


def gated(tmp_path: Path, store: Store | None = None,
          engines: dict[str, tuple[str, float | None, float | None]] | None = None,
          ) -> tuple[Store, GatedLedger, dict[str, tuple[str, float | None, float | None]], Clock]:
    """The gated ledger on a real SQLite store, its figures kept there, and the engines' readings it
    sees: per replica (model, prompt, generated)."""
    store = store or Store(tmp_path / "llmgw.db").open()
    engines = {} if engines is None else engines
    clock = Clock()
    ledger = GatedLedger(store, lambda: dict(engines), models=lambda: MODELS,
                         state=(store.usage_gate_state, store.set_usage_gate_state), clock=clock)
    return store, ledger, engines, clock


def deferred(ledger: GatedLedger, batch: UsageBatch) -> bool:
    """Whether the batch waits (not recorded, not acknowledged)."""
    try:
        ledger.record_usage(batch)
    except UsageDeferred:
        return True
    return False


def test_a_router_is_charged_no_more_tokens_than_the_engines_generated(tmp_path: Path) -> None:
    store, ledger, engines, clock = gated(tmp_path)
    engines["chat-r1"] = ("chat", None, 1000.0)  # the engine generated 1,000 tokens (prompts not counted)
    allowed = 1000 + FLOOR
    forged = UsageBatch("edge-1/p1", 1, (row("victim", 1_000_000),))  # another tenant's key charged
    assert deferred(ledger, forged)
    assert charged(store, "victim") == 0 and ledger.gate.held_tokens(clock.now) == {"chat": 1_000_010}
    assert deferred(ledger, forged)  # sent again: waits, counted once
    assert ledger.gate.held_tokens(clock.now) == {"chat": 1_000_010}
    # Tokens up to what the engines bear out are taken, from any router.
    assert ledger.record_usage(UsageBatch("edge-2/p9", 1, (row("web", allowed),)))
    assert charged(store, "web") == allowed
    assert deferred(ledger, UsageBatch("edge-2/p9", 2, (row("web", 1),)))
    # Past HOLD, sent again: what does not fit is dropped, said against the router that sent it,
    # and the batch is recorded (acknowledged) without it.
    clock.now += HOLD + 1
    assert ledger.record_usage(forged) and ledger.record_usage(UsageBatch("edge-2/p9", 2, (row("web", 1),)))
    assert charged(store, "victim") == 0 and charged(store, "web") == allowed
    assert ledger.gate.held_tokens(clock.now) == {}
    assert ledger.gate.dropped == {"edge-1": 1_000_010, "edge-2": 11}
    assert not ledger.record_usage(forged)  # recorded before: nothing dropped twice
    assert ledger.gate.dropped == {"edge-1": 1_000_010, "edge-2": 11}
    metrics = {m.name: m for m in UsageGateCollector(lambda: ledger.gate).collect()}
    assert [(s.labels, s.value) for s in metrics["llmgw_controller_usage_unconfirmed_tokens"].samples
            if s.name.endswith("_total")] == [({"router": "edge-1"}, 1_000_010), ({"router": "edge-2"}, 11)]


def test_a_batch_that_came_before_the_engines_reading_is_recorded_when_it_comes(tmp_path: Path) -> None:
    """An honest router's batch can reach the controller before its router reads the tokens it
    counts (readings a second apart): it waits, is sent again, and is recorded once, whole."""
    store, ledger, engines, clock = gated(tmp_path)
    engines["chat-r1"] = ("chat", None, 0.0)
    early = UsageBatch("edge-1/p1", 1, (row("web", 50_000), row("web", 5)))
    assert deferred(ledger, early) and charged(store, "web") == 0
    engines["chat-r1"] = ("chat", None, 50_005.0)
    clock.now += 2
    assert ledger.record_usage(early)  # its router's next report
    assert charged(store, "web") == 50_005 and ledger.gate.held_tokens(clock.now) == {}
    assert not ledger.record_usage(early) and charged(store, "web") == 50_005  # an answer lost: acknowledged
    assert ledger.gate.held_tokens(clock.now) == {}


def test_a_controller_killed_while_a_batch_waits_loses_none_of_it(tmp_path: Path) -> None:
    """A waiting batch was never acknowledged: its router still has it, and the next controller on
    the same store records it once the engines bear it out."""
    store, ledger, engines, clock = gated(tmp_path)
    engines["chat-r1"] = ("chat", None, 0.0)
    batch = UsageBatch("edge-1/p1", 1, (row("web", 9000),))
    assert deferred(ledger, batch)
    del ledger  # kill -9: what it had in memory is gone
    _store, again, _engines, _clock = gated(tmp_path, store, {"chat-r1": ("chat", None, 9000.0)})
    assert again.record_usage(batch) and charged(store, "web") == 9000


def test_an_engine_started_again_counts_from_zero_and_its_tokens_still_count(tmp_path: Path) -> None:
    store, ledger, engines, _clock = gated(tmp_path)
    engines["chat-r1"] = ("chat", None, 30_000.0)
    ledger.record_usage(UsageBatch("edge-1/p1", 1, ()))
    engines["chat-r1"] = ("chat", None, 20_000.0)  # restarted: 20,000 new tokens, not 10,000 fewer
    assert ledger.record_usage(UsageBatch("edge-1/p1", 2, (row("web", 50_000),)))
    assert charged(store, "web") == 50_000


def test_the_controllers_own_router_is_taken_as_it_counts_and_leaves_less_to_the_others(tmp_path: Path) -> None:
    store, ledger, engines, _clock = gated(tmp_path)
    engines["chat-r1"] = ("chat", None, 10_000.0)
    assert ledger.trusted.record_usage(UsageBatch("local", 1, (row("web", 10_000),)))
    assert charged(store, "web") == 10_000
    assert deferred(ledger, UsageBatch("edge-1/p1", 1, (row("victim", FLOOR + 1000),)))
    assert charged(store, "victim") == 0  # the engines' tokens were the controller's own router's


def test_a_model_whose_engines_were_never_read_is_believed_once_its_batch_waited_for_a_reading(
        tmp_path: Path) -> None:
    """Engines without metrics cannot bound anything: their rows are believed, once the batch
    waited HOLD for a reading; a reading that comes meanwhile (a controller just started reads its
    engines a moment later) bounds the others as any other."""
    store, ledger, engines, clock = gated(tmp_path)
    batch = UsageBatch("edge-1/p1", 1, (row("web", 123_456, model="no-metrics"), row("victim", 999_999, model="chat")))
    assert deferred(ledger, batch)
    assert charged(store, "web") == 0 and charged(store, "victim") == 0  # nothing read yet
    engines["chat-r1"] = ("chat", 100.0, 100.0)  # the chat engine read; the other model's never is
    clock.now += HOLD + 1
    assert ledger.record_usage(batch)
    assert charged(store, "web") == 123_456  # believed, a minute late
    assert charged(store, "victim") == 0 and ledger.gate.dropped == {"edge-1": 999_999 + 10}


def test_prompt_tokens_are_bounded_by_the_prompts_the_engines_took_in(tmp_path: Path) -> None:
    """Budgets are spent by prompt tokens too: a forged row of a few completion tokens and a
    million prompt tokens waits where the engines count their prompts (vLLM, SGLang, the
    simulator); where they do not (llama.cpp counts only what its cache did not hold) prompts are
    believed."""
    store, ledger, engines, clock = gated(tmp_path)
    engines["chat-r1"] = ("chat", 2000.0, 100.0)
    engines["gguf-r1"] = ("gguf", None, 100.0)
    assert ledger.record_usage(UsageBatch("edge-1/p1", 1, (row("web", 90, prompt=1900),)))
    assert deferred(ledger, UsageBatch("edge-1/p1", 2, (row("victim", 5, prompt=1_000_000),)))
    assert charged(store, "web") == 90 and charged(store, "victim") == 0
    assert ledger.gate.held_tokens(clock.now) == {"chat": 1_000_005}
    assert ledger.record_usage(UsageBatch("edge-2/p1", 1, (row("web", 90, model="gguf", prompt=1_000_000),)))
    assert charged(store, "web") == 180


def test_tokens_for_a_model_no_engine_served_are_taken_for_none(tmp_path: Path) -> None:
    """A model the catalog does not name (a typo, "", a made-up one) whose engines were never read:
    no engine served it, so its tokens are charged to no one (rows of refusals alone are kept)."""
    store, ledger, engines, _clock = gated(tmp_path)
    engines["chat-r1"] = ("chat", 100.0, 100.0)
    refusals = UsageRow(600, "lab", "web", "", refused=3)
    assert ledger.record_usage(UsageBatch("edge-1/p1", 1, (row("victim", 999_999_999, model="no-such-model"),
                                                            row("victim", 0, model="", prompt=10 ** 9), refusals)))
    assert charged(store, "victim") == 0 and ledger.gate.held_tokens(0.0) == {}
    assert ledger.gate.dropped == {"edge-1": 999_999_999 + 10 + 10 ** 9}
    assert sum(r["refused"] for r in store.usage(0, 10 ** 10, by=("key",)) if r["key"] == "web") == 3


def test_a_controller_started_again_goes_on_from_the_figures_kept(tmp_path: Path) -> None:
    """An engine's first reading counts whole (its tokens before this controller started): a new
    controller (or the next leader) that forgot what routers reported would have handed a forger
    the engines' whole past as room. The figures are kept in the store and taken up again."""
    store, ledger, engines, clock = gated(tmp_path)
    engines["chat-r1"] = ("chat", None, 10_000_000.0)
    assert ledger.record_usage(UsageBatch("edge-1/p1", 1, (row("web", 9_990_000),)))
    clock.now += 60
    ledger.save(now=True)
    _store, again, _engines, _clock = gated(tmp_path, store, engines)  # the same store, the same engines
    assert deferred(again, UsageBatch("edge-2/p1", 1, (row("victim", 9_000_000),)))
    assert charged(store, "victim") == 0


@pytest.mark.parametrize("first", ["edge-1", "edge-2"])
def test_a_forgers_waiting_batches_take_nothing_from_an_honest_one(tmp_path: Path, first: str) -> None:
    """Room the engines counted goes to whichever batch comes with it; a forger's waiting batches
    hold nothing back: each batch is judged whole when it comes, none queues ahead of another."""
    store, ledger, engines, _clock = gated(tmp_path)
    engines["chat-r1"] = ("chat", None, 0.0)
    forged = UsageBatch("edge-2/p1", 1, tuple(row(f"victim-{i}", 10_000, prompt=0) for i in range(100)))
    honest = UsageBatch("edge-1/p1", 1, (row("web", 5000, prompt=0),))
    assert deferred(ledger, forged) and deferred(ledger, honest)
    engines["chat-r1"] = ("chat", None, 5000.0)  # the engines counted the honest router's 5,000
    for batch in (honest, forged) if first == "edge-1" else (forged, honest):
        try:
            ledger.record_usage(batch)
        except UsageDeferred:
            pass
    assert charged(store, "web") == 5000 and charged(store, "victim-0") == 0


def test_figures_the_store_could_not_give_hold_routers_usage_and_are_not_written_over(tmp_path: Path) -> None:
    """A controller that could not read the kept figures (the store away at its start or takeover)
    used to start anew: every engine's whole past was room for routers' rows, and its next save
    wrote over the kept figures. Routers' batches now wait until the figures are read."""
    from llmgw.errors import StoreError

    store, ledger, engines, clock = gated(tmp_path)
    engines["chat-r1"] = ("chat", None, 10_000_000.0)
    assert ledger.record_usage(UsageBatch("edge-1/p1", 1, (row("web", 9_990_000),)))
    ledger.save(now=True)
    away = [True]

    def kept() -> object:
        if away[0]:
            raise StoreError("the store does not answer")
        return store.usage_gate_state()

    writes: list[object] = []
    again = GatedLedger(store, lambda: dict(engines), models=lambda: MODELS,
                        state=(kept, lambda figures: writes.append(figures)), clock=clock)
    forged = UsageBatch("edge-2/p1", 1, (row("victim", 9_000_000),))
    assert deferred(again, forged) and charged(store, "victim") == 0
    again.save(now=True)
    assert writes == []  # the kept figures are not written over with nothing
    away[0] = False
    assert deferred(again, forged)  # read now: the forger's rows still find no room
    assert charged(store, "victim") == 0


def test_without_a_catalog_routers_usage_waits_rather_than_being_believed(tmp_path: Path) -> None:
    """Before a catalog is known (a git restore not done), which models are served is not known:
    past HOLD a made-up model's rows were believed. They wait for a catalog, however long."""
    store = Store(tmp_path / "llmgw.db").open()
    clock = Clock()
    ledger = GatedLedger(store, lambda: {}, models=lambda: None, clock=clock)
    made_up = UsageBatch("edge-1/p1", 1, (row("victim", 50_000, model="made-up"),))
    assert deferred(ledger, made_up)
    clock.now += 10 * HOLD
    assert deferred(ledger, made_up) and charged(store, "victim") == 0
