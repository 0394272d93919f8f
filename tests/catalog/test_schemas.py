"""The catalog JSON Schemas and the example catalog that must satisfy them.

The schemas are what editors show operators and the first layer of `llmgw validate`,
so besides being valid 2020-12 they must explain every field (`description`) and give
every pattern a readable phrase (`x-message`) for the validator to report instead of a regex.
The example catalog is checked both with jsonschema and with the third-party
`check-jsonschema` CLI, which matches patterns with ECMAScript regexes as editors do.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SCHEMAS = ROOT / "schemas"
CATALOG = ROOT / "examples" / "catalog"
SCHEMA_NAMES = ("llmgw", "nodes", "model")
CHECK_JSONSCHEMA = Path(sys.executable).parent / "check-jsonschema"


def _schema_path(name: str) -> Path:
    return SCHEMAS / f"{name}.schema.json"


def _load_schema(name: str) -> dict[str, Any]:
    return json.loads(_schema_path(name).read_text(encoding="utf-8"))


def _example_files() -> list[tuple[Path, str]]:
    """Every example file with the name of the schema it must satisfy."""
    files = [(CATALOG / "llmgw.yaml", "llmgw"), (CATALOG / "nodes.yaml", "nodes")]
    files += [(p, "model") for p in sorted((CATALOG / "models").glob("*.y*ml"))]
    return files


def _subschemas(schema: dict[str, Any], path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield every schema an operator's value can land in, with a readable path to it."""
    for key in ("properties", "$defs"):
        for name, sub in schema.get(key, {}).items():
            yield f"{path}/{key}/{name}", sub
            yield from _subschemas(sub, f"{path}/{key}/{name}")
    for key in ("items", "additionalProperties", "propertyNames"):
        sub = schema.get(key)
        if isinstance(sub, dict):
            yield f"{path}/{key}", sub
            yield from _subschemas(sub, f"{path}/{key}")


def _errors(schema_name: str, instance: Any) -> list[jsonschema.ValidationError]:
    validator = jsonschema.Draft202012Validator(_load_schema(schema_name))
    return list(validator.iter_errors(instance))


def _valid_model() -> dict[str, Any]:
    return {
        "name": "tiny",
        "source": "hf://org/tiny@v1",
        "size_gb": 1,
        "scaling": {"min": 0, "max": 1, "idle_after": "30m"},
        "profiles": [{"name": "gpu", "engine": "vllm", "gpus": 1}],
    }


@pytest.mark.parametrize("name", SCHEMA_NAMES)
def test_schema_is_valid_draft_2020_12(name: str) -> None:
    schema = _load_schema(name)
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["$id"] == f"https://llmgw.dev/schemas/{name}.schema.json"
    assert schema["title"]


@pytest.mark.parametrize("name", SCHEMA_NAMES)
def test_every_property_has_a_description(name: str) -> None:
    missing = [path for path, sub in _subschemas(_load_schema(name), "#") if not sub.get("description")]
    assert missing == []


@pytest.mark.parametrize("name", SCHEMA_NAMES)
def test_every_pattern_has_an_x_message(name: str) -> None:
    subs = list(_subschemas(_load_schema(name), "#"))
    assert any("pattern" in sub for _, sub in subs), "expected at least one pattern"
    missing = [path for path, sub in subs if "pattern" in sub and not sub.get("x-message")]
    assert missing == []


@pytest.mark.parametrize("name", SCHEMA_NAMES)
def test_objects_reject_unknown_keys(name: str) -> None:
    schema = _load_schema(name)
    open_objects = [
        path
        for path, sub in [("#", schema), *_subschemas(schema, "#")]
        if sub.get("type") == "object" and "additionalProperties" not in sub
    ]
    assert open_objects == []


@pytest.mark.parametrize(("path", "schema_name"), _example_files(), ids=lambda v: getattr(v, "name", v))
def test_example_file_validates(path: Path, schema_name: str) -> None:
    instance = yaml.safe_load(path.read_text(encoding="utf-8"))
    messages = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in _errors(schema_name, instance)]
    assert messages == []


@pytest.mark.parametrize(("path", "schema_name"), _example_files(), ids=lambda v: getattr(v, "name", v))
def test_example_file_points_editors_at_its_schema(path: Path, schema_name: str) -> None:
    first = path.read_text(encoding="utf-8").splitlines()[0]
    prefix = "# yaml-language-server: $schema="
    assert first.startswith(prefix)
    target = (path.parent / first.removeprefix(prefix)).resolve()
    assert target == _schema_path(schema_name).resolve()


def test_example_catalog_has_every_kind_of_model() -> None:
    models = [yaml.safe_load(p.read_text(encoding="utf-8")) for p, s in _example_files() if s == "model"]
    engines = {prof["engine"] for m in models for prof in m["profiles"]}
    assert engines == {"vllm", "sglang", "llama.cpp", "sim"}
    assert any(prof.get("nodes", 1) > 1 for m in models for prof in m["profiles"])
    assert {m["name"] for m in models} >= {"sim-chat", "sim-embed"}


