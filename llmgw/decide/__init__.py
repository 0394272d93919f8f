"""The reconciler's pure decision (DESIGN §5): replica records and what one tick should do.

    decide, Decisions, Settings   stops, new replicas and losses, from desired, actual and usage
    holding                       what holds GPUs now (replicas not stopped, unclaimed engines)
    Replica, ReplicaState         the records of replicas, as the controller keeps them

No I/O and no I/O package: `llmgw diff` and the prune guard run the very same decision.
"""

from llmgw.decide.replica import Replica, ReplicaState
from llmgw.decide.tick import Decisions, Settings, decide, holding

__all__ = ["Decisions", "Replica", "ReplicaState", "Settings", "decide", "holding"]
