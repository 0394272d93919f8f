"""A catalog file costs what its bytes say: no YAML alias expansion, no numbers that raise.

Review 3: one 400 KB string aliased 190,000 times (a 752 KB file) passed every byte bound and
cost 38-76 GB once jsonschema formatted it or the reconciler fingerprinted it; 1,990 tiny
files of bounded alias blow-ups took 608 s; a 5,000-digit size raised ValueError out of
`llmgw validate`; `.nan` was a valid size.
"""

from __future__ import annotations

import json

import pytest

from llmgw.catalog import validate_files
from llmgw.catalog.loader import RawFile
from tests.catalog.corpus import BASE, SMALL


def validate(model: str, name: str = "models/small.yaml") -> list[str]:
    texts = {**BASE, name: model}
    files = {k: RawFile(k, v.encode(), len(v.encode())) for k, v in texts.items()}
    result = validate_files(files)
    assert result.catalog is None, "accepted"
    return [str(p) for p in result.problems]


def test_a_yaml_alias_is_refused_at_its_line() -> None:
    # Reported at the alias (the "*"), the first place the file stops costing what its bytes say.
    text = SMALL.replace("size_gb: 16", "size_gb: 16\nx-a: &s [" + "A" * 1000 + "]\nx-b: [*s, *s]")
    line = text.splitlines().index("x-b: [*s, *s]") + 1
    problems = validate(text)
    assert problems == [f"models/small.yaml:{line}:7: YAML aliases (*s) are not allowed in a catalog"]


def test_an_aliased_huge_value_is_refused_without_expanding_it() -> None:
    items = ",".join(["*s"] * 190_000)
    text = SMALL.replace("size_gb: 16", f"size_gb: [&s \"{'A' * 200_000}\", {items}]")
    problems = validate(text)
    assert len(problems) == 1 and "YAML aliases (*s) are not allowed" in problems[0]
    assert len(problems[0]) < 300


def test_a_self_referencing_alias_is_refused() -> None:
    problems = validate(SMALL.replace("size_gb: 16", "size_gb: 16\nx: &a [*a]"))
    assert len(problems) == 1 and "YAML aliases (*a) are not allowed" in problems[0]


def test_a_problem_quotes_at_most_a_few_hundred_characters_of_a_value() -> None:
    text = SMALL.replace("engine: vllm", f"engine: {'v' * 900_000}", 1)
    problems = validate(text)
    assert problems and all(len(p) < 400 for p in problems), [p[:500] for p in problems]
    assert len(json.dumps(problems)) < 4000


@pytest.mark.parametrize("value", ["9" * 5000, "9" * 400, "0x" + "f" * 5000, ":".join(["59"] * 2000), "1e999",
                                   "-.inf", ".nan", ".inf", "!!int " + "9" * 5000])
def test_a_huge_or_non_finite_number_is_a_problem_at_its_line(value: str) -> None:
    text = SMALL.replace("size_gb: 16", f"size_gb: {value}")
    line = text.splitlines().index(f"size_gb: {value}") + 1
    problems = validate(text)  # a huge int had raised ValueError, 0xfff... OverflowError
    assert len(problems) == 1 and problems[0].startswith(f"models/small.yaml:{line}:"), problems
    assert len(problems[0]) < 300


def test_a_huge_duration_is_a_problem_at_its_line() -> None:
    text = SMALL.replace("idle_after: 15m", "idle_after: " + "9" * 400 + "d")
    line = next(i for i, row in enumerate(text.splitlines(), 1) if row.lstrip().startswith("idle_after:"))
    problems = validate(text)
    assert len(problems) == 1 and problems[0].startswith(f"models/small.yaml:{line}:"), problems
    assert len(problems[0]) < 300


@pytest.mark.parametrize("where", ["top-level key", "nested key", "tenant"])
def test_a_huge_key_is_quoted_short(where: str) -> None:
    key = "k" * 900_000  # an explicit key ("? "): a plain one ends at 1,024 characters
    if where == "top-level key":
        text = SMALL.replace("size_gb: 16", f"size_gb: 16\n? {key}\n: 1")
    elif where == "nested key":
        text = SMALL.replace("  idle_after: 15m", f"  idle_after: 15m\n  ? {key}\n  : 1")
    else:
        text = SMALL.replace("aliases: [tiny]", f"aliases: [tiny, {key}]")
    problems = validate(text)
    assert problems and all(len(p) < 1200 for p in problems), [p[:300] for p in problems]