def _run_check_jsonschema(schema_name: str, files: list[Path]) -> subprocess.CompletedProcess[str]:
    argv = [str(CHECK_JSONSCHEMA), "--schemafile", str(_schema_path(schema_name)), *map(str, files)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize("schema_name", SCHEMA_NAMES)
def test_check_jsonschema_accepts_examples(schema_name: str) -> None:
    files = [p for p, s in _example_files() if s == schema_name]
    result = _run_check_jsonschema(schema_name, files)
    assert result.returncode == 0, result.stdout + result.stderr


def test_check_jsonschema_rejects_a_shell_metacharacter_in_source(tmp_path: Path) -> None:
    # check-jsonschema matches patterns as ECMAScript, like editors: the regex must hold there too.
    bad = _valid_model()
    bad["source"] = "/models/x; rm -rf /"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad), encoding="utf-8")
    result = _run_check_jsonschema("model", [path])
    assert result.returncode == 1, result.stdout + result.stderr
    assert "source" in result.stdout + result.stderr


def test_valid_model_fixture_is_valid() -> None:
    assert _errors("model", _valid_model()) == []


def _single_error(instance: dict[str, Any]) -> jsonschema.ValidationError:
    errors = _errors("model", instance)
    assert len(errors) == 1, [e.message for e in errors]
    return errors[0]


def test_rejects_unknown_key_in_profile() -> None:
    model = _valid_model()
    model["profiles"][0]["gpu"] = 1
    error = _single_error(model)
    assert list(error.absolute_path) == ["profiles", 0]
    assert error.validator == "additionalProperties"
    assert "'gpu'" in error.message


def test_rejects_unknown_engine() -> None:
    model = _valid_model()
    model["profiles"][0]["engine"] = "vlm"
    error = _single_error(model)
    assert list(error.absolute_path) == ["profiles", 0, "engine"]
    assert error.validator == "enum"


def test_rejects_bad_duration_with_a_readable_message() -> None:
    model = _valid_model()
    model["scaling"]["idle_after"] = "30x"
    error = _single_error(model)
    assert list(error.absolute_path) == ["scaling", "idle_after"]
    assert error.validator == "pattern"
    assert error.schema["x-message"] == "a duration such as 90s, 15m or 1h30m"


@pytest.mark.parametrize(
    "source",
    ["hf://org/repo; rm -rf /", "/models/x; rm -rf /", "https://host/x$(id)", "s3://Bucket/x", "s3://bucket/",
     "gs://bucket/x", "models/x"],
)
def test_rejects_bad_source(source: str) -> None:
    model = _valid_model()
    model["source"] = source
    error = _single_error(model)
    assert list(error.absolute_path) == ["source"]
    assert error.validator == "pattern"
    assert "x-message" in error.schema


@pytest.mark.parametrize(
    "source",
    [
        "hf://meta-llama/Llama-3.1-8B-Instruct",
        "hf://meta-llama/Llama-3.1-8B-Instruct@0e9e39f249a16976918f6564b8830bc894c89659",
        "https://example.com/models/x.gguf",
        "file:///var/lib/llmgw/x",
        "/srv/models/x",
    ],
)
def test_accepts_each_source_form(source: str) -> None:
    model = _valid_model()
    model["source"] = source
    assert _errors("model", model) == []


def test_rejects_node_count_as_string() -> None:
    model = _valid_model()
    model["profiles"][0]["nodes"] = "2"
    error = _single_error(model)
    assert list(error.absolute_path) == ["profiles", 0, "nodes"]
    assert error.validator == "type"


def test_rejects_uppercase_profile_name() -> None:
    model = _valid_model()
    model["profiles"][0]["name"] = "H100"
    error = _single_error(model)
    assert list(error.absolute_path) == ["profiles", 0, "name"]
    assert error.schema["x-message"].startswith("a name of lowercase letters")


def test_rejects_non_string_engine_arg() -> None:
    model = _valid_model()
    model["profiles"][0]["args"] = ["--tensor-parallel-size", 4]
    error = _single_error(model)
    assert list(error.absolute_path) == ["profiles", 0, "args", 1]


def test_rejects_lowercase_env_name() -> None:
    model = _valid_model()
    model["profiles"][0]["env"] = {"vllm_use_v1": "1"}
    error = _single_error(model)
    assert list(error.absolute_path) == ["profiles", 0, "env"]
    assert "x-message" in error.schema


def test_rejects_ssh_option_as_node_address() -> None:
    nodes = {"nodes": [{"id": "n1", "address": "-oProxyCommand=sh"}]}
    errors = _errors("nodes", nodes)
    assert [list(e.absolute_path) for e in errors] == [["nodes", 0, "address"]]


def test_rejects_share_above_one() -> None:
    errors = _errors("llmgw", {"prune_guard": {"max_model_share": 1.5}})
    assert [list(e.absolute_path) for e in errors] == [["prune_guard", "max_model_share"]]


def test_rejects_typo_in_defaults_scaling() -> None:
    settings = {"defaults": {"scaling": {"idle_afer": "30m"}}}
    errors = _errors("llmgw", settings)
    assert [(list(e.absolute_path), e.validator) for e in errors] == [
        (["defaults", "scaling"], "additionalProperties")
    ]
