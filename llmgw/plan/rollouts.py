"""The rollout a change will get, for `llmgw diff` (DESIGN §5, Rollouts). Pure.

The controller's own rule says it (llmgw.decide.rollout_rule.transition, asked with the base's
record): a model whose change reaches replicas of it that run is rolled out by its policy, a
canary judged step by step, or replacement; where no canary fits, the rule's answer to "no room"
(judged after the change, or waiting, or given up) is what the diff shows. Either way new
replicas start beside the old ones only where the fleet has room (a GPU fleet is usually full);
where it has none, ``max_unavailable`` old replicas are stopped first. A reviewer should know
which before merging: on a full fleet the change costs capacity while it rolls out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from llmgw.catalog import Catalog, Model
from llmgw.catalog.durations import format_duration
from llmgw.decide.replica import Replica
from llmgw.decide.rollout import Phase, Rollout, duration_at_least
from llmgw.decide.rollout_rule import ModelRecord, NoRoom, Tick, canary_blocked, transition
from llmgw.decide.tick import holding
from llmgw.inventory import Inventory
from llmgw.placement import Placement, place


@dataclass(frozen=True)
class RolloutPlan:
    model: str
    strategy: str  # "canary" | "replace"
    steps: tuple[float, ...]
    interval: float
    at_least: float  # seconds: every step's interval (0 for replace)
    replicas: int  # of the old version running now
    room_to_surge: bool  # one more replica of the new version fits beside the running ones
    max_surge: int
    max_unavailable: int
    acceptance: int = 0  # acceptance prompts each new replica answers first
    live: str = ""  # the rollout of this model under way on the controller, in words
    judged_after: bool = False  # no canary can run: replaced, then judged against the old version's figures
    blocked: str = ""  # why no canary can run beside the stable replicas ("" when one can)

    @property
    def unjudged(self) -> str:
        """Why the new version will reach clients without a canary's analysis ("" when it has one)."""
        if self.strategy != "canary":
            why = "strategy replace"
        elif self.judged_after:
            why = ("a single replica and no room for a canary beside it: it takes all traffic at once, judged "
                   "after against the old version's figures and reverted if worse")
        else:
            return ""
        first = (f"each new replica answers {self.acceptance} acceptance prompt(s) first" if self.acceptance
                 else "no acceptance prompts either")
        return f"{why}: no canary analysis; {first}"

    @property
    def how(self) -> str:
        """How the new version reaches the replicas, in words."""
        if self.max_unavailable < 1 and (not self.room_to_surge or self.max_surge < 1):
            return "no room to start a new replica beside the old and max_unavailable 0: waits for free GPUs"
        if self.room_to_surge and self.max_surge > 0:
            return f"room to surge: new replicas start beside the old, {self.max_surge} at a time"
        why = "max_surge 0" if self.max_surge < 1 else "no room to surge"
        if self.strategy == "canary" and self.blocked and not self.judged_after:
            return f"{why}: {self.blocked}: the canary waits (the controller says so in `llmgw rollout status`)"
        if self.judged_after:
            return (f"{why} and a single replica: replaced {self.max_unavailable} at a time, then judged against the "
                    "old version's figures")
        canary = " (the canary takes a stable replica's place)" if self.strategy == "canary" else ""
        return f"{why}: {self.max_unavailable} old replica(s) stopped at a time before the new start{canary}"

    @property
    def policy_text(self) -> str:
        if self.strategy != "canary":
            return "replace"
        steps = ", ".join(f"{s:g} %" for s in self.steps)
        return f"canary, steps {steps}, {format_duration(self.interval)} each"

    @property
    def at_least_text(self) -> str:
        return f"at least {format_duration(self.at_least)}" if self.strategy == "canary" else "-"

    def text(self) -> str:
        longest = f", {self.at_least_text}" if self.strategy == "canary" else ""
        live = f"; now: {self.live}" if self.live else ""
        return f"{self.model}: {self.policy_text}{longest}; {self.how}{live}"

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "strategy": self.strategy, "steps": list(self.steps), "interval": self.interval,
                "at_least_seconds": self.at_least, "replicas": self.replicas, "room_to_surge": self.room_to_surge,
                "max_surge": self.max_surge, "max_unavailable": self.max_unavailable, "how": self.how,
                "acceptance": self.acceptance, "unjudged": self.unjudged or None, "live": self.live or None,
                "judged_after": self.judged_after, "blocked": self.blocked or None,
                "text": self.text()}


