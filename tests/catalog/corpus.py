"""A small valid catalog that the broken-catalog corpus mutates one mistake at a time.

Kept as literal text so every expected line number in the tests can be read off here.
"""

from __future__ import annotations

from pathlib import Path

SETTINGS = """\
pools:
  - name: default
  - name: batch
prune_guard:
  max_model_share: 0.5
"""

NODES = """\
nodes:
  - id: gpu-1
    address: 10.0.0.1
    fabric: ib
    gpus: {count: 8, class: h100, memory_gb: 80}
    memory_gb: 1024
    disk_gb: 2000
  - id: gpu-2
    address: 10.0.0.2
    fabric: ib
    gpus: {count: 8, class: h100, memory_gb: 80}
    memory_gb: 1024
    disk_gb: 2000
  - id: a100-1
    address: 10.0.0.3
    gpus: {count: 4, class: a100, memory_gb: 40}
    memory_gb: 512
    disk_gb: 1000
  - id: cpu-1
    address: 10.0.0.4
    pool: batch
    memory_gb: 256
    disk_gb: 500
"""

SMALL = """\
name: small
aliases: [tiny]
source: hf://org/small@v1
size_gb: 16
scaling:
  min: 1
  max: 2
  idle_after: 15m
profiles:
  - name: gpu
    engine: vllm
    gpus: 1
    gpu_class: [h100, a100]
"""

BIG = """\
name: big
source: hf://org/big
size_gb: 140
fallbacks: [small]
profiles:
  - name: tp4
    engine: vllm
    gpus: 4
    args: ["--tensor-parallel-size", "4"]
"""

BASE: dict[str, str | bytes | None] = {
    "llmgw.yaml": SETTINGS,
    "nodes.yaml": NODES,
    "models/small.yaml": SMALL,
    "models/big.yaml": BIG,
}


def write_catalog(root: Path, overrides: dict[str, str | bytes | None] | None = None) -> Path:
    """Write BASE with ``overrides`` applied (None deletes a file) under ``root``."""
    files = {**BASE, **(overrides or {})}
    for rel, content in files.items():
        if content is None:
            continue
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8")
    return root
