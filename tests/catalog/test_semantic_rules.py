"""Semantic rules added by issue 39: a catalog cannot name a replica's peers."""

from __future__ import annotations

import pytest

from llmgw.catalog import RawFile, validate_files

NODES = "nodes:\n  - id: n1\n    address: 10.0.0.1\n"


def raw(name: str, text: str) -> RawFile:
    data = text.encode()
    return RawFile(name, data, len(data))


@pytest.mark.parametrize(("engine", "arg"), [
    ("llama.cpp", "--rpc"), ("llama.cpp", "--rpc=10.0.0.2:50052"), ("vllm", "--master_addr"),
    ("vllm", "--data-parallel-address"), ("sglang", "--dist-init-addr"), ("sglang", "--nccl-init-addr=x:1"),
])
def test_a_catalog_cannot_point_a_rank_at_peers_the_controller_names(engine: str, arg: str) -> None:
    model = (f"name: m\nsource: hf://org/m\nsize_gb: 1\nprofiles:\n  - name: p\n    engine: {engine}\n"
             f"    gpus: 0\n    args: [\"--ctx-size\", \"{arg}\", \"10.0.0.2:50052\"]\n")
    result = validate_files({"nodes.yaml": raw("nodes.yaml", NODES), "models/m.yaml": raw("models/m.yaml", model)})
    problems = [p for p in result.problems if "names the machines a rank exchanges with" in p.message]
    assert [(p.file, p.line) for p in problems] == [("models/m.yaml", 8)], result.problems
