"""Turn schema-valid documents into the frozen catalog types.

Runs after the JSON Schema layer, so shapes and types are known to be right here; what
can still be wrong is what a schema cannot say (a duration with units out of order), and
those come back as Problems beside the built object.
"""

from __future__ import annotations

from typing import Any

from llmgw.catalog.durations import DurationError, parse_duration
from llmgw.catalog.model import (
    Budget,
    GpuSpec,
    Limits,
    Model,
    ModelName,
    NodeId,
    NodeSpec,
    Profile,
    PruneGuard,
    Scaling,
    Settings,
    Tenant,
)
from llmgw.catalog.problems import Problem
from llmgw.catalog.yamlpos import Document, Path


def _duration(doc: Document, path: Path, text: str, problems: list[Problem]) -> float | None:
    try:
        seconds = parse_duration(text)
    except DurationError as exc:
        problems.append(doc.problem(path, f"{path[-1]}: {exc}"))
        return None
    if seconds <= 0:
        problems.append(doc.problem(path, f"{path[-1]}: must be longer than 0s"))
        return None
    return seconds


def build_scaling(
    doc: Document, path: Path, raw: dict[str, Any] | None, base: Scaling, problems: list[Problem]
) -> Scaling:
    raw = raw or {}
    idle_after = base.idle_after
    if "idle_after" in raw:
        idle_after = _duration(doc, path + ("idle_after",), raw["idle_after"], problems)
    return Scaling(
        min=raw.get("min", base.min),
        max=raw.get("max", base.max),
        idle_after=idle_after,
        target_inflight=raw.get("target_inflight", base.target_inflight),
    )


def build_settings(doc: Document | None, problems: list[Problem]) -> Settings:
    if doc is None:
        return Settings()
    raw = doc.data
    defaults = (raw.get("defaults") or {}).get("scaling")
    guard = raw.get("prune_guard") or {}
    return Settings(
        pools=tuple(p["name"] for p in raw.get("pools") or ()),
        default_scaling=build_scaling(doc, ("defaults", "scaling"), defaults, Scaling(), problems),
        prune_guard=PruneGuard(
            max_model_share=float(guard.get("max_model_share", 0.5)),
            max_replica_share=float(guard.get("max_replica_share", 0.5)),
        ),
        env_allow=tuple(raw.get("env_allow") or ()),
        tenants=tuple(build_tenant(t) for t in raw.get("tenants") or ()),
    )


def build_limits(raw: dict[str, Any] | None) -> Limits:
    raw = raw or {}
    budget = raw.get("budget")
    return Limits(
        requests_per_minute=raw.get("requests_per_minute"),
        tokens_per_minute=raw.get("tokens_per_minute"),
        concurrent=raw.get("concurrent"),
        budget=None if budget is None else Budget(tokens=budget["tokens"], per=budget["per"],
                                                  reset=budget.get("reset", "00:00")),
    )


def build_tenant(raw: dict[str, Any]) -> Tenant:
    return Tenant(name=raw["name"], keys=tuple(raw["keys"]), limits=build_limits(raw.get("limits")),
                  models=tuple(sorted((m, build_limits(lim)) for m, lim in (raw.get("models") or {}).items())))


def build_profile(raw: dict[str, Any], index: int) -> Profile:
    return Profile(
        name=raw["name"],
        priority=raw.get("priority", 10 * index),
        engine=raw["engine"],
        gpus=raw["gpus"],
        nodes=raw.get("nodes", 1),
        gpu_class=tuple(raw.get("gpu_class") or ()),
        gpu_memory_gb=raw.get("gpu_memory_gb"),
        memory_gb=raw.get("memory_gb"),
        pool=raw.get("pool"),
        fabric=raw.get("fabric"),
        args=tuple(raw.get("args") or ()),
        env=tuple(sorted((raw.get("env") or {}).items())),
    )


def build_model(doc: Document, settings: Settings, problems: list[Problem]) -> Model:
    raw = doc.data
    return Model(
        name=ModelName(raw["name"]),
        source=raw["source"],
        size_gb=float(raw["size_gb"]),
        profiles=tuple(build_profile(p, i) for i, p in enumerate(raw["profiles"])),
        aliases=tuple(raw.get("aliases") or ()),
        task=raw.get("task", "chat"),
        scaling=build_scaling(doc, ("scaling",), raw.get("scaling"), settings.default_scaling, problems),
        fallbacks=tuple(ModelName(f) for f in raw.get("fallbacks") or ()),
        routing=raw.get("routing", "least-outstanding"),
        file=doc.file,
    )


def build_node(raw: dict[str, Any]) -> NodeSpec:
    gpus = raw.get("gpus")
    return NodeSpec(
        id=NodeId(raw["id"]),
        address=raw["address"],
        port=raw.get("port", 22),
        user=raw.get("user", "llmgw"),
        transport=raw.get("transport", "ssh"),
        pool=raw.get("pool", "default"),
        fabric=raw.get("fabric"),
        labels=tuple(sorted((raw.get("labels") or {}).items())),
        gpus=GpuSpec(gpus["count"], gpus["class"], float(gpus["memory_gb"])) if gpus else None,
        memory_gb=raw.get("memory_gb"),
        disk_gb=raw.get("disk_gb"),
        agent_config=raw.get("agent_config"),
    )
