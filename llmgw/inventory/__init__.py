"""The fleet as it is: typed agent inventories and node state."""

from llmgw.inventory.model import (
    EngineRecord,
    Filesystem,
    Gpu,
    Inventory,
    Lease,
    Node,
    NodeReport,
    NodeState,
    Offers,
    WeightEntry,
    becomes_ours,
    engine_is_ours,
    follow_nodes,
    parse_engine,
    parse_report,
)

__all__ = [
    "EngineRecord",
    "Filesystem",
    "Gpu",
    "Inventory",
    "Lease",
    "Node",
    "NodeReport",
    "Offers",
    "NodeState",
    "WeightEntry",
    "becomes_ours",
    "engine_is_ours",
    "follow_nodes",
    "parse_engine",
    "parse_report",
]
