"""`llmgw diff` output: text for a terminal, markdown for a PR comment, JSON for machines."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llmgw import safetext
from llmgw.catalog import Problem
from llmgw.catalog.durations import format_duration
from llmgw.placement.explain import shard_lines, shard_text
from llmgw.plan.changes import Change, _show
from llmgw.plan.plan import NodeUse, Plan, Step

MARKDOWN_LIMIT = 65_536  # GitHub's limit on a comment body


@dataclass(frozen=True)
class DiffReport:
    base: str
    head: str
    changes: tuple[Change, ...]
    problems: tuple[Problem, ...]
    plan: Plan | None
    fleet_note: str = ""
    # What the controller would accept but say in its status (a tenant naming a key no router has).
    warnings: tuple[str, ...] = ()

    @property
    def changed(self) -> bool:
        return bool(self.changes) or bool(self.plan and not self.plan.empty)


def summary_line(report: DiffReport) -> str:
    """One line a reviewer can take at its word. With problems, the controller rejects the commit
    as a whole (seen: "2 problems … No changes.", when the change was a rejected commit)."""
    n = len(report.problems)
    if not n:
        return _plan_summary(report)
    rest = _plan_summary(report)
    return (f"{n} problem{'s' * (n != 1)} in the catalog: the controller rejects this commit as it is and keeps "
            f"the catalog in force. Without the broken files: {rest[0].lower() + rest[1:]}")


def _plan_summary(report: DiffReport) -> str:
    plan = report.plan
    if plan is None:
        n = len(report.changes)
        return f"Plan: {n} catalog change{'s' * (n != 1)}, no fleet to plan against." if n else "No changes."
    if plan.empty:
        return "No changes." if not report.changes else "Plan: catalog changes only, nothing to do on the fleet."
    unplaced = sum(plan.unplaced_counts.values())
    parts = [f"{plan.count('start')} to start"]
    if plan.count("replace"):
        parts.append(f"{plan.count('replace')} to replace")
    parts += [f"{plan.count('stop')} to stop", f"{unplaced} unplaceable"]
    return "Plan: " + ", ".join(parts) + "."


def rollouts_line(plan: Plan | None) -> str | None:
    """'Rollouts: 1 canary (at least 3m), 1 replace, 1 without room to surge (max_unavailable at a
    time).' when the change rolls out a model that runs, else None (a line beside the summary)."""
    if plan is None or not plan.rollouts:
        return None
    canary = [r for r in plan.rollouts if r.strategy == "canary"]
    parts = []
    if canary:
        longest = max(r.at_least for r in canary)
        parts.append(f"{len(canary)} canary (at least {format_duration(longest)})")
    if len(canary) < len(plan.rollouts):
        parts.append(f"{len(plan.rollouts) - len(canary)} replace")
    tight = sum(1 for r in plan.rollouts if not (r.room_to_surge and r.max_surge > 0))
    if tight:
        parts.append(f"{tight} without room to surge (max_unavailable at a time)")
    return "Rollouts: " + ", ".join(parts) + "."


NO_CANDIDATE = "no node in nodes.yaml to try"
NO_FLEET = "pass --url URL (with --token) or --snapshot FILE from `llmgw inventory export`"


@dataclass(frozen=True)
class FreeUse:
    """A node's room before and after the change, as `llmgw nodes` counts it: free of total.

    The plan computes what is used; a reviewer reads this beside `llmgw nodes` (GPUS FREE/TOTAL,
    DISK FREE/TOTAL GB), and "1/2" meaning "used" in one and "free" in the other is the
    misreading this prevents.
    """

    gpus_total: int
    gpus_free_before: int
    gpus_free_after: int
    disk_total_gb: float | None
    disk_free_before_gb: float | None
    disk_free_after_gb: float | None

    @classmethod
    def of(cls, u: NodeUse) -> FreeUse:
        def free(used: float | None) -> float | None:
            return None if used is None or u.disk_total_gb is None else round(u.disk_total_gb - used, 1)

        return cls(u.gpus_total, u.gpus_total - u.gpus_before, u.gpus_total - u.gpus_after,
                   u.disk_total_gb, free(u.disk_before_gb), free(u.disk_after_gb))

    def gpus_text(self) -> str:
        return f"{self.gpus_free_before}/{self.gpus_total} → {self.gpus_free_after}/{self.gpus_total}"

    def disk_text(self) -> str | None:
        if self.disk_total_gb is None:
            return None
        t = self.disk_total_gb
        return f"{self.disk_free_before_gb:g}/{t:g} → {self.disk_free_after_gb:g}/{t:g} GB"


