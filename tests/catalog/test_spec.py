"""A model's spec as JSON and back (llmgw.catalog.spec): what the controller stores of the version a
model's stable replicas run, so it keeps running it after a canary of a newer commit is rolled back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from llmgw.catalog import read_directory, validate_files
from llmgw.catalog.model import (
    CanaryChecks,
    Model,
    ModelName,
    Profile,
    RolloutPolicy,
    Scaling,
)
from llmgw.catalog.spec import model_from_json, model_to_json
from tests.catalog.corpus import write_catalog

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "catalog"

EVERYTHING = """\
name: every-field
aliases: [all, meta/All-1.0]
task: completion
source: hf://org/all@v2
size_gb: 12.5
scaling: {min: 0, max: 3, idle_after: 1h30m, target_inflight: 4}
fallbacks: [small]
routing: prefix
rollout:
  strategy: canary
  steps: [2.5, 25, 60]
  interval: 45s
  checks: {error_rate: 0.5, ttft_p95: 1.5, itl_p95: 3, min_requests: 7}
  max_surge: 0
  max_unavailable: 2
profiles:
  - name: pair
    priority: 3
    engine: vllm
    gpus: 8
    nodes: 2
    gpu_class: [h100]
    gpu_memory_gb: 80
    memory_gb: 512.5
    fabric: ib
    args: ["--tensor-parallel-size", "8", "{weights}"]
    env: {OMP_NUM_THREADS: "4", NCCL_DEBUG: INFO}
  - name: cpu
    engine: llama.cpp
    gpus: 0
    pool: batch
"""


def roundtrip(model: Model) -> Model:
    # Through JSON text, as the controller's store keeps it.
    return model_from_json(json.loads(json.dumps(model_to_json(model))))


def example_models() -> list[Model]:
    result = validate_files(read_directory(EXAMPLES))
    assert result.catalog is not None, result.problems
    return list(result.catalog.models)


@pytest.mark.parametrize("model", example_models(), ids=lambda m: m.name)
def test_every_example_model_comes_back_equal(model: Model) -> None:
    assert roundtrip(model) == model


def test_a_model_with_every_optional_field_set_comes_back_equal(tmp_path: Path) -> None:
    result = validate_files(read_directory(write_catalog(tmp_path, {"models/every.yaml": EVERYTHING})))
    assert result.catalog is not None, result.problems
    model = result.catalog.model("every-field")
    assert model is not None
    # Every field differs from its default, so a field the spec dropped could not come back equal.
    defaults = Model(name=ModelName("x"), source="x", size_gb=1, profiles=())
    for name in ("aliases", "task", "scaling", "fallbacks", "routing", "rollout", "file"):
        assert getattr(model, name) != getattr(defaults, name), name
    assert model.rollout.checks != CanaryChecks() and model.scaling.idle_after == 5400.0
    pair = model.profiles[0]
    assert all(getattr(pair, f) != getattr(Profile("x", 0, "vllm", 0), f)
               for f in ("nodes", "gpu_class", "gpu_memory_gb", "memory_gb", "fabric", "args", "env"))
    back = roundtrip(model)
    assert back == model
    # Tuples, not lists: a spec read back is as hashable and frozen as the catalog's own.
    assert isinstance(back.profiles, tuple) and isinstance(back.profiles[0].env[0], tuple)
    assert isinstance(back.rollout.steps, tuple) and back.rollout.steps == (2.5, 25.0, 60.0)
    hash((back.aliases, back.profiles, back.rollout, back.scaling))


def test_the_json_is_plain_and_says_what_runs() -> None:
    model = Model(name=ModelName("m"), source="sim://m", size_gb=0.1,
                  profiles=(Profile("sim", 0, "sim", 1, args=("--ttft", "0.5")),),
                  scaling=Scaling(min=1, max=2, idle_after=None),
                  rollout=RolloutPolicy(strategy="canary", steps=(5.0,)))
    d = model_to_json(model)
    assert json.loads(json.dumps(d)) == d
    assert d["profiles"][0]["args"] == ["--ttft", "0.5"]
    assert d["rollout"]["steps"] == [5.0] and d["scaling"]["idle_after"] is None
    assert roundtrip(model) == model


GOOD = model_to_json(Model(name=ModelName("m"), source="sim://m", size_gb=1.0,
                           profiles=(Profile("sim", 0, "sim", 1, env=(("A", "1"),)),)))


def changed(path: tuple[Any, ...], value: Any) -> Any:
    d = json.loads(json.dumps(GOOD))
    node = d
    for part in path[:-1]:
        node = node[part]
    if value is KeyError:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return d


@pytest.mark.parametrize(("bad", "says"), [
    pytest.param([], "a model spec must be an object, got list", id="not-an-object"),
    pytest.param(changed(("name",), KeyError), "model spec: missing name", id="missing-name"),
    pytest.param(changed(("profiles",), KeyError), "model spec: missing profiles", id="missing-profiles"),
    pytest.param(changed(("colour",), "red"), 'model spec: unknown key "colour"', id="unknown-key"),
    pytest.param(changed(("size_gb",), "1"), "model spec: size_gb must be a number, got str", id="size-str"),
    pytest.param(changed(("size_gb",), True), "model spec: size_gb must be a number, got bool", id="size-bool"),
    pytest.param(changed(("size_gb",), float("nan")), "size_gb must be a finite number", id="size-nan"),
    pytest.param(changed(("profiles", 0, "gpus"), 1.0), "model spec: profiles[0].gpus must be an integer, got float",
                 id="gpus-float"),
    pytest.param(changed(("profiles", 0, "engine"), "bash"),
                 "model spec: profiles[0].engine must be one of vllm, sglang, llama.cpp, sim, got 'bash'",
                 id="engine-unknown"),
    pytest.param(changed(("profiles",), {"0": {}}), "model spec: profiles must be a list, got dict",
                 id="profiles-dict"),
    pytest.param(changed(("profiles", 0, "env", 0), ["A"]),
                 "model spec: profiles[0].env[0] must be a list of 2 items, got 1", id="env-pair"),
    pytest.param(changed(("rollout", "strategy"), "blue-green"),
                 "model spec: rollout.strategy must be one of replace, canary, got 'blue-green'", id="strategy"),
    pytest.param(changed(("rollout", "steps"), "5"), "model spec: rollout.steps must be a list, got str", id="steps"),
    pytest.param(changed(("rollout", "checks"), None), "model spec: rollout.checks must be an object, got NoneType",
                 id="checks-null"),
    pytest.param(changed(("scaling", "idle_after"), "5m"),
                 "model spec: scaling.idle_after must be a number or null, got str", id="idle-str"),
    pytest.param(changed(("aliases",), ["a", 3]), "model spec: aliases[1] must be a string, got int", id="alias-int"),
])
def test_a_malformed_spec_is_a_value_error_naming_the_field(bad: Any, says: str) -> None:
    with pytest.raises(ValueError) as info:
        model_from_json(bad)
    assert says in str(info.value)


def test_a_spec_without_the_optional_fields_gets_their_defaults() -> None:
    # A spec stored before a field existed still reads: the field takes its default.
    d = {"name": "m", "source": "sim://m", "size_gb": 1.0,
         "profiles": [{"name": "sim", "priority": 0, "engine": "sim", "gpus": 1}]}
    assert model_from_json(d) == Model(name=ModelName("m"), source="sim://m", size_gb=1.0,
                                       profiles=(Profile("sim", 0, "sim", 1),))
