"""The prune guard: a commit that would take away too much at once waits for a person.

Pure. It judges the plan, not the diff of two catalogs: the ready replicas that the commit's
desired state would stop, by the same `decide()` the controller runs each tick and `llmgw diff`
shows, whatever the cause — a model removed, a lowered ``max``, a node gone from nodes.yaml
(seen: ``nodes: []`` applied at once stopped every replica, because only removed models and
lowered maxima were counted). A commit that takes away most of the fleet is far more often a bad
merge or a wrong branch than an intention, and applying it stops traffic within one tick.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, replace

from llmgw.catalog import Catalog
from llmgw.decide.replica import Replica, ReplicaState
from llmgw.decide.tick import decide
from llmgw.inventory import Inventory, follow_nodes

ALLOW_TRAILER = re.compile(r"^Llmgw-Allow-Prune:\s*yes\s*$", re.IGNORECASE | re.MULTILINE)
SKIP_ANALYSIS_TRAILER = re.compile(r"^Llmgw-Skip-Analysis:\s*yes\s*$", re.IGNORECASE | re.MULTILINE)


@dataclass(frozen=True)
class PruneVerdict:
    held: bool
    models_removed: tuple[str, ...]
    replicas_stopped: int
    replicas_ready: int
    reasons: tuple[str, ...]
    causes: tuple[tuple[str, str], ...] = ()  # (ready replica the commit stops, why)


def allows_prune(message: str) -> bool:
    """The commit message carries the trailer ``Llmgw-Allow-Prune: yes``."""
    return bool(ALLOW_TRAILER.search(message))


def skips_analysis(message: str) -> bool:
    """The commit message carries the trailer ``Llmgw-Skip-Analysis: yes``: the canary rollouts it
    starts go straight to promoting (an emergency fix), max_surge/max_unavailable still apply."""
    return bool(SKIP_ANALYSIS_TRAILER.search(message))


def with_trailers(catalog: Catalog, message: str) -> Catalog:
    """``catalog`` as its commit's trailers amend it (only ``Llmgw-Skip-Analysis`` does)."""
    return replace(catalog, skip_analysis=True) if skips_analysis(message) else catalog


def stops_under(catalog: Catalog, inventory: Inventory, replicas: tuple[Replica, ...], now: float,
                last_used: Mapping[str, float] | None = None) -> dict[str, str]:
    """Replicas ``decide()`` would stop or give up for lost if ``catalog`` were the desired state.

    The inventory is first made to follow the catalog's nodes (as the reconciler does when it
    applies one). Idleness is judged from ``last_used`` (the router's), so a commit that makes
    every replica idle at once (``min: 0`` with a short ``idle_after``) counts; without it (a dry
    run on a snapshot) nothing is idle.
    """
    fleet = Inventory(follow_nodes(inventory.nodes, catalog.nodes), inventory.taken_at)
    used = dict(last_used) if last_used is not None else {r.id: now for r in replicas}
    d = decide(catalog, fleet, replicas, last_used=used, demand={}, now=now)
    # An old replica stopped first for its replacement (a full fleet) is a rollout, not a prune.
    return {**dict(d.lost), **{rid: why for rid, why in d.stop if rid not in d.for_rollout}}


def judge_prune(old: Catalog | None, new: Catalog, inventory: Inventory, replicas: tuple[Replica, ...], *,
                now: float, last_used: Mapping[str, float] | None = None) -> PruneVerdict:
    """Whether going from ``old`` to ``new`` takes away more than the guard allows.

    A replica counts when it is ready and ``new`` stops it where ``old`` would not (a replica
    already lost with its node is not this commit's doing). The thresholds are the stricter of
    the two catalogs', so a commit cannot loosen the guard and slip past it at once.
    """
    # Adopted after a restart and not yet probed again, a replica still serves: counted as ready,
    # or a commit judged in the first seconds after a restart would find nothing to protect.
    ready = [r for r in replicas if r.state == ReplicaState.READY
             or (r.adopted and r.state == ReplicaState.STARTING)]
    if old is None:
        return PruneVerdict(False, (), 0, len(ready), ())
    g_old, g_new = old.settings.prune_guard, new.settings.prune_guard
    max_models = min(g_old.max_model_share, g_new.max_model_share)
    max_replicas = min(g_old.max_replica_share, g_new.max_replica_share)
    removed = tuple(sorted(m.name for m in old.models if new.model(m.name) is None))
    before = stops_under(old, inventory, replicas, now, last_used)
    after = stops_under(new, inventory, replicas, now, last_used)
    causes = tuple(sorted((r.id, after[r.id]) for r in ready if r.id in after and r.id not in before))
    reasons = []
    if old.models and len(removed) / len(old.models) > max_models:
        reasons.append(f"removes {len(removed)} of {len(old.models)} models "
                       f"(more than {max_models:.0%}): {', '.join(removed)}")
    if ready and len(causes) / len(ready) > max_replicas:
        why = Counter(cause for _, cause in causes)
        reasons.append(f"stops {len(causes)} of {len(ready)} ready replicas (more than {max_replicas:.0%}): "
                       + "; ".join(f"{n} because {cause}" for cause, n in why.most_common()))
    return PruneVerdict(bool(reasons), removed, len(causes), len(ready), tuple(reasons), causes)
