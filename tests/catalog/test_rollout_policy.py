"""A model's `rollout:` block and llmgw.yaml's `defaults: rollout:` (issue 26).

Every rule is checked where an operator would meet it: `llmgw validate` on a catalog directory,
the problem at the file and line of the offending key. Line numbers are read off the literal
YAML below (corpus.SMALL is 13 lines, corpus.SETTINGS 5).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from llmgw.catalog import CanaryChecks, Problem, RolloutPolicy, read_directory, validate_files
from llmgw.catalog.model import Model
from tests.catalog.corpus import SETTINGS, SMALL, write_catalog

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "catalog"

FULL = """\
rollout:
  strategy: canary
  steps: [5, 25, 50]
  interval: 30s
  checks:
    error_rate: 2
    ttft_p95: 2.0
    itl_p95: 2.5
    min_requests: 20
  max_surge: 2
  max_unavailable: 0
"""


def validate(tmp_path: Path, files: dict[str, str | bytes | None]) -> tuple[list[Model], list[Problem]]:
    result = validate_files(read_directory(write_catalog(tmp_path, files)))
    models = list(result.catalog.models) if result.catalog else []
    return models, list(result.problems)


def small(models: list[Model]) -> Model:
    return next(m for m in models if m.name == "small")


def test_no_rollout_anywhere_is_replace_with_the_documented_defaults(tmp_path: Path) -> None:
    models, problems = validate(tmp_path, {})
    assert problems == []
    assert all(m.rollout == RolloutPolicy() for m in models)
    assert RolloutPolicy().strategy == "replace"


def test_a_full_block_builds_the_policy(tmp_path: Path) -> None:
    models, problems = validate(tmp_path, {"models/small.yaml": SMALL + FULL})
    assert problems == []
    assert small(models).rollout == RolloutPolicy(
        strategy="canary", steps=(5.0, 25.0, 50.0), interval=30.0,
        checks=CanaryChecks(error_rate=2.0, ttft_p95=2.0, itl_p95=2.5, min_requests=20),
        max_surge=2, max_unavailable=0)
    assert all(isinstance(s, float) for s in small(models).rollout.steps)


def test_a_models_block_overrides_the_default_field_by_field_and_checks_key_by_key(tmp_path: Path) -> None:
    settings = SETTINGS + """\
defaults:
  rollout:
    strategy: canary
    steps: [5, 50]
    interval: 2m
    checks: {error_rate: 1, min_requests: 50}
    max_surge: 2