def prune_line(plan: Plan | None, *, esc: Callable[[str], str] = str) -> str | None:
    """The guard's verdict when the commit stops a ready replica (or removes a model), else None.

    ``esc`` makes the guard's reasons (they name models) safe for the output format."""
    v = plan.prune if plan is not None else None
    if v is None or not (v.held or v.replicas_stopped or v.models_removed):
        return None
    if v.held:
        return ("Prune guard: this commit would be held for confirmation (" + "; ".join(map(esc, v.reasons))
                + "); add the trailer `Llmgw-Allow-Prune: yes` or run `llmgw sync --allow-prune` after it lands.")
    return (f"Prune guard: passes (stops {v.replicas_stopped} of {v.replicas_ready} ready replicas, "
            f"removes {len(v.models_removed)} model(s): within the limits).")


# --- text --------------------------------------------------------------------------------
def render_text(r: DiffReport) -> str:
    out = [f"llmgw diff {r.base} → {r.head}", ""]
    out.append("Catalog changes:")
    if not r.changes:
        out.append("  (none)")
    for c in r.changes:
        out.append(f"  {c.op} {c.kind} {c.name}")
        for f in c.fields:
            out.append(f"      {f.text() if c.op == '~' else f'{f.path}: {_show(f.after)}'}")
    out += ["", "Validation:"]
    out += [f"  {p}" for p in r.problems] or ["  ok"]
    out += [f"  warning: {w}" for w in r.warnings]
    out += ["", "Plan against the fleet" + (f" ({r.fleet_note})" if r.fleet_note else "") + ":"]
    p = r.plan
    if p is None:
        out.append(f"  (no fleet: {NO_FLEET})")
    else:
        if p.empty:
            out.append("  (nothing to do)")
        for s in p.steps:
            if s.action == "start":
                out.append(f"  + start   {s.model}/{s.profile} on {s.where_text()}  ({s.reason})")
            elif s.action == "replace":
                out.append(f"  ~ replace {s.replica} with {s.model}/{s.profile} on {s.where_text()}  ({s.reason})")
            else:
                out.append(f"  - stop    {s.replica} ({s.model}/{s.profile} on {s.where_text()})  ({s.reason})")
            out += shard_lines(s.placement, indent="      ") if s.placement else []
        for model, n in sorted(p.unplaced_counts.items()):
            out.append(f"  ! cannot place {model} ({n} replica{'s' * (n != 1)}):")
            for x in p.unplaceable.get(model, ()):
                out.append(f"      {x.profile} on {x.node}: {x.reason}")
            if not p.unplaceable.get(model):
                out.append(f"      {NO_CANDIDATE}")
        if p.still_unplaced:
            names = ", ".join(f"{m} ({n})" for m, n in sorted(p.still_unplaced.items()))
            out.append(f"  (still cannot be placed, as before this change: {names}; see `llmgw explain`)")
        for node, model, gb, source in p.fetches:
            out.append(f"  fetch   {node}: weights of {model} ({gb:g} GB) from {source}")
        for node, name, gb in p.new_orphans:
            out.append(f"  orphan  {node}: {name} ({gb:g} GB) — `llmgw weights collect --collect` removes it")
        for u in p.node_use:
            free = FreeUse.of(u)
            disk = free.disk_text()
            out.append(f"  {u.node}: GPUs free {free.gpus_text()}" + (f", disk free {disk}" if disk else ""))
        for model, why in p.without_ready:
            out.append(f"  no ready replica during the change: {model} ({why})")
        for ro in p.rollouts:
            out.append(f"  rollout {ro.text()}")
        for ro in p.rollouts:  # said plainly, not as one line among others
            if ro.unjudged:
                out.append(f"  ! {ro.model} goes out UNJUDGED: {ro.unjudged}")
    out.append("")
    prune = prune_line(p)
    if prune:
        out += [prune, ""]
    rollouts = rollouts_line(p)
    if rollouts:
        out.append(rollouts)
    out.append(summary_line(r))
    # Every line is ours around catalog text; escaping whole lines reaches every piece of that text.
    return "\n".join(map(safetext.visible, out)) + "\n"


