"""The catalog: the fleet's desired state as YAML, validated into frozen data.

Pure except for the two readers (a directory, a git commit's tree); everything else in
llmgw reads a `Catalog` and may rely on what validation guarantees.
"""

from llmgw.catalog.loader import (
    RawFile,
    ValidationResult,
    load_directory,
    read_directory,
    validate_files,
)
from llmgw.catalog.model import (
    CanaryChecks,
    Catalog,
    GpuSpec,
    Model,
    ModelName,
    NodeId,
    NodeSpec,
    Profile,
    PruneGuard,
    RolloutPolicy,
    Scaling,
    Settings,
    cache_name,
)
from llmgw.catalog.problems import Problem

__all__ = [
    "CanaryChecks",
    "Catalog",
    "GpuSpec",
    "Model",
    "ModelName",
    "NodeId",
    "NodeSpec",
    "Problem",
    "Profile",
    "PruneGuard",
    "RawFile",
    "RolloutPolicy",
    "Scaling",
    "Settings",
    "ValidationResult",
    "cache_name",
    "load_directory",
    "read_directory",
    "validate_files",
]
