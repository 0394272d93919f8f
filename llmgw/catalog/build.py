"""Turn schema-valid documents into the frozen catalog types.

Runs after the JSON Schema layer, so shapes and types are known to be right here; what
can still be wrong is what a schema cannot say (a duration with units out of order), and
those come back as Problems beside the built object.
"""

from __future__ import annotations

import json
from typing import Any

from llmgw.catalog.durations import DurationError, parse_duration
from llmgw.catalog.model import (
    Acceptance,
    Budget,
    CanaryChecks,
    GpuSpec,
    Limits,
    Model,
    ModelName,
    NodeId,
    NodeSpec,
    Profile,
    PruneGuard,
    RolloutPolicy,
    Scaling,
    Settings,
    Tenant,
)
from llmgw.catalog.problems import Problem
from llmgw.catalog.semantic import acceptance_problems, rollout_problems
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


def build_rollout(
    doc: Document, path: Path, raw: dict[str, Any] | None, base: RolloutPolicy, problems: list[Problem]
) -> RolloutPolicy:
    """``base`` (llmgw.yaml's default, or the built-in one for that default itself) with the fields
    ``raw`` sets, ``checks`` key by key; the rules a schema cannot say are reported at their keys."""
    raw = raw or {}
    # A duration that does not parse is reported here, once; the range rule judges only real ones.
    written = _duration(doc, path + ("interval",), raw["interval"], problems) if "interval" in raw else None
    timeout = (_duration(doc, path + ("traffic_timeout",), raw["traffic_timeout"], problems)
               if "traffic_timeout" in raw else None)
    checks = raw.get("checks") or {}
    policy = RolloutPolicy(
        strategy=raw.get("strategy", base.strategy),
        steps=tuple(float(s) for s in raw["steps"]) if "steps" in raw else base.steps,
        interval=base.interval if written is None else written,
        checks=CanaryChecks(
            error_rate=float(checks.get("error_rate", base.checks.error_rate)),
            ttft_p95=float(checks.get("ttft_p95", base.checks.ttft_p95)),
            itl_p95=float(checks.get("itl_p95", base.checks.itl_p95)),
            min_requests=checks.get("min_requests", base.checks.min_requests),
        ),
        max_surge=raw.get("max_surge", base.max_surge),
        max_unavailable=raw.get("max_unavailable", base.max_unavailable),
        traffic_timeout=base.traffic_timeout if timeout is None else timeout,
        on_no_traffic=raw.get("on_no_traffic", base.on_no_traffic),
        acceptance=(tuple(build_acceptance(doc, path + ("acceptance", i), a, i, problems)
                          for i, a in enumerate(raw["acceptance"])) if "acceptance" in raw else base.acceptance),
    )
    problems += rollout_problems(doc, path, raw, policy, interval=written)
    return policy


def build_acceptance(doc: Document, path: Path, raw: dict[str, Any], i: int, problems: list[Problem]) -> Acceptance:
    """One acceptance prompt; what a schema cannot say (one of messages or prompt, a regular
    expression that compiles, a JSON Schema that is one) is reported at its key."""
    expect = raw.get("expect") or {}
    latency = _duration(doc, path + ("latency",), raw["latency"], problems) if "latency" in raw else None
    problems += acceptance_problems(doc, path, raw)
    schema = expect.get("json_schema")
    return Acceptance(
        name=raw.get("name") or f"acceptance[{i}]",
        messages=tuple((m["role"], m["content"]) for m in raw.get("messages") or ()),
        prompt=raw.get("prompt"),
        max_tokens=raw.get("max_tokens", 32),
        contains=tuple(expect.get("contains") or ()),
        not_contains=tuple(expect.get("not_contains") or ()),
        matches=expect.get("matches"),
        json_schema=json.dumps(schema, sort_keys=True) if schema is not None else None,
        latency=latency,
    )


def build_settings(doc: Document | None, problems: list[Problem]) -> Settings:
    if doc is None:
        return Settings()
    raw = doc.data
    defaults = raw.get("defaults") or {}
    guard = raw.get("prune_guard") or {}
    return Settings(
        pools=tuple(p["name"] for p in raw.get("pools") or ()),
        default_scaling=build_scaling(doc, ("defaults", "scaling"), defaults.get("scaling"), Scaling(), problems),
        default_rollout=build_rollout(doc, ("defaults", "rollout"), defaults.get("rollout"), RolloutPolicy(),
                                      problems),
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
        rollout=build_rollout(doc, ("rollout",), raw.get("rollout"), settings.default_rollout, problems),
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
