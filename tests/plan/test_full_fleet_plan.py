"""`llmgw diff` on a full fleet and on `llmgw up`'s: the plan never contradicts itself (seen: "cannot
place sim-chat … 2 in use" beside "GPUs free 0/2 → 1/2", and five example nodes `up` never manages
listed as "has not reported an inventory")."""

from __future__ import annotations

from dataclasses import replace

from llmgw.catalog import Catalog, RolloutPolicy
from llmgw.plan import FleetSnapshot
from llmgw.plan.plan import make_plan
from llmgw.plan.render import summary_line
from tests.placement.fleet import inventory, model, node, profile
from tests.reconciler.test_decide import replica

REPLACE = RolloutPolicy(strategy="replace", max_surge=1, max_unavailable=1)


def full_fleet():  # noqa: ANN201
    """One local node of two GPUs, both held: chat on GPU 0, embed on GPU 1; and an ssh node in the
    catalog that this controller (`up`'s) does not drive."""
    chat = replace(model("chat", profile("sim", engine="sim")), rollout=REPLACE)
    embed = model("embed", profile("sim", engine="sim"))
    local = node("local", gpus=2, held=("hf://org/chat", "hf://org/embed"))
    local = replace(local, spec=replace(local.spec, transport="local"))
    remote = node("gpu-1", gpus=8)
    reps = (replica("chat-g1", chat, node_id="local", gpu=0), replica("embed-g2", embed, node_id="local", gpu=1))
    base = Catalog(models=(chat, embed), nodes=(local.spec, remote.spec))
    snap = FleetSnapshot(inventory(local), reps, 0.0, transports=("local",))
    return base, snap, chat


def test_a_change_on_a_full_fleet_plans_the_stop_then_the_start_in_the_freed_place() -> None:
    base, snap, chat = full_fleet()
    changed = replace(chat, profiles=(replace(chat.profiles[0], args=("--ttft", "0.01")),))
    plan = make_plan(base, replace(base, models=(changed, base.models[1])), snap, now=0.0)
    assert [(s.action, s.model, s.where) for s in plan.steps] == [
        ("start", "chat", (("local", (0,)),)), ("stop", "chat", (("local", (0,)),))]
    assert "once chat-g1 has stopped" in plan.steps[0].reason
    assert plan.unplaced_counts == {} and plan.node_use == ()  # the GPU it frees, it takes again
    assert summary_line_of(plan) == "Plan: 1 to start, 1 to stop, 0 unplaceable."


def test_nodes_the_controller_does_not_drive_are_no_candidates() -> None:
    base, snap, _ = full_fleet()
    big = model("big", profile("gpu", gpus=4))  # fits the ssh node only
    plan = make_plan(base, replace(base, models=(*base.models, big)), snap, now=0.0)
    assert plan.unplaced_counts == {"big": 1}
    reasons = [(r.node, r.reason) for r in plan.unplaceable["big"]]
    assert [n for n, _ in reasons] == ["local"], reasons  # not gpu-1: "has not reported an inventory"


def summary_line_of(plan) -> str:  # noqa: ANN001
    from llmgw.plan.render import DiffReport

    return summary_line(DiffReport(base="a" * 40, head="b" * 40, changes=(), problems=(), plan=plan))