def plan_rollouts(base: Catalog | None, head: Catalog, inventory: Inventory, replicas: list[Replica], *,
                  now: float, starts: Sequence[Placement] = (),
                  live: Sequence[Rollout] = ()) -> tuple[RolloutPlan, ...]:
    """Per model whose version ``head`` changes and which has live replicas: its rollout.

    Room is judged by placing one extra replica of the new version on ``inventory`` with what
    holds GPUs now, as the tick places a canary or a replacement beside the old ones, and with
    ``starts``: the new replicas of other models the same change places (a model added in the
    same commit may take the last free GPU)."""
    if base is None:
        return ()
    holds = holding(inventory, replicas)
    out = []
    for model in head.models:
        before = base.model(model.name)
        if before is None:
            continue
        # The controller's rule, asked as if the base were in force: a commit that leaves the
        # engines as the base has them starts nothing (a model rolled back stays so when a later
        # commit changes only its scaling), nor one that changes nothing running.
        started = transition(ModelRecord(serving=before), head, model.name, replicas, Tick(), now).record
        if started is None or started.rollout is None or not started.rollout.phase.active:
            continue
        running = [r for r in replicas if r.model == model.name and r.state.live and not r.canary]
        held = holds + [p for p in starts if p.model != model.name]
        plan = _one(head, model, inventory, held, running, started, now=now)
        out.append(replace(plan, live=live_text(next((r for r in live if r.model == model.name), None))))
    return tuple(out)


def live_text(r: Rollout | None) -> str:
    """A rollout under way, in words ("" for none or one that ended): the change supersedes it."""
    if r is None or not r.phase.active:
        return ""
    if r.phase == Phase.CANARY:
        return f"a canary of {_rev(r.revision)} is at step {r.step + 1}; this change supersedes it"
    return f"{_rev(r.revision)} is replacing the replicas; this change supersedes it"


def _rev(sha: str | None) -> str:
    return f"revision {sha[:12]}" if sha else "an earlier revision"


def _fits(head: Catalog, inventory: Inventory, held: list[Placement], name: str, now: float) -> bool:
    return bool(place(head, inventory, held, now=now, wanted={name: 1}, reasons=False).placements)


def _one(head: Catalog, model: Model, inventory: Inventory, held: list[Placement], running: list[Replica],
         started: ModelRecord, *, now: float) -> RolloutPlan:
    room = _fits(head, inventory, held, model.name, now)
    p = model.rollout
    ro = started.rollout
    assert ro is not None
    canary = ro.phase == Phase.CANARY  # the policy's, unless the commit's trailer skips analysis
    blocked, judged_after = "", False
    if canary and not (room and p.max_surge > 0):
        # No room beside: what the tick would say (decide.tick) and what the rule does with it.
        first = running[0] if running else None
        instead = first is not None and _fits(head, inventory, [h for h in held if h is not first.placement],
                                              model.name, now)
        why = canary_blocked(p.max_unavailable, stable=len(running), fits_instead=instead, missing=0, first_ready=True)
        if why is not None:
            blocked = why
            after = transition(started, head, model.name, running, NoRoom(why), now).record
            judged_after = after is not None and after.rollout is not None and after.rollout.before is not None
    return RolloutPlan(model.name, "canary" if canary else "replace", tuple(p.steps) if canary else (), p.interval,
                       duration_at_least(p) if canary else 0.0, len(running), room, p.max_surge, p.max_unavailable,
                       len(p.acceptance), judged_after=judged_after, blocked=blocked)