"""
    model = SMALL + "rollout:\n  steps: [20]\n  checks: {ttft_p95: 3}\n"
    models, problems = validate(tmp_path, {"llmgw.yaml": settings, "models/small.yaml": model})
    assert problems == []
    default = RolloutPolicy(strategy="canary", steps=(5.0, 50.0), interval=120.0,
                            checks=CanaryChecks(error_rate=1.0, min_requests=50), max_surge=2)
    assert small(models).rollout == RolloutPolicy(
        strategy="canary", steps=(20.0,), interval=120.0,
        checks=CanaryChecks(error_rate=1.0, ttft_p95=3.0, itl_p95=2.0, min_requests=50),
        max_surge=2, max_unavailable=1)
    big = next(m for m in models if m.name == "big")
    assert big.rollout == default
    result = validate_files(read_directory(tmp_path))
    assert result.catalog is not None and result.catalog.settings.default_rollout == default


def test_a_step_without_traffic_has_a_bounded_wait_and_a_written_policy(tmp_path: Path) -> None:
    models, problems = validate(tmp_path, {"models/small.yaml": SMALL + FULL + "  traffic_timeout: 20m\n"
                                           "  on_no_traffic: wait\n"})
    assert problems == []
    assert (small(models).rollout.traffic_wait, small(models).rollout.on_no_traffic) == (1200.0, "wait")
    # Unwritten: three intervals, at least 15 minutes; rolled back, so no change goes out unjudged.
    assert RolloutPolicy(interval=30.0).traffic_wait == 900.0 and RolloutPolicy(interval=600.0).traffic_wait == 1800.0
    assert RolloutPolicy().on_no_traffic == "rollback"


def test_a_model_may_go_back_to_replace_under_a_canary_default(tmp_path: Path) -> None:
    settings = SETTINGS + "defaults:\n  rollout: {strategy: canary, steps: [10]}\n"
    models, problems = validate(tmp_path, {"llmgw.yaml": settings,
                                           "models/small.yaml": SMALL + "rollout: {strategy: replace}\n"})
    assert problems == []
    assert small(models).rollout.strategy == "replace"
    assert next(m for m in models if m.name == "big").rollout.strategy == "canary"


# (the block's lines after `rollout:`, the offending line's offset from `rollout:`, what the message says)
RULES = [
    pytest.param("  steps: [5, 50, 25]\n", 1, "steps[2]: 25 is not above the step before it (50): steps must "
                 "strictly increase", id="steps-decrease"),
    pytest.param("  steps:\n    - 5\n    - 5\n", 3, "steps[1]: 5 is not above the step before it (5)",
                 id="steps-repeat"),
    pytest.param("  steps: [0, 50]\n", 1, "must be > 0, got 0", id="step-zero"),
    pytest.param("  steps: [-5]\n", 1, "must be > 0, got -5", id="step-negative"),
    pytest.param("  steps: [50, 100]\n", 1, "must be < 100, got 100", id="step-hundred"),
    pytest.param("  steps: [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]\n", 1, "must have at most 10 items",
                 id="eleven-steps"),
    pytest.param("  steps: []\n", 1, "must have at least 1 item", id="no-steps"),
    pytest.param("  strategy: canary\n  steps: ['5']\n", 2, "expected a number", id="step-string"),
    pytest.param("  interval: 500ms\n", 1, "interval: 500ms is shorter than 1s", id="interval-short"),
    pytest.param("  interval: 25h\n", 1, "interval: 25h is longer than 24h", id="interval-long"),
    pytest.param("  interval: 0s\n", 1, "interval: must be longer than 0s", id="interval-zero"),
    pytest.param("  interval: 30m1h\n", 1, "units must go from largest to smallest", id="interval-order"),
    pytest.param("  interval: 30\n", 1, "expected a string", id="interval-number"),
    pytest.param("  max_surge: 0\n  max_unavailable: 0\n", 1,
                 "max_surge and max_unavailable are both 0: the rollout would never make progress",
                 id="both-zero"),
    pytest.param("  max_surge: -1\n", 1, "must be >= 0, got -1", id="surge-negative"),
    pytest.param("  max_unavailable: 1.5\n", 1, "expected an integer", id="unavailable-fraction"),
    pytest.param("  checks:\n    ttft_p95: 0.5\n", 2, "ttft_p95: must be >= 1, got 0.5", id="ttft-below-1"),
    pytest.param("  checks:\n    itl_p95: 0.99\n", 2, "itl_p95: must be >= 1, got 0.99", id="itl-below-1"),
    pytest.param("  checks:\n    error_rate: 101\n", 2, "error_rate: must be <= 100, got 101", id="error-over"),
    pytest.param("  checks:\n    error_rate: -1\n", 2, "error_rate: must be >= 0, got -1", id="error-negative"),
    pytest.param("  checks:\n    min_requests: 0\n", 2, "min_requests: must be >= 1, got 0", id="min-requests-0"),
    pytest.param("  checks:\n    min_request: 5\n", 2, 'unknown key "min_request" (did you mean "min_requests"?)',
                 id="checks-typo"),
    pytest.param("  stratgy: canary\n", 1, 'unknown key "stratgy" (did you mean "strategy"?)', id="typo"),
    pytest.param("  strategy: blue-green\n", 1, 'string "blue-green" is not one of: replace, canary',
                 id="strategy-unknown"),
    pytest.param("  interval: 10m\n  traffic_timeout: 5m\n", 2,
                 "traffic_timeout: 5m is shorter than interval (600 s): a step is judged only after its interval",
                 id="traffic-timeout-short"),
    pytest.param("  on_no_traffic: ignore\n", 1, 'string "ignore" is not one of: wait, promote, rollback',
                 id="no-traffic-unknown"),
    pytest.param("  traffic_timeout: soon\n", 1, "traffic_timeout", id="traffic-timeout-unparsed"),
]


@pytest.mark.parametrize(("block", "offset", "message"), RULES)
def test_each_rule_in_a_model_file_at_its_key(tmp_path: Path, block: str, offset: int, message: str) -> None:
    _, problems = validate(tmp_path, {"models/small.yaml": SMALL + "rollout:\n" + block})
    assert [(p.file, p.line) for p in problems] == [("models/small.yaml", 14 + offset)], problems
    assert message in problems[0].message, problems[0]


@pytest.mark.parametrize(("block", "offset", "message"), RULES)
def test_each_rule_in_the_llmgw_yaml_default_at_its_key(tmp_path: Path, block: str, offset: int,
                                                         message: str) -> None:
    indented = "".join("  " + line + "\n" for line in block.splitlines())
    _, problems = validate(tmp_path, {"llmgw.yaml": SETTINGS + "defaults:\n  rollout:\n" + indented})
    # Reported once, in llmgw.yaml: not again in every model that inherits it.
    assert [(p.file, p.line) for p in problems] == [("llmgw.yaml", 7 + offset)], problems
    assert message in problems[0].message, problems[0]


def test_a_rule_message_names_the_whole_key(tmp_path: Path) -> None:
    _, problems = validate(tmp_path, {"models/small.yaml": SMALL + "rollout:\n  interval: 25h\n"})
    assert str(problems[0]) == ("models/small.yaml:15:3: rollout.interval: 25h is longer than 24h: each canary "
                                "step is judged at most a day after it starts")


def test_interval_bounds_are_inclusive(tmp_path: Path) -> None:
    for text, seconds in (("1s", 1.0), ("24h", 86400.0), ("1000ms", 1.0)):
        models, problems = validate(tmp_path, {"models/small.yaml": SMALL + f"rollout:\n  interval: {text}\n"})
        assert problems == [] and small(models).rollout.interval == seconds, (text, problems)


def test_surge_and_unavailable_both_zero_across_files_is_reported_at_the_models_key(tmp_path: Path) -> None:
    settings = SETTINGS + "defaults:\n  rollout:\n    max_unavailable: 0\n"
    _, problems = validate(tmp_path, {"llmgw.yaml": settings, "models/small.yaml": SMALL + "rollout:\n"
                                      "  max_surge: 0\n"})
    assert [str(p) for p in problems] == [
        "models/small.yaml:15:3: rollout.max_surge: max_surge and max_unavailable are both 0: the rollout "
        "would never make progress (max_unavailable 0 comes from defaults.rollout in llmgw.yaml)"]


def test_a_default_of_no_surge_is_fine_when_models_may_stop_one_first(tmp_path: Path) -> None:
    settings = SETTINGS + "defaults:\n  rollout:\n    max_surge: 0\n"
    models, problems = validate(tmp_path, {"llmgw.yaml": settings})
    assert problems == [] and all(m.rollout.max_surge == 0 and m.rollout.max_unavailable == 1 for m in models)


def test_every_problem_of_a_block_at_once(tmp_path: Path) -> None:
    block = "rollout:\n  steps: [50, 25]\n  interval: 2d\n  max_surge: 0\n  max_unavailable: 0\n"
    _, problems = validate(tmp_path, {"models/small.yaml": SMALL + block})
    assert [p.line for p in problems] == [15, 16, 17]


def test_the_rollout_definitions_of_both_schemas_agree() -> None:
    model = json.loads((ROOT / "schemas" / "model.schema.json").read_text())
    settings = json.loads((ROOT / "schemas" / "llmgw.schema.json").read_text())
    for name in ("rollout", "canary_checks"):
        assert model["$defs"][name] == settings["$defs"][name], name


def test_the_examples_validate_and_keep_replacing() -> None:
    result = validate_files(read_directory(EXAMPLES))
    assert result.catalog is not None, result.problems
    assert result.catalog.settings.default_rollout == RolloutPolicy()
    assert {m.rollout.strategy for m in result.catalog.models} == {"replace"}


def test_the_examples_commented_canary_blocks_are_valid_once_uncommented(tmp_path: Path) -> None:
    # An operator uncomments them as they stand; they must then validate and mean what they say.
    files = {rel: (EXAMPLES / rel).read_text() for rel in ("llmgw.yaml", "nodes.yaml")}
    files |= {f"models/{p.name}": p.read_text() for p in (EXAMPLES / "models").glob("*.yaml")}
    settings = files["llmgw.yaml"].replace("    strategy: replace\n", "")
    files["llmgw.yaml"] = re.sub(r"^    #   ", "    ", settings, flags=re.M)
    llama = "models/llama-3.1-8b-instruct.yaml"
    files[llama] = re.sub(r"^# (rollout:|  \w+: .*)$", r"\1", files[llama], flags=re.M)
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    result = validate_files(read_directory(tmp_path))
    assert result.catalog is not None, result.problems
    default = result.catalog.settings.default_rollout
    assert default == RolloutPolicy(strategy="canary", steps=(5.0, 25.0, 50.0), interval=60.0)
    model = result.catalog.model("llama-3.1-8b-instruct")
    assert model is not None and model.rollout == RolloutPolicy(strategy="canary", steps=(5.0, 25.0, 50.0),
                                                                interval=120.0)


ACCEPTANCE = """\
rollout:
  acceptance:
    - name: capital
      messages: [{role: user, content: What is the capital of France?}]
      max_tokens: 8
      latency: 5s
      expect: {contains: [Paris], matches: "Paris"}
    - prompt: "2 + 2 ="
      expect: {json_schema: {type: integer}}
