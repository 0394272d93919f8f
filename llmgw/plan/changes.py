"""Catalog changes field by field, the way reviewers read terraform and flux plans.

Pure: two catalogs in, a list of per-model (and per-node) changes out. Compared on the
catalog's own data, so a change of comment or key order is no change.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from llmgw.catalog import Catalog, Model, NodeSpec, Settings
from llmgw.catalog.durations import format_duration


@dataclass(frozen=True)
class FieldChange:
    path: str
    before: Any
    after: Any

    def text(self) -> str:
        return f"{self.path}: {_show(self.before)} → {_show(self.after)}"


@dataclass(frozen=True)
class Change:
    kind: str  # "model" | "node" | "settings"
    name: str
    op: str  # "+" added, "-" removed, "~" changed
    fields: tuple[FieldChange, ...] = ()


def _show(v: Any) -> str:
    if v is None:
        return "(none)"
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_show(x) for x in v) + "]"
    if isinstance(v, str):
        return v
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v)


def model_fields(m: Model) -> dict[str, Any]:
    """A model as flat, comparable ``path → value`` pairs (profiles keyed by name)."""
    out: dict[str, Any] = {
        "aliases": list(m.aliases), "task": m.task, "source": m.source, "size_gb": m.size_gb,
        "scaling.min": m.scaling.min, "scaling.max": m.scaling.max,
        "scaling.idle_after": format_duration(m.scaling.idle_after) if m.scaling.idle_after else None,
        "scaling.target_inflight": m.scaling.target_inflight, "fallbacks": list(m.fallbacks),
        "routing": m.routing,
    }
    # The rollout block, so a review sees a change of how changes roll out (not part of the version).
    out.update(_flatten(asdict(m.rollout), "rollout."))
    out["rollout.interval"] = format_duration(m.rollout.interval)
    for p in m.profiles:
        d = asdict(p)
        d.pop("name")
        d["env"] = {k: v for k, v in p.env}
        for k, v in d.items():
            out[f"profiles.{p.name}.{k}"] = list(v) if isinstance(v, tuple) else v
    return out


def node_fields(n: NodeSpec) -> dict[str, Any]:
    d = asdict(n)
    gpus = d.pop("gpus")
    d["labels"] = {k: v for k, v in n.labels}
    if gpus:
        d.update({"gpus.count": gpus["count"], "gpus.class": gpus["gpu_class"], "gpus.memory_gb": gpus["memory_gb"]})
    d.pop("id")
    return d


def _diff(before: dict[str, Any], after: dict[str, Any]) -> tuple[FieldChange, ...]:
    keys = list(before) + [k for k in after if k not in before]
    return tuple(FieldChange(k, before.get(k), after.get(k)) for k in keys if before.get(k) != after.get(k))


def catalog_changes(base: Catalog | None, head: Catalog) -> list[Change]:
    """Models and nodes added, removed and changed between ``base`` and ``head``."""
    out = _entity_changes("model", {m.name: model_fields(m) for m in (base.models if base else ())},
                          {m.name: model_fields(m) for m in head.models})
    out += _entity_changes("node", {n.id: node_fields(n) for n in (base.nodes if base else ())},
                           {n.id: node_fields(n) for n in head.nodes})
    if base is not None and base.settings != head.settings:
        fields = _diff(settings_fields(base.settings), settings_fields(head.settings))
        if fields:
            out.append(Change("settings", "llmgw.yaml", "~", fields))
    return out


def settings_fields(s: Settings) -> dict[str, Any]:
    """Settings as flat pairs; tenants keyed by name, each limit its own field
    (``tenants.search.models.big.budget.tokens``), so a review sees which limit moved."""
    d = asdict(s)
    d.pop("tenants")
    out = _flatten(d)
    for t in s.tenants:
        out[f"tenants.{t.name}.keys"] = list(t.keys)
        out.update(_flatten(asdict(t.limits), f"tenants.{t.name}.limits."))
        for model, limits in t.models:
            out.update(_flatten(asdict(limits), f"tenants.{t.name}.models.{model}."))
    return out


def _entity_changes(kind: str, old: dict[str, dict[str, Any]], new: dict[str, dict[str, Any]]) -> list[Change]:
    out = []
    for name in sorted(set(old) | set(new)):
        if name not in old:
            out.append(Change(kind, name, "+", _added(new[name])))
        elif name not in new:
            out.append(Change(kind, name, "-"))
        else:
            fields = _diff(old[name], new[name])
            if fields:
                out.append(Change(kind, name, "~", fields))
    return out


def _added(fields: dict[str, Any]) -> tuple[FieldChange, ...]:
    """The fields of something new, leaving out the empty ones a reviewer need not read, and the
    rollout policy (a new model has nothing to roll out; the policy shows when it changes)."""
    return tuple(FieldChange(k, None, v) for k, v in fields.items()
                 if v not in (None, [], {}, "") and not k.startswith("rollout."))


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = list(v) if isinstance(v, tuple) else v
    return out
