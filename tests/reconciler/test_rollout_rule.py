"""The one rollout rule (decide.rollout_rule.transition): operators' requests as data, a revert
mid-promotion, and `llmgw diff` predicting what the controller then does, scenario by scenario."""

from __future__ import annotations

from dataclasses import replace

import pytest

from llmgw.catalog import Catalog
from llmgw.decide.rollout import Phase
from llmgw.decide.rollout_rule import (
    Abort,
    ModelRecord,
    NoRoom,
    Promote,
    Tick,
    transition,
)
from llmgw.decide.tick import CanaryWant, decide
from llmgw.plan.rollouts import plan_rollouts
from tests.placement.fleet import inventory, node
from tests.reconciler.test_decide import M, replica
from tests.reconciler.test_rollout_decide import CANARY, NEW, REPLACE, scaled

OLD1, NEW1 = scaled(M, 1), scaled(NEW, 1)
OLD2, NEW2 = scaled(M, 2), scaled(NEW, 2)


def test_promote_and_abort_say_why_they_cannot_be_done_and_change_nothing() -> None:
    rec = ModelRecord(serving=OLD2)
    cat = Catalog(models=(NEW2,))
    out = transition(rec, cat, "m", [], Promote("alice"), 1.0)
    assert out.refused == "m has no canary or rolled-back rollout to promote" and out.record is rec and out.events == ()
    out = transition(rec, cat, "m", [], Abort("alice"), 1.0)
    assert out.refused == "m has no rollout in progress to abort" and out.record is rec
    out = transition(None, cat, "x", [], Abort("alice"), 1.0)
    assert out.refused == "no model 'x' in the catalog in force"


def test_a_promotion_whose_version_before_is_unknown_cannot_be_aborted() -> None:
    reps = [replica("m-g1", OLD2), replica("m-g2", OLD2, gpu=1)]
    started = transition(None, Catalog(models=(replace(NEW2, rollout=REPLACE),)), "m", reps, Tick(), 1.0).record
    assert started is not None and started.rollout is not None and started.rollout.stable == "unknown"
    out = transition(started, Catalog(models=(replace(NEW2, rollout=REPLACE),)), "m", reps, Abort("bob"), 2.0)
    assert "the version before this rollout is not known" in out.refused


def test_a_revert_mid_promotion_goes_back_at_once() -> None:
    reps = [replica("m-g1", OLD2), replica("m-g2", OLD2, gpu=1)]
    new, old = replace(NEW2, rollout=REPLACE), replace(OLD2, rollout=REPLACE)
    rec = transition(ModelRecord(serving=old), Catalog(models=(new,), revision="b" * 40), "m", reps, Tick(), 1.0).record
    assert rec is not None and rec.rollout is not None and rec.rollout.phase == Phase.PROMOTING
    # One replica already runs the new version when the revert lands.
    reps = [replica("m-g3", new, gpu=2), reps[1]]
    out = transition(rec, Catalog(models=(old,), revision="c" * 40), "m", reps, Tick(), 2.0)
    assert out.record is not None and out.record.serving == old and out.record.previous == new
    assert out.record.rollout is not None and out.record.rollout.strategy == "replace"
    assert out.events == (("rollout-aborted", "m: revert of bbbbbbbbbbbb mid-promotion: back to the version before"),)


def controller_does(old, new, reps, inv) -> tuple[str, str, bool]:
    """What the controller does with the commit: the rule's start, decide()'s placement, the rule's
    answer to no room. (strategy, why no canary runs, judged after the change)."""
    cat = Catalog(models=(new,), revision="b" * 40)
    rec = transition(ModelRecord(serving=old), cat, "m", reps, Tick(), 1.0).record
    assert rec is not None and rec.rollout is not None
    if rec.rollout.phase != Phase.CANARY:
        return "replace", "", False
    d = decide(Catalog(models=(old,)), inv, reps, last_used={}, demand={}, now=1.0,
               canaries={"m": CanaryWant(spec=new)})
    why = d.no_canary_room.get("m", "")
    if not why:
        return "canary", "", False
    after = transition(rec, cat, "m", reps, NoRoom(why), 1.0).record
    assert after is not None and after.rollout is not None
    return "canary", why, after.rollout.before is not None


SCENARIOS = {
    "room beside": (OLD2, NEW2, 2, 3),
    "full, two replicas: one makes room": (OLD2, NEW2, 2, 2),
    "full, the only replica": (OLD1, NEW1, 1, 1),
    "full, max_unavailable 0": (scaled(M, 2, replace(CANARY, max_unavailable=0)),
                                scaled(NEW, 2, replace(CANARY, max_unavailable=0)), 2, 2),
    "replace": (scaled(M, 2, REPLACE), scaled(NEW, 2, REPLACE), 2, 2),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_llmgw_diff_predicts_what_the_controller_does(name: str) -> None:
    old, new, n, gpus = SCENARIOS[name]
    reps = [replica(f"m-g{i + 1}", old, gpu=i) for i in range(n)]
    inv = inventory(node("a", gpus=gpus))
    strategy, why, judged_after = controller_does(old, new, reps, inv)
    (plan,) = plan_rollouts(Catalog(models=(old,)), Catalog(models=(new,), revision="b" * 40), inv, reps, now=1.0)
    assert (plan.strategy, plan.blocked, plan.judged_after) == (strategy, why, judged_after)
    # The single replica on a full fleet is the one a reviewer must be told about plainly.
    assert bool(plan.unjudged) == (strategy == "replace" or judged_after)


def test_a_commit_that_skips_analysis_is_replaced_in_the_diff_as_on_the_controller() -> None:
    reps = [replica("m-g1", OLD2), replica("m-g2", OLD2, gpu=1)]
    head = replace(Catalog(models=(NEW2,), revision="b" * 40), skip_analysis=True)
    rec = transition(ModelRecord(serving=OLD2), head, "m", reps, Tick(), 1.0).record
    assert rec is not None and rec.rollout is not None and rec.rollout.phase == Phase.PROMOTING
    (plan,) = plan_rollouts(Catalog(models=(OLD2,)), head, inventory(node("a", gpus=3)), reps, now=1.0)
    assert plan.strategy == "replace" and plan.unjudged.startswith("strategy replace")