"""


def test_acceptance_prompts_build_and_their_mistakes_are_reported_at_their_keys(tmp_path: Path) -> None:
    models, problems = validate(tmp_path, {"models/small.yaml": SMALL + ACCEPTANCE})
    assert problems == []
    first, second = small(models).rollout.acceptance
    assert (first.name, first.messages, first.max_tokens, first.latency, first.contains) == (
        "capital", (("user", "What is the capital of France?"),), 8, 5.0, ("Paris",))
    assert (second.name, second.prompt, json.loads(second.json_schema or "{}")) == (
        "acceptance[1]", "2 + 2 =", {"type": "integer"})
    bad = """\
rollout:
  acceptance:
    - prompt: x
      messages: [{role: user, content: y}]
      expect: {contains: [a]}
    - prompt: x
      expect: {matches: "(unclosed"}
    - prompt: x
      expect: {json_schema: {type: 12}}
"""
    _, problems = validate(tmp_path, {"models/small.yaml": SMALL + bad})
    found = sorted((p.line, p.message) for p in problems)
    assert [line for line, _ in found] == [16, 20, 22], found
    assert "give either messages (a chat) or prompt (a completion), not both" in found[0][1]
    assert "expect.matches: not a regular expression" in found[1][1]
    assert "expect.json_schema: not a JSON Schema" in found[2][1]
    _, problems = validate(tmp_path, {"models/small.yaml": SMALL + "rollout:\n  acceptance:\n    - prompt: x\n"
                                      "      expect: {}\n"})
    assert [(p.line, p.message) for p in problems] == [(17, "rollout.acceptance[0].expect: {} should be non-empty")]
