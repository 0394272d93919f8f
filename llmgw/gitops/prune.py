"""The prune guard: a commit that would take away too much at once waits for a person.

Pure: it compares two catalogs and the live replica counts. A commit that deletes most
of the catalog is far more often a bad merge or a wrong branch than an intention, and
applying it would stop traffic across the fleet within one reconcile tick.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from llmgw.catalog import Catalog

ALLOW_TRAILER = re.compile(r"^Llmgw-Allow-Prune:\s*yes\s*$", re.IGNORECASE | re.MULTILINE)


@dataclass(frozen=True)
class PruneVerdict:
    held: bool
    models_removed: tuple[str, ...]
    replicas_stopped: int
    replicas_ready: int
    reasons: tuple[str, ...]


def allows_prune(message: str) -> bool:
    """The commit message carries the trailer ``Llmgw-Allow-Prune: yes``."""
    return bool(ALLOW_TRAILER.search(message))


def judge_prune(old: Catalog | None, new: Catalog, ready: Mapping[str, int]) -> PruneVerdict:
    """Whether going from ``old`` to ``new`` removes more than the guard allows.

    ``ready`` counts ready replicas per model name. Replicas stopped are those of removed
    models plus those above a model's new ``max``. The thresholds are ``new``'s own, so
    a commit cannot loosen the guard and slip past it at once — it is judged by the
    stricter of the two.
    """
    if old is None:
        return PruneVerdict(False, (), 0, sum(ready.values()), ())
    g_old, g_new = old.settings.prune_guard, new.settings.prune_guard
    max_models = min(g_old.max_model_share, g_new.max_model_share)
    max_replicas = min(g_old.max_replica_share, g_new.max_replica_share)
    removed = tuple(sorted(m.name for m in old.models if new.model(m.name) is None))
    stopped = 0
    for name, count in ready.items():
        after = new.model(name)
        stopped += count if after is None else max(0, count - after.scaling.max)
    total_ready = sum(ready.values())
    reasons = []
    if old.models and len(removed) / len(old.models) > max_models:
        reasons.append(
            f"removes {len(removed)} of {len(old.models)} models "
            f"(more than {max_models:.0%}): {', '.join(removed)}"
        )
    if total_ready and stopped / total_ready > max_replicas:
        reasons.append(f"stops {stopped} of {total_ready} ready replicas (more than {max_replicas:.0%})")
    return PruneVerdict(bool(reasons), removed, stopped, total_ready, tuple(reasons))