# --- markdown ----------------------------------------------------------------------------
def _md(text: Any) -> str:
    """Catalog text in the comment: shown, never formatted (llmgw.safetext.markdown)."""
    return safetext.markdown(text)


def _code(text: Any) -> str:
    # <code>, not a backtick span: a backtick in the text would end the span early.
    return f"<code>{_md(text)}</code>"


def render_markdown(r: DiffReport) -> str:
    out = [f"### llmgw diff {_code(r.base)} → {_code(r.head)}", "", f"**{summary_line(r)}**", ""]
    rollouts = rollouts_line(r.plan)
    if rollouts:
        out += [_md(rollouts), ""]
    prune = prune_line(r.plan, esc=_md)
    if prune:
        out += [f"> :warning: {prune}", ""]
    if r.problems:
        out += ["#### :x: Validation", ""] + [f"- {_code(f'{p.file}:{p.line}:{p.col}')}: {_md(p.message)}"
                                               for p in r.problems] + [""]
    out += [f"> :warning: {_md(w)}" for w in r.warnings] + ([""] if r.warnings else [])
    if r.changes:
        out += ["#### Catalog changes", ""]
        for c in r.changes:
            out.append(f"<details><summary><code>{c.op}</code> {_md(c.kind)} <b>{_md(c.name)}</b></summary>")
            out.append("")
            if c.fields:
                out += ["| field | before | after |", "|---|---|---|"]
                out += [f"| {_code(f.path)} | {_md(_show(f.before)) if c.op == '~' else ''} | {_md(_show(f.after))} |"
                        for f in c.fields]
                out.append("")
            out += ["</details>", ""]
    p = r.plan
    out += ["#### Plan against the fleet" + (f" ({_md(r.fleet_note)})" if r.fleet_note else ""), ""]
    if p is None:
        out += ["No fleet given: pass `--url URL` (with `--token`) or `--snapshot FILE`.", ""]
    else:
        if p.steps:
            out += ["| action | model | where | why |", "|---|---|---|---|"]
            for s in p.steps:
                what = f"replace {_code(s.replica)}" if s.action == "replace" else s.action
                if s.action == "stop":
                    what = f"stop {_code(s.replica)}"
                out.append(f"| {what} | {_md(s.model)}/{_md(s.profile)} | {_where_md(s)} | {_md(s.reason)} |")
            out.append("")
        for model, n in sorted(p.unplaced_counts.items()):
            out.append(f"<details><summary>:x: cannot place <b>{_md(model)}</b> ({n})</summary>")
            out.append("")
            out += [f"- {_md(x.profile)} on {_md(x.node)}: {_md(x.reason)}" for x in p.unplaceable.get(model, ())] \
                or [f"- {NO_CANDIDATE}"]
            out += ["", "</details>", ""]
        if p.still_unplaced:
            names = ", ".join(f"{_md(m)} ({n})" for m, n in sorted(p.still_unplaced.items()))
            out += [f"_Still cannot be placed, as before this change: {names}._", ""]
        if p.fetches:
            out += ["**Weights to fetch:** " + ", ".join(f"{_md(n)}: {_md(m)} ({gb:g} GB) from {_code(src)}"
                                                         for n, m, gb, src in p.fetches),
                    ""]
        if p.new_orphans:
            out += ["**Weights that become orphans:** " + ", ".join(f"{_md(n)}: {_code(x)} ({gb:g} GB)"
                                                                     for n, x, gb in p.new_orphans), ""]
        if p.node_use:
            out += ["| node | GPUs free/total | disk free/total |", "|---|---|---|"]
            for u in p.node_use:
                free = FreeUse.of(u)
                out.append(f"| {_md(u.node)} | {free.gpus_text()} | {free.disk_text() or 'shared'} |")
            out.append("")
        for model, why in p.without_ready:
            out.append(f"- :hourglass: no ready replica during the change: **{_md(model)}** ({_md(why)})")
        if p.rollouts:
            out += ([""] if out[-1] else []) + ["| rollout | strategy | how long | room |", "|---|---|---|---|"]
            out += [f"| {_md(ro.model)} | {_md(ro.policy_text)} | {ro.at_least_text} | {_md(ro.how)}"
                    f"{_md('; now: ' + ro.live) if ro.live else ''} |" for ro in p.rollouts]
            out += [f"\n> :warning: **{_md(ro.model)} goes out unjudged**: {_md(ro.unjudged)}"
                    for ro in p.rollouts if ro.unjudged]
    text = "\n".join(out).rstrip() + "\n"
    if len(text) > MARKDOWN_LIMIT:
        note = "\n\n_…truncated: the full plan is longer than a PR comment allows; run `llmgw diff` locally._\n"
        text = text[: MARKDOWN_LIMIT - len(note)] + note
    return text


