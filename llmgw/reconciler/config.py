"""The reconciler's knobs, with the defaults an operator gets when they set none.

Every float is seconds: the controller config reads each as a duration (``10s``, ``2m``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReconcilerConfig:
    tick_interval: float = 2.0
    unreachable_grace: float = 30.0
    backoff_base: float = 2.0
    backoff_cap: float = 120.0
    crash_loop_after: int = 5
    crash_reset_after: float = 600.0  # seconds ready after which a replica's failure count is forgotten
    start_timeout: float = 900.0
    probe_timeout: float = 10.0
    stop_grace: float = 10.0
    # Seconds a replica withdrawn from the routers keeps its engine while requests on it finish
    # (a stream cut by a scale-down or a rollout is a failed answer the client cannot retry).
    drain_timeout: float = 30.0
    concurrency: int = 32
