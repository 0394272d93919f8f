"""The broken-catalog corpus: one mistake per case, each located and named exactly.

Every case asserts the single problem it expects (file, line, and the words an operator
needs), so a rule that starts reporting cascades or pointing at the wrong line fails.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from llmgw.catalog import read_directory, validate_files
from tests.catalog.corpus import BIG, NODES, SETTINGS, SMALL, write_catalog


@dataclass
class Case:
    id: str
    files: dict[str, str | bytes | None]
    file: str
    line: int
    words: tuple[str, ...]


TENANTS = """\
tenants:
  - name: search
    keys: [search-prod, search-batch]
    limits:
      requests_per_minute: 600
      tokens_per_minute: 200000
      concurrent: 16
      budget:
        per: day
        tokens: 5000000
        reset: "06:00"
    models:
      big: {requests_per_minute: 30}
"""


def sub(text: str, old: str, new: str) -> str:
    assert old in text, f"corpus edit {old!r} does not apply"
    return text.replace(old, new, 1)


CASES = [
    # --- YAML itself -------------------------------------------------------------
    Case("yaml-syntax", {"models/small.yaml": sub(SMALL, "size_gb: 16", "size_gb: [16")},
         "models/small.yaml", 5, ("YAML syntax error",)),
    Case("duplicate-key", {"models/small.yaml": sub(SMALL, "  max: 2\n", "  max: 2\n  min: 0\n")},
         "models/small.yaml", 8, ('duplicate key "min"', "first defined at line 6")),
    Case("empty-file", {"models/empty.yaml": ""}, "models/empty.yaml", 1, ("empty",)),
    Case("comments-only", {"models/empty.yaml": "# nothing yet\n"}, "models/empty.yaml", 1, ("empty",)),
    Case("not-a-mapping", {"models/list.yaml": "- small\n- big\n"},
         "models/list.yaml", 1, ("expected a mapping", "found a list")),
    Case("scalar-document", {"models/str.yaml": "just text\n"},
         "models/str.yaml", 1, ("expected a mapping", "single value")),
    Case("not-utf8", {"models/small.yaml": SMALL.encode().replace(b"name: small", b"name: sm\xe9ll")},
         "models/small.yaml", 1, ("not UTF-8", "0xe9")),
    Case("huge-file", {"models/huge.yaml": b"# " + b"x" * (3 * 1024 * 1024) + b"\n"},
         "models/huge.yaml", 1, ("3.0 MiB", "at most 1 MiB")),
    Case("two-documents", {"models/small.yaml": SMALL + "---\nname: other\n"},
         "models/small.yaml", 14, ("one YAML document", "second")),
    # --- JSON Schema layer -------------------------------------------------------
    Case("unknown-key-profile", {"models/small.yaml": sub(SMALL, "    gpus: 1", "    gpu: 1")},
         "models/small.yaml", 12, ('unknown key "gpu"', 'did you mean "gpus"')),
    Case("unknown-key-top", {"models/big.yaml": BIG + "replicas: 2\n"},
         "models/big.yaml", 10, ('unknown key "replicas"',)),
    Case("missing-source", {"models/big.yaml": sub(BIG, "source: hf://org/big\n", "")},
         "models/big.yaml", 1, ('missing required key "source"',)),
    Case("wrong-type-gpus", {"models/big.yaml": sub(BIG, "gpus: 4", 'gpus: "4"')},
         "models/big.yaml", 8, ("profiles[0].gpus", "expected an integer", 'string "4"')),
    Case("engine-enum", {"models/big.yaml": sub(BIG, "engine: vllm", "engine: vlm")},
         "models/big.yaml", 7, ('"vlm" is not one of', "vllm, sglang, llama.cpp, sim")),
    Case("duration-pattern", {"models/small.yaml": sub(SMALL, "idle_after: 15m", "idle_after: 15 minutes")},
         "models/small.yaml", 8, ("scaling.idle_after", "duration such as")),
    Case("negative-size", {"models/big.yaml": sub(BIG, "size_gb: 140", "size_gb: -1")},
         "models/big.yaml", 3, ("size_gb", "must be >", "got -1")),
    Case("no-profiles", {"models/big.yaml": BIG[: BIG.index("profiles:")] + "profiles: []\n"},
         "models/big.yaml", 5, ("profiles", "at least 1 item")),
    Case("bad-name", {"models/big.yaml": sub(BIG, "name: big", "name: Big Model")},
         "models/big.yaml", 1, ("name", '"Big Model" is not valid')),
    Case("source-metachar", {"models/big.yaml": sub(BIG, "source: hf://org/big", 'source: "/m/x;rm -rf /"')},
         "models/big.yaml", 2, ("source", "shell metacharacters")),
    Case("source-unknown-scheme", {"models/big.yaml": sub(BIG, "hf://org/big", "gs://bucket/big")},
         "models/big.yaml", 2, ("source", '"gs://bucket/big" is not valid')),
    Case("duplicate-alias-in-list", {"models/small.yaml": sub(SMALL, "[tiny]", "[tiny, tiny]")},
         "models/small.yaml", 2, ("aliases", '"tiny" more than once')),
    Case("env-refused-by-agents", {"models/big.yaml": BIG + "    env: {LD_PRELOAD: /tmp/x.so}\n"},
         "models/big.yaml", 10, ('env "LD_PRELOAD" is not on the agents\' default allow-list', '"env_allow"')),
    # The vector seen from outside: a warnings filter importing a stdlib module that "opens a
    # browser" with BROWSER as the command. Neither is a tuning knob, so neither passes.
    Case("env-warnings-import", {"models/big.yaml": BIG + "    env: {PYTHONWARNINGS: 'ignore::antigravity.X'}\n"},
         "models/big.yaml", 10, ('env "PYTHONWARNINGS" is not on the agents\' default allow-list',)),
    Case("env-llama-arg", {"models/big.yaml": BIG + "    env: {LLAMA_ARG_LOG_FILE: /etc/cron.d/x}\n"},
         "models/big.yaml", 10, ('env "LLAMA_ARG_LOG_FILE" is not on',)),
    Case("env-key", {"models/big.yaml": BIG + "    env: {cuda_home: /usr}\n"},
         "models/big.yaml", 10, ('key "cuda_home" is not valid',)),
    Case("args-not-strings", {"models/big.yaml": sub(BIG, '"4"]', "4]")},
         "models/big.yaml", 9, ("profiles[0].args[1]", "expected a string", "number 4")),
    Case("routing-enum", {"models/big.yaml": sub(BIG, "fallbacks: [small]\n", "fallbacks: [small]\nrouting: sticky\n")},
         "models/big.yaml", 5, ("routing", '"sticky" is not one of', "least-outstanding, prefix")),
    Case("tenant-reset", {"llmgw.yaml": SETTINGS + TENANTS.replace('reset: "06:00"', 'reset: "6am"')},
         "llmgw.yaml", 16, ("tenants[0].limits.budget.reset", "a time of day HH:MM")),
    Case("tenant-period", {"llmgw.yaml": SETTINGS + TENANTS.replace("per: day", "per: week")},
         "llmgw.yaml", 14, ('"week" is not one of', "day, month")),
    Case("tenant-zero-rpm",
         {"llmgw.yaml": SETTINGS + TENANTS.replace("requests_per_minute: 600", "requests_per_minute: 0")},
         "llmgw.yaml", 10, ("requests_per_minute", ">= 1")),
    Case("prune-share", {"llmgw.yaml": sub(SETTINGS, "0.5", "1.5")},
         "llmgw.yaml", 5, ("prune_guard.max_model_share", "<= 1")),
    Case("node-port", {"nodes.yaml": sub(NODES, "address: 10.0.0.4", "address: 10.0.0.4\n    port: 70000")},
         "nodes.yaml", 21, ("nodes[3].port", "<= 65535")),
    # --- semantic rules ------------------------------------------------------------
    Case("duration-order", {"models/small.yaml": sub(SMALL, "idle_after: 15m", "idle_after: 30m1h")},
         "models/small.yaml", 8, ("idle_after", "largest to smallest")),
    Case("duration-zero", {"models/small.yaml": sub(SMALL, "idle_after: 15m", "idle_after: 0s")},
         "models/small.yaml", 8, ("idle_after", "longer than 0s")),
    Case("min-over-max", {"models/small.yaml": sub(SMALL, "min: 1", "min: 3")},
         "models/small.yaml", 6, ("scaling.min (3) is greater than scaling.max (2)",)),
    Case("source-dotdot", {"models/big.yaml": sub(BIG, "hf://org/big", "/models/../etc/big")},
         "models/big.yaml", 2, ("normalised", "'..'")),
    Case("duplicate-name", {"models/small2.yaml": sub(SMALL, "[tiny]", "[tiny2]")},
         "models/small2.yaml", 1, ('name "small" is already the name of model "small"', "models/small.yaml:1")),
    Case("alias-is-other-name", {"models/big.yaml": sub(BIG, "name: big\n", "name: big\naliases: [small]\n")},
         "models/big.yaml", 2, ('alias "small" is already the name of model "small"',)),
    # Two aliases alike: the file that sorts first keeps it, the other is reported.
    Case("alias-collides-alias", {"models/big.yaml": sub(BIG, "name: big\n", "name: big\naliases: [tiny]\n")},
         "models/small.yaml", 2, ('alias "tiny" is already the alias of model "big"', "models/big.yaml:1")),
    Case("alias-repeats-name", {"models/big.yaml": sub(BIG, "name: big\n", "name: big\naliases: [big]\n")},
         "models/big.yaml", 2, ("repeats the model's own name",)),
    Case("routing-prefix-embedding",
         {"models/big.yaml": sub(BIG, "fallbacks: [small]\n", "task: embedding\nrouting: prefix\n")},
         "models/big.yaml", 5, ('model "big" is an embedding model: routing "prefix"', "chat or completion")),
    Case("tenant-key-twice", {"llmgw.yaml": SETTINGS + TENANTS + "  - name: other\n    keys: [search-prod]\n"},
         "llmgw.yaml", 20, ('key "search-prod" already belongs to tenant "search"',)),
    Case("tenant-twice", {"llmgw.yaml": SETTINGS + TENANTS + "  - name: search\n    keys: [x]\n"},
         "llmgw.yaml", 19, ('tenant "search" is declared twice (first at line 7)',)),
    Case("tenant-unknown-model", {"llmgw.yaml": SETTINGS + TENANTS.replace("      big:", "      bigg:")},
         "llmgw.yaml", 18, ('tenant "search" limits model "bigg", which is not a model name in the catalog',)),
    Case("fallback-missing", {"models/big.yaml": sub(BIG, "[small]", "[qwen-7b]")},
         "models/big.yaml", 4, ('fallback "qwen-7b" is not in the catalog',)),
    Case("fallback-self", {"models/big.yaml": sub(BIG, "[small]", "[big]")},
         "models/big.yaml", 4, ('model "big" lists itself as a fallback',)),
    Case("fallback-cycle", {"models/small.yaml": sub(SMALL, "size_gb: 16\n", "size_gb: 16\nfallbacks: [big]\n")},
         "models/big.yaml", 4, ("fallbacks form a cycle", "big → small → big")),
    Case("sharded-no-fabric", {"models/big.yaml": sub(BIG, "gpus: 4\n", "gpus: 8\n    nodes: 2\n")},
         "models/big.yaml", 9, ('profile "tp4" spans 2 nodes but names no fabric',)),
    Case("fits-no-class", {"models/small.yaml": sub(SMALL, "[h100, a100]", "[l40s]")},
         "models/small.yaml", 10, ('profile "gpu" fits no node', "a GPU of class l40s (has h100)")),
    Case("fits-no-memory", {"models/big.yaml": sub(BIG, "gpus: 4\n", "gpus: 4\n    gpu_memory_gb: 96\n")},
         "models/big.yaml", 6, ('profile "tp4" fits no node', "96 GB per GPU (has 80)")),
    Case("fits-too-many-gpus", {"models/big.yaml": sub(BIG, "gpus: 4", "gpus: 16")},
         "models/big.yaml", 6, ('"gpu-1"', "16 GPUs (has 8)")),
    Case("shards-not-enough-nodes",
         {"models/big.yaml": sub(BIG, "gpus: 4\n", "gpus: 8\n    nodes: 3\n    fabric: ib\n")},
         "models/big.yaml", 6, ("needs 3 nodes on fabric ib", "only 2 can (gpu-1, gpu-2)")),
    Case("cpu-ram", {"models/big.yaml": sub(BIG, "gpus: 4\n", "gpus: 0\n    memory_gb: 2048\n    pool: batch\n")},
         "models/big.yaml", 6, ('closest, "cpu-1"', "2048 GB of RAM (has 256)")),
    Case("disk", {"models/big.yaml": sub(BIG, "size_gb: 140", "size_gb: 4000")},
         "models/big.yaml", 6, ("4000 GB of disk (has 2000)",)),
    Case("pool-undeclared", {"models/big.yaml": BIG + "    pool: gpu\n"},
         "models/big.yaml", 10, ('pool "gpu" is not declared in llmgw.yaml', "default, batch")),
    Case("duplicate-node-id", {"nodes.yaml": sub(NODES, "id: gpu-2", "id: gpu-1")},
         "nodes.yaml", 8, ('node id "gpu-1" is used twice',)),
    Case("duplicate-node-address", {"nodes.yaml": sub(NODES, "address: 10.0.0.2", "address: 10.0.0.1")},
         "nodes.yaml", 9, ('"gpu-2" has the same address and port as node "gpu-1"',)),
    Case("duplicate-profile-name", {"models/big.yaml": BIG + "  - name: tp4\n    engine: sglang\n    gpus: 4\n"},
         "models/big.yaml", 10, ('profile name "tp4" is used twice',)),
    Case("nodes-missing", {"nodes.yaml": None}, "nodes.yaml", 1, ("nodes.yaml is missing",)),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_each_broken_catalog_names_its_one_mistake(tmp_path: Path, case: Case) -> None:
    result = validate_files(read_directory(write_catalog(tmp_path, case.files)))
    assert result.catalog is None
    assert len(result.problems) == 1, "\n".join(map(str, result.problems))
    problem = result.problems[0]
    assert (problem.file, problem.line) == (case.file, case.line), str(problem)
    for words in case.words:
        assert words in problem.message, str(problem)


def test_corpus_is_large_and_each_case_distinct() -> None:
    assert len(CASES) >= 30
    assert len({c.id for c in CASES}) == len(CASES)


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    files = {
        "models/small.yaml": sub(SMALL, "min: 1", "min: 3"),
        "models/big.yaml": sub(sub(BIG, "[small]", "[nope]"), "engine: vllm", "engine: vlm"),
    }
    result = validate_files(read_directory(write_catalog(tmp_path, files)))
    assert [str(p) for p in result.problems] == [
        'models/big.yaml:7:5: profiles[0].engine: string "vlm" is not one of: vllm, sglang, llama.cpp, sim',
        "models/small.yaml:6:3: scaling.min (3) is greater than scaling.max (2)",
    ]


def test_the_base_of_the_corpus_is_valid(tmp_path: Path) -> None:
    result = validate_files(read_directory(write_catalog(tmp_path)))
    assert result.ok, result.problems
    assert result.catalog is not None
    assert result.catalog.resolve("tiny").name == "small"
    assert result.catalog.model("big").fallbacks == ("small",)


def test_a_big_catalog_gives_the_same_answer_on_several_processes(tmp_path: Path) -> None:
    files: dict[str, str | bytes | None] = {}
    for i in range(260):
        text = SMALL.replace("name: small", f"name: m{i}").replace("[tiny]", f"[t{i}]")
        if i % 50 == 7:
            text = text.replace("engine: vllm", "engine: vlm")
        if i % 90 == 11:
            text = text.replace("size_gb: 16", "size_gb: [16")
        files[f"models/m{i:03d}.yaml"] = text
    raw = read_directory(write_catalog(tmp_path, files))
    serial = validate_files(raw)
    parallel = validate_files(raw, workers=2)
    assert len(serial.problems) == 9  # 6 bad engines (i % 50 == 7), 3 YAML errors (i % 90 == 11)
    assert parallel.problems == serial.problems