def _where_md(s: Step) -> str:
    """The step's nodes; for a replica across nodes, each shard by rank with what its node holds."""
    lines = shard_lines(s.placement, indent="") if s.placement else []
    return "<br>".join(_md(x) for x in lines) if lines else _md(s.where_text())


def _shards_json(s: Step) -> list[dict[str, Any]]:
    # Ranks and what each node holds only for a replica across nodes: a single-node step's shard
    # stays {node, gpus} as before (tools reading the plan already parse it).
    if s.placement is None or len(s.placement.shards) < 2:
        return [{"node": n, "gpus": list(g)} for n, g in s.where]
    return [{"node": x.node, "gpus": list(x.gpus), "rank": x.rank, "role": "head" if x.rank == 0 else "worker",
             "holds_weights": x.holds_weights, "text": shard_text(x, s.placement)} for x in s.placement.shards]


def render_error_markdown(message: str) -> str:
    """`llmgw diff --format markdown` when it could not run: a comment that says so and why."""
    # Line by line: a newline stays one (the fence keeps it literal), any other control is shown.
    message = "\n".join(map(safetext.visible, message.split("\n")))
    fence = "`" * max(3, _longest_backtick_run(message) + 1)  # the message cannot close the block
    text = f"### :x: llmgw diff could not run\n\n{fence}text\n{message}\n{fence}\n"
    tail = f"\n…\n{fence}\n"
    return text if len(text) <= MARKDOWN_LIMIT else text[: MARKDOWN_LIMIT - len(tail)] + tail


def _longest_backtick_run(text: str) -> int:
    best = run = 0
    for ch in text:
        run = run + 1 if ch == "`" else 0
        best = max(best, run)
    return best


# --- json --------------------------------------------------------------------------------
def render_json(r: DiffReport) -> dict[str, Any]:
    p = r.plan
    return {
        "base": r.base,
        "head": r.head,
        "summary": summary_line(r),
        "rollouts_summary": rollouts_line(p),
        "changed": r.changed,
        "changes": [{"kind": c.kind, "name": c.name, "op": c.op,
                     "fields": [{"path": f.path, "before": f.before, "after": f.after} for f in c.fields]}
                    for c in r.changes],
        "problems": [x.to_json() for x in r.problems],
        "warnings": list(r.warnings),
        "plan": None if p is None else {
            "steps": [{"action": s.action, "model": s.model, "profile": s.profile, "replica": s.replica,
                       "shards": _shards_json(s), "reason": s.reason}
                      for s in p.steps],
            "unplaceable": {m: {"replicas": n, "rejections": [
                {"profile": x.profile, "node": x.node, "reason": x.reason} for x in p.unplaceable.get(m, ())]}
                for m, n in sorted(p.unplaced_counts.items())},
            "fetches": [{"node": n, "model": m, "gb": gb, "source": src} for n, m, gb, src in p.fetches],
            "new_orphans": [{"node": n, "name": x, "gb": gb} for n, x, gb in p.new_orphans],
            # The used counts as planned, and the free ones `llmgw nodes -o json` (gpu_free) compares with.
            "node_use": [{**u.__dict__, **FreeUse.of(u).__dict__} for u in p.node_use],
            "without_ready": [{"model": m, "why": w} for m, w in p.without_ready],
            "still_unplaced": dict(sorted(p.still_unplaced.items())),
            "rollouts": [ro.to_json() for ro in p.rollouts],
            "prune_guard": None if p.prune is None else {
                "held": p.prune.held, "reasons": list(p.prune.reasons),
                "replicas_stopped": p.prune.replicas_stopped, "replicas_ready": p.prune.replicas_ready,
                "causes": [{"replica": rid, "cause": why} for rid, why in p.prune.causes]},
        },
    }
