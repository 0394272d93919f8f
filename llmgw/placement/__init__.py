"""Placement: pure decisions of where replicas run (DESIGN §5)."""

from llmgw.placement.explain import Explanation, explain, unrunnable
from llmgw.placement.place import default_wanted, place
from llmgw.placement.types import Placement, PlacementResult, Rejection, Shard

__all__ = ["Explanation", "Placement", "PlacementResult", "Rejection", "Shard", "default_wanted", "explain", "place",
           "unrunnable"]
