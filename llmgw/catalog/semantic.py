"""Second layer of validation: the rules a JSON Schema cannot express.

Each rule takes built objects plus the documents they came from (for `file:line`) and
returns Problems; none of them stops at the first finding, so an operator fixes a
catalog in one pass instead of one error per push.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import jsonschema

from llmgw.agent.parts.peerflags import PEER_FLAGS, _table_flag
from llmgw.agent.parts.protocol import DEFAULT_ENV_ALLOW, S3_SOURCE_RE
from llmgw.catalog.model import Model, NodeSpec, Profile, RolloutPolicy, Settings
from llmgw.catalog.problems import Problem
from llmgw.catalog.schema import dotted
from llmgw.catalog.yamlpos import Document
from llmgw.catalog.yamlpos import Path as KeyPath


@dataclass(frozen=True)
class ModelEntry:
    model: Model
    doc: Document


@dataclass(frozen=True)
class NodeEntry:
    node: NodeSpec
    doc: Document
    index: int


# What a shell would give meaning to. Sources end up in argv lists, never a shell, but a
# source carrying these is a mistake or an attack either way, and refusing it here means
# no later part has to be careful twice.
_SHELL_CHARS = set(";&|`$<>'\"\\(){}*?!#~\n\r\t ")
_HF = re.compile(r"^hf://[A-Za-z0-9._-]+/[A-Za-z0-9._-]+(@[A-Za-z0-9._/-]+)?$")


def source_problem(source: str) -> str | None:
    """Why ``source`` is unusable, or None. Known schemes: hf, s3, http(s), file, absolute path."""
    bad = sorted({c for c in source if c in _SHELL_CHARS or not c.isprintable()})
    if bad:
        shown = ", ".join(repr(c) for c in bad)
        return f"source contains whitespace or shell metacharacters ({shown})"
    if source.startswith("sim://"):
        return None if re.match(r"^sim://[A-Za-z0-9._-]+$", source) else "source sim:// must be sim://NAME"
    if source.startswith("hf://"):
        if not _HF.match(source):
            return "source hf:// must be hf://org/repo or hf://org/repo@revision"
        return None
    if source.startswith("s3://"):
        match = S3_SOURCE_RE.match(source)
        if not match:
            return ("source s3:// must be s3://bucket/key-prefix (a bucket name of 3 to 63 characters a-z, 0-9, "
                    "'.' and '-', not an IP address, then a key not ending in '/'); the endpoint and credentials "
                    "are each node's own, not the catalog's")
        key = match.group(2)
        # Two spellings of one prefix would be two cache entries of the same weights.
        if "//" in key or any(part in (".", "..") for part in key.split("/")):
            return "source s3:// key must be normalised (no '.', '..' or '//')"
        return None
    if source.startswith(("http://", "https://")):
        if not urlsplit(source).hostname:
            return "source URL has no host"
        return None
    if source.startswith("file://"):
        path = source[len("file://"):]
        if not path.startswith("/"):
            return "source file:// must name an absolute path (file:///path)"
    elif source.startswith("/"):
        path = source
    else:
        scheme = source.split("://", 1)[0] if "://" in source else ""
        known = "hf://, s3://, https://, http://, file://, sim:// or an absolute path"
        return f'source scheme "{scheme}" is not supported; use {known}' if scheme else (
            f"source must be {known}")
    # A path with ".." or "//" names the same file two ways, and the cache name is a hash
    # of the text: two spellings would fetch the same weights twice.
    if ".." in path.split("/") or posixpath.normpath(path) != path.rstrip("/") or "//" in path:
        return "source path must be normalised (no '..', '.' or '//')"
    return None


def check_sources(entries: Iterable[ModelEntry]) -> list[Problem]:
    out = []
    for e in entries:
        why = source_problem(e.model.source)
        if why:
            out.append(e.doc.problem(("source",), why))
    return out


def check_unique_names(entries: list[ModelEntry]) -> list[Problem]:
    """Names and aliases share one namespace: a client's model string must mean one model."""
    owner: dict[str, tuple[ModelEntry, str]] = {}
    out = []
    # Canonical names first: when an alias collides with another model's name, the alias
    # is the mistake, whichever file sorts first.
    claims: list[tuple[ModelEntry, int, str]] = [(e, 0, e.model.name) for e in entries]
    claims += [(e, i + 1, a) for e in entries for i, a in enumerate(e.model.aliases)]
    for e, i, name in claims:
        path = ("name",) if i == 0 else ("aliases", i - 1)
        kind = "name" if i == 0 else "alias"
        if name not in owner:
            owner[name] = (e, kind)
            continue
        first, first_kind = owner[name]
        if first is e:
            out.append(e.doc.problem(path, f'alias "{name}" repeats the model\'s own name'))
            continue
        line, _ = first.doc.at(("name",))
        out.append(e.doc.problem(
            path,
            f'{kind} "{name}" is already the {first_kind} of model "{first.model.name}" '
            f"({first.doc.file}:{line})",
        ))
    return out


