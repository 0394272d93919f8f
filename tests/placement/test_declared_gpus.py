"""nodes.yaml's `gpus` against what the node's agent reports: every disagreement (count, class,
memory) is named; a card's label (an H100 "80GB" reports 85.5 decimal GB) is not one."""

from __future__ import annotations

from llmgw.catalog import NodeId, NodeSpec
from llmgw.catalog.model import GpuSpec
from llmgw.inventory import Gpu, NodeReport
from llmgw.inventory.model import gpu_disagreement


def spec(gpus: GpuSpec | None) -> NodeSpec:
    return NodeSpec(NodeId("n"), "10.0.0.1", gpus=gpus)


def report(*gpus: tuple[str, float]) -> NodeReport:
    return NodeReport("n", "0.1.0", gpus=tuple(Gpu(i, cls, mem) for i, (cls, mem) in enumerate(gpus)))


def test_agreement_is_silent() -> None:
    assert gpu_disagreement(spec(GpuSpec(2, "sim", 24)), report(("sim", 24), ("sim", 24))) is None
    assert gpu_disagreement(spec(None), report()) is None
    assert gpu_disagreement(spec(GpuSpec(0, "sim", 24)), report()) is None  # count 0: none declared
    # Not reported yet: nothing to compare.
    assert gpu_disagreement(spec(GpuSpec(2, "l40s", 48)), None) is None


def test_a_cards_label_is_not_a_disagreement() -> None:
    h100 = report(*[("h100", 85.5)] * 8)  # what nvidia-smi's 81559 MiB is in decimal GB
    assert gpu_disagreement(spec(GpuSpec(8, "h100", 80)), h100) is None
    assert gpu_disagreement(spec(GpuSpec(4, "l40s", 48)), report(*[("l40s", 48.3)] * 4)) is None


def test_every_kind_of_disagreement_is_named() -> None:
    l40s = spec(GpuSpec(2, "l40s", 48))
    assert gpu_disagreement(l40s, report()) == "nodes.yaml declares 2 × l40s 48 GB, the agent reports none"
    assert gpu_disagreement(l40s, report(("l40s", 48))) == (
        "nodes.yaml declares 2 × l40s 48 GB, the agent reports 1 × l40s 48 GB")
    assert gpu_disagreement(l40s, report(("sim", 48), ("sim", 48))) == (
        "nodes.yaml declares 2 × l40s 48 GB, the agent reports 2 × sim 48 GB")
    # Less memory than declared: a profile validated against nodes.yaml would not fit.
    assert gpu_disagreement(l40s, report(("l40s", 45), ("l40s", 45))) == (
        "nodes.yaml declares 2 × l40s 48 GB, the agent reports 2 × l40s 45 GB")
    # Far more than the label: validation refuses profiles the node could run.
    assert gpu_disagreement(l40s, report(("l40s", 96), ("l40s", 96))) is not None
    assert gpu_disagreement(spec(None), report(("sim", 24), ("sim", 24))) == (
        "nodes.yaml declares no GPUs, the agent reports 2 × sim 24 GB")