def check_fallbacks(entries: list[ModelEntry], known_names: set[str]) -> list[Problem]:
    """Fallbacks exist, are not the model itself, and never lead back to it."""
    by_name: dict[str, ModelEntry] = {e.model.name: e for e in entries}
    for e in entries:
        for a in e.model.aliases:
            by_name.setdefault(a, e)
    out = []
    for e in entries:
        for i, fb in enumerate(e.model.fallbacks):
            if by_name.get(fb) is e:
                out.append(e.doc.problem(("fallbacks", i), f'model "{e.model.name}" lists itself as a fallback'))
            elif fb not in by_name and fb not in known_names:
                out.append(e.doc.problem(("fallbacks", i), f'fallback "{fb}" is not in the catalog'))
    # Cycle detection over canonical names, each cycle reported once, at the model the
    # walk entered it by. Iterative: a fallback chain may be as long as the catalog.
    graph: dict[str, list[str]] = {
        e.model.name: [by_name[f].model.name for f in e.model.fallbacks if f in by_name and by_name[f] is not e]
        for e in entries
    }
    entry_of: dict[str, ModelEntry] = {e.model.name: e for e in entries}
    for cycle in find_cycles(graph):
        chain = " → ".join([*cycle, cycle[0]])
        out.append(entry_of[cycle[0]].doc.problem(("fallbacks",), f"fallbacks form a cycle: {chain}"))
    return out


def find_cycles(graph: dict[str, list[str]]) -> list[list[str]]:
    """One cycle per back edge met in a depth-first walk, in the graph's insertion order."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = finished
    cycles = []
    for root in graph:
        if root in state:
            continue
        path = [root]
        state[root] = 1
        stack = [iter(graph.get(root, ()))]
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                stack.pop()
                state[path.pop()] = 2
                continue
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):])
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(graph.get(nxt, ())))
    return cycles


def check_scaling(entries: Iterable[ModelEntry]) -> list[Problem]:
    out = []
    for e in entries:
        s = e.model.scaling
        if s.min > s.max:
            out.append(e.doc.problem(
                ("scaling", "min"), f"scaling.min ({s.min}) is greater than scaling.max ({s.max})"
            ))
    return out


# A canary step shorter than this has too few requests to judge; one longer than a day holds a
# rollout (and every later commit to the model) for longer than anyone watches it.
MIN_INTERVAL = 1.0
MAX_INTERVAL = 86400.0


def rollout_problems(
    doc: Document, path: KeyPath, raw: dict[str, Any], policy: RolloutPolicy, *, interval: float | None
) -> list[Problem]:
    """What the schema cannot say about one `rollout:` block (a model's, or llmgw.yaml's default).

    ``raw`` is the block as written and ``policy`` what it built to, over the default; a rule is
    judged only where the block writes a key the rule is about, so a mistake in the default is
    reported once, in llmgw.yaml, not again in every model that inherits it. ``interval`` is the
    block's own interval in seconds, None when it writes none or one that does not parse (already
    reported). Per-value bounds (a step in (0, 100), at most 10 steps, ratios >= 1, ...) are the
    schema's, so editors show them too.
    """
    out = []
    where = dotted(path)
    if "steps" in raw:
        steps = policy.steps
        for i in range(1, len(steps)):
            if steps[i] <= steps[i - 1]:
                # Out of order is a typo far more often than an intention, and a step that gives
                # the canary less traffic than the last one proves nothing new.
                out.append(doc.problem(path + ("steps", i), (
                    f"{where}.steps[{i}]: {steps[i]:g} is not above the step before it ({steps[i - 1]:g}): "
                    "steps must strictly increase")))
    if interval is not None:
        text = raw["interval"]
        if interval < MIN_INTERVAL:
            out.append(doc.problem(path + ("interval",), (
                f"{where}.interval: {text} is shorter than 1s: a step needs time to see requests on the canary")))
        elif interval > MAX_INTERVAL:
            out.append(doc.problem(path + ("interval",), (
                f"{where}.interval: {text} is longer than 24h: each canary step is judged at most a day "
                "after it starts")))
    if "traffic_timeout" in raw and policy.traffic_timeout is not None and policy.traffic_timeout < policy.interval:
        # A step judged after `interval` cannot have run out of time for traffic before it.
        out.append(doc.problem(path + ("traffic_timeout",), (
            f"{where}.traffic_timeout: {raw['traffic_timeout']} is shorter than interval ({policy.interval:g} s): "
            "a step is judged only after its interval")))
    written = [k for k in ("max_surge", "max_unavailable") if k in raw]
    if written and policy.max_surge == 0 and policy.max_unavailable == 0:
        # Neither a new replica beside the old nor an old one stopped first: nothing could move.
        key = written[0]
        inherited = [k for k in ("max_surge", "max_unavailable") if k not in raw]
        tail = f" ({inherited[0]} 0 comes from defaults.rollout in llmgw.yaml)" if inherited else ""
        out.append(doc.problem(path + (key,), (
            f"{where}.{key}: max_surge and max_unavailable are both 0: the rollout would never make "
            f"progress{tail}")))
    return out


def acceptance_problems(doc: Document, path: KeyPath, raw: dict[str, Any]) -> list[Problem]:
    """What the schema cannot say about one acceptance prompt."""
    out = []
    where = dotted(path)
    if ("messages" in raw) == ("prompt" in raw):
        out.append(doc.problem(path, f"{where}: give either messages (a chat) or prompt (a completion), not "
                                     f"{'both' if 'messages' in raw else 'neither'}"))
    expect = raw.get("expect") or {}
    if "matches" in expect:
        try:
            re.compile(expect["matches"])
        except re.error as exc:
            out.append(doc.problem(path + ("expect", "matches"),
                                   f"{where}.expect.matches: not a regular expression: {exc}"))
    if "json_schema" in expect:
        try:
            jsonschema.validators.validator_for(expect["json_schema"]).check_schema(expect["json_schema"])
        except jsonschema.SchemaError as exc:
            out.append(doc.problem(path + ("expect", "json_schema"),
                                   f"{where}.expect.json_schema: not a JSON Schema: {exc.message}"))
    return out


def check_routing(entries: Iterable[ModelEntry]) -> list[Problem]:
    # An embedding is one forward pass whose KV state no engine keeps for the next request, so
    # prefix affinity would only skew load: refused rather than silently ignored.
    return [e.doc.problem(("routing",), f'model "{e.model.name}" is an embedding model: routing "prefix" '
                                        "needs a generative task (chat or completion), whose engine caches prompts")
            for e in entries if e.model.routing == "prefix" and e.model.task == "embedding"]


def default_env_allow() -> frozenset[str]:
    """The env names every node's agent allows by default: the agent's own list (imported from
    the part it is built from), so a profile is refused at commit time for what nodes would
    refuse at start time."""
    return DEFAULT_ENV_ALLOW


def _env_refusal(key: str) -> str:
    # The node decides; the catalog can only ask. So the message names both settings: the
    # node's (which allows) and the catalog's (which only declares, for validation).
    return (f'env "{key}" is not on the agents\' default allow-list: a node allows it only with "env_allow" in '
            'its agent config (then declare it in llmgw.yaml "env_allow"); a name that loads files or code '
            'belongs in the node\'s own "engine_env", not in the catalog')


def check_profiles(entries: Iterable[ModelEntry], settings: Settings) -> list[Problem]:
    out = []
    for e in entries:
        seen: set[str] = set()
        for i, p in enumerate(e.model.profiles):
            if p.name in seen:
                out.append(e.doc.problem(("profiles", i, "name"), f'profile name "{p.name}" is used twice'))
            seen.add(p.name)
            if p.sharded and not p.fabric:
                out.append(e.doc.problem(
                    ("profiles", i, "nodes"),
                    f'profile "{p.name}" spans {p.nodes} nodes but names no fabric; '
                    "a sharded replica needs an interconnect such as infiniband",
                ))
            for key, _ in p.env:
                if key not in settings.env_allow and key not in default_env_allow():
                    out.append(e.doc.problem(("profiles", i, "env", key), _env_refusal(key)))
            if p.gpus == 0 and p.gpu_class:
                out.append(e.doc.problem(
                    ("profiles", i, "gpu_class"), f'profile "{p.name}" asks for 0 GPUs but names a gpu_class'
                ))
            for j, arg in enumerate(p.args):
                peer = _table_flag(p.engine, arg, PEER_FLAGS)
                if peer is not None:
                    out.append(e.doc.problem(("profiles", i, "args", j), (
                        f"{peer[0]} names the machines a rank exchanges with, which the controller sets to the "
                        "replica's own (its workers, its rank 0): not allowed in a catalog (a replica pointed "
                        "at another's worker takes it)")))
    return out


def check_pools(
    entries: Iterable[ModelEntry], nodes: Iterable[NodeEntry], settings: Settings
) -> list[Problem]:
    """Pools must be declared in llmgw.yaml, when it declares any: a typo strands a model."""
    if not settings.pools:
        return []
    declared = ", ".join(settings.pools)
    out = []
    for n in nodes:
        if n.node.pool not in settings.pools:
            out.append(n.doc.problem(("nodes", n.index, "pool"),
                                     f'pool "{n.node.pool}" is not declared in llmgw.yaml (declared: {declared})'))
    for e in entries:
        for i, p in enumerate(e.model.profiles):
            if p.pool and p.pool not in settings.pools:
                out.append(e.doc.problem(("profiles", i, "pool"),
                                         f'pool "{p.pool}" is not declared in llmgw.yaml (declared: {declared})'))
    return out


def check_nodes(nodes: list[NodeEntry]) -> list[Problem]:
    out = []
    ids: dict[str, NodeEntry] = {}
    addrs: dict[tuple[str, int, str, str | None], NodeEntry] = {}
    for n in nodes:
        if n.node.id in ids:
            out.append(n.doc.problem(("nodes", n.index, "id"), f'node id "{n.node.id}" is used twice'))
        ids.setdefault(n.node.id, n)
        if n.node.transport == "ssh":
            # Two nodes on one host are two agents, each with its own config (cache, state, lease,
            # ports, GPUs): told apart by agent_config, or by the user whose locked key names its own.
            key = (n.node.address, n.node.port, n.node.user, n.node.agent_config)
            if key in addrs:
                out.append(n.doc.problem(
                    ("nodes", n.index, "address"),
                    f'node "{n.node.id}" has the same address and port as node "{addrs[key].node.id}", and the '
                    "same user and agent_config: one agent twice (two nodes on one host each need their own "
                    "agent_config, or their own user)",
                ))
            addrs.setdefault(key, n)
    return out


def _fmt(x: float) -> str:
    return f"{x:g}"


def node_lacks(profile: Profile, node: NodeSpec, size_gb: float) -> list[str]:
    """What ``node`` lacks to hold one shard of ``profile``, judged on its declared spec."""
    lacks = []
    if profile.pool and node.pool != profile.pool:
        lacks.append(f'pool "{profile.pool}" (is in "{node.pool}")')
    if profile.gpus > 0:
        g = node.gpus
        have = g.count if g else 0
        if have < profile.gpus:
            lacks.append(f"{profile.gpus} GPUs (has {have})")
        if g and profile.gpu_class and g.gpu_class not in profile.gpu_class:
            lacks.append(f"a GPU of class {' or '.join(profile.gpu_class)} (has {g.gpu_class})")
        if g and profile.gpu_memory_gb and g.memory_gb < profile.gpu_memory_gb:
            lacks.append(f"{_fmt(profile.gpu_memory_gb)} GB per GPU (has {_fmt(g.memory_gb)})")
    if profile.memory_gb and node.memory_gb is not None and node.memory_gb < profile.memory_gb:
        lacks.append(f"{_fmt(profile.memory_gb)} GB of RAM (has {_fmt(node.memory_gb)})")
    if node.disk_gb is not None and node.disk_gb < size_gb:
        lacks.append(f"{_fmt(size_gb)} GB of disk (has {_fmt(node.disk_gb)})")
    if profile.sharded and profile.fabric and node.fabric != profile.fabric:
        lacks.append(f"fabric {profile.fabric} (has {node.fabric or 'none'})")
    return lacks


def check_fit(entries: Iterable[ModelEntry], nodes: list[NodeEntry], settings: Settings) -> list[Problem]:
    """Each profile could run on the declared fleet; otherwise name the closest node and its lacks.

    Judged on the declared fleet, not the live one: this says a profile can never run
    here, which is a mistake in the commit. Whether there is room right now is placement's
    question, answered at run time.
    """
    if not nodes:
        return []
    out = []
    for e in entries:
        for i, p in enumerate(e.model.profiles):
            if p.pool and settings.pools and p.pool not in settings.pools:
                continue  # the undeclared pool is reported; "fits no node" would repeat it
            judged = [(node_lacks(p, n.node, e.model.size_gb), n.node) for n in nodes]
            fitting = [n for lacks, n in judged if not lacks]
            if len(fitting) >= p.nodes:
                continue
            if fitting:  # sharded: some fit, not enough of them
                names = ", ".join(n.id for n in fitting)
                out.append(e.doc.problem(
                    ("profiles", i),
                    f'profile "{p.name}" needs {p.nodes} nodes on fabric {p.fabric} that can each hold a '
                    f"shard; only {len(fitting)} can ({names})",
                ))
                continue
            lacks, closest = min(judged, key=lambda x: len(x[0]))
            out.append(e.doc.problem(
                ("profiles", i),
                f'profile "{p.name}" fits no node in nodes.yaml; the closest, "{closest.id}", '
                f"lacks {', '.join(lacks)}",
            ))
    return out


def check_catalog(
    entries: list[ModelEntry],
    nodes: list[NodeEntry],
    settings: Settings,
    *,
    other_model_names: set[str],
) -> list[Problem]:
    """Every semantic rule over the models and nodes that passed the schema layer.

    ``other_model_names`` are names read from files that failed the schema: a fallback to
    a model whose file has a typo is that file's problem, not a second one here.
    """
    return [
        *check_sources(entries),
        *check_unique_names(entries),
        *check_fallbacks(entries, other_model_names),
        *check_scaling(entries),
        *check_routing(entries),
        *check_profiles(entries, settings),
        *check_pools(entries, nodes, settings),
        *check_nodes(nodes),
        *check_fit(entries, nodes, settings),
    ]


def check_tenants(doc: Document | None, settings: Settings, model_names: set[str]) -> list[Problem]:
    """Tenant names unique, a key in one tenant only (else whose limits would apply?), and per-model
    limits only for models in the catalog (a typo would silently limit nothing)."""
    if doc is None:
        return []
    out = []
    names: dict[str, int] = {}
    owner: dict[str, str] = {}
    for i, t in enumerate(settings.tenants):
        if t.name in names:
            line, _ = doc.at(("tenants", names[t.name], "name"))
            out.append(doc.problem(("tenants", i, "name"),
                                   f'tenant "{t.name}" is declared twice (first at line {line})'))
        names.setdefault(t.name, i)
        for j, key in enumerate(t.keys):
            if key in owner and owner[key] != t.name:
                out.append(doc.problem(("tenants", i, "keys", j),
                                       f'key "{key}" already belongs to tenant "{owner[key]}": a key has one tenant'))
            owner.setdefault(key, t.name)
        for model, _ in t.models:
            if model not in model_names:
                out.append(doc.problem(("tenants", i, "models", model),
                                       f'tenant "{t.name}" limits model "{model}", which is not a model name '
                                       "in the catalog"))
    return out
