"""First layer of validation: each file against its JSON Schema (draft 2020-12).

jsonschema's own messages ("'30x' does not match '^([0-9]+(ms|s|m|h|d))+$'") are written
for schema authors; an operator needs to read which key is wrong and what it should be.
Each error is rewritten here from its keyword, and a pattern's meaning comes from the
schema's own ``x-message`` so the schema stays the single place that says it.
"""

from __future__ import annotations

import difflib
import itertools
import json
from functools import cache
from pathlib import Path as FsPath
from typing import Any

import jsonschema
from jsonschema import Draft202012Validator

from llmgw.catalog.problems import Problem
from llmgw.catalog.yamlpos import Document, Path

SCHEMA_DIR = FsPath(__file__).resolve().parent / "schemas"
SCHEMA_FILES = {
    "settings": "llmgw.schema.json",
    "nodes": "nodes.schema.json",
    "model": "model.schema.json",
}

_TYPE_NAMES = {
    "string": "a string",
    "integer": "an integer",
    "number": "a number",
    "boolean": "true or false",
    "array": "a list",
    "object": "a mapping",
    "null": "nothing",
}


@cache
def load_schema(kind: str) -> dict[str, Any]:
    return json.loads((SCHEMA_DIR / SCHEMA_FILES[kind]).read_text(encoding="utf-8"))


def _anchored_pattern(validator: Any, pattern: str, instance: Any, schema: dict[str, Any]) -> Any:
    # Python's `$` also matches before a final newline, so "gpu\n" would pass a name
    # pattern that editors (JavaScript regexes) reject; a newline in a name or source is
    # never meant. Same check as the standard keyword otherwise.
    yield from _PATTERN(validator, pattern, instance, schema)
    if isinstance(instance, str) and pattern.endswith("$") and instance.endswith("\n"):
        yield jsonschema.ValidationError(f'"{_clip(str(instance))}" ends with a newline')


_PATTERN = Draft202012Validator.VALIDATORS["pattern"]
_Validator = jsonschema.validators.extend(Draft202012Validator, {"pattern": _anchored_pattern})


def inline_refs(schema: Any, root: dict[str, Any] | None = None) -> Any:
    """The schema with every local ``#/$defs/...`` reference replaced by its target.

    Resolving a $ref through the referencing registry costs more than checking the value
    it points to; the schemas have no recursive references, so inlining them once makes
    a 1,000-model catalog validate about a third faster.
    """
    root = schema if root is None else root
    if isinstance(schema, list):
        return [inline_refs(s, root) for s in schema]
    if not isinstance(schema, dict):
        return schema
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/"):
        target: Any = root
        for part in ref[2:].split("/"):
            target = target[part]
        merged = {**inline_refs(target, root), **{k: inline_refs(v, root) for k, v in schema.items() if k != "$ref"}}
        return merged
    return {k: inline_refs(v, root) for k, v in schema.items()}


@cache
def _validator(kind: str) -> Any:
    return _Validator(inline_refs(load_schema(kind)))


def dotted(path: Path) -> str:
    """``("profiles", 0, "gpus")`` → ``profiles[0].gpus``."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


# A problem quotes a value so the operator recognises it, never whole: fifty problems each
# quoting a 900 KB string made a 172 MiB rejection, stored and served on every poll.
MAX_QUOTED = 200


def _clip(text: str) -> str:
    if len(text) <= MAX_QUOTED:
        return text
    return f"{text[:MAX_QUOTED]}... ({len(text):,} characters)"


def _describe(value: Any) -> str:
    if isinstance(value, bool):
        return f"boolean {str(value).lower()}"
    if value is None:
        return "nothing"
    if isinstance(value, str):
        return f'string "{_clip(value)}"'
    if isinstance(value, int | float):
        return f"number {_clip(str(value))}"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return type(value).__name__


def _first_duplicate(items: list[Any]) -> Any:
    seen: set[str] = set()
    for item in items:
        key = json.dumps(item, sort_keys=True, default=str)
        if key in seen:
            return item
        seen.add(key)
    return None


def _message(error: jsonschema.ValidationError) -> tuple[Path, str]:
    """Where the error should point, and the operator-facing message."""
    path: Path = tuple(error.absolute_path)
    if "propertyNames" in error.schema_path:
        # jsonschema checks a key as if it were a value at the mapping's own path;
        # point at the key itself and say it is a key.
        key = error.instance
        where = _clip(dotted(path))
        meaning = (error.schema or {}).get("x-message") if isinstance(error.schema, dict) else None
        what = f"must be {meaning}" if meaning else _clip(error.message)
        return path + (key,), f'{where + ": " if where else ""}key "{_clip(str(key))}" is not valid: {what}'
    where = _clip(dotted(path))
    prefix = f"{where}: " if where else ""
    kw = error.validator
    schema = error.schema if isinstance(error.schema, dict) else {}
    value = error.instance
    if kw == "required":
        return path, f'{prefix}missing required key "{_missing(error)}"'
    if kw == "additionalProperties" and isinstance(value, dict):
        allowed = sorted(schema.get("properties", {}))
        extra = sorted(k for k in value if k not in allowed)
        key = extra[0] if extra else "?"
        hint = difflib.get_close_matches(str(key), allowed, n=1)
        tail = f' (did you mean "{hint[0]}"?)' if hint else f" (allowed: {', '.join(allowed)})"
        return path + (key,), f'{prefix}unknown key "{_clip(str(key))}"{tail}'
    if kw == "type":
        expected = error.validator_value
        names = [expected] if isinstance(expected, str) else list(expected)
        want = " or ".join(_TYPE_NAMES.get(n, n) for n in names)
        return path, f"{prefix}expected {want}, got {_describe(value)}"
    if kw == "enum":
        options = ", ".join(str(o) for o in error.validator_value)
        return path, f"{prefix}{_describe(value)} is not one of: {options}"
    if kw == "const":
        return path, f"{prefix}must be {error.validator_value!r}"
    if kw == "pattern":
        meaning = schema.get("x-message", f"match {error.validator_value}")
        return path, f"{prefix}{_describe(value)} is not valid: must be {meaning}"
    if kw in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
        op = {"minimum": ">=", "exclusiveMinimum": ">", "maximum": "<=", "exclusiveMaximum": "<"}[kw]
        return path, f"{prefix}must be {op} {error.validator_value}, got {_clip(str(value))}"
    if kw == "minItems":
        n = error.validator_value
        return path, f"{prefix}must have at least {n} item{'s' if n != 1 else ''}"
    if kw == "maxItems":
        return path, f"{prefix}must have at most {error.validator_value} items"
    if kw == "uniqueItems":
        return path, f"{prefix}lists {_describe(_first_duplicate(value))} more than once"
    if kw in ("minLength", "maxLength"):
        word = "at least" if kw == "minLength" else "at most"
        return path, f"{prefix}must be {word} {error.validator_value} characters long"
    if kw == "propertyNames":
        return path, f"{prefix}key {_describe(value)} is not allowed here"
    return path, f"{prefix}{_clip(error.message)}"


# A file may hold a list of 190,000 wrong values: each is a problem, and all of them had cost 58 s
# and 900 MB to find and describe for four such files (and then the stored rejection held them
# all). One file's first problems say what is wrong with it; the rest are counted out.
MAX_FILE_PROBLEMS = 50


def check_schema(kind: str, doc: Document) -> list[Problem]:
    """The schema violations in ``doc`` (the first MAX_FILE_PROBLEMS found, then one saying there
    are more), sorted by position, each as a Problem."""
    errors = list(itertools.islice(_validator(kind).iter_errors(doc.data), MAX_FILE_PROBLEMS + 1))
    more = len(errors) > MAX_FILE_PROBLEMS
    errors = errors[:MAX_FILE_PROBLEMS]
    typos = _typo_fixes(errors)
    problems = []
    for error in errors:
        if error.validator == "required" and _missing(error) in typos.get(tuple(error.absolute_path), ()):
            # `gpu: 1` for `gpus: 1` is one mistake: the unknown key already says
            # "did you mean gpus", so "missing gpus" would only be noise.
            continue
        path, message = _message(error)
        problems.append(doc.problem(path, message))
    if more:
        problems.append(Problem(doc.file, 1, 1, f"more than {MAX_FILE_PROBLEMS} problems in this file; "
                                                "the first are shown, fix them and validate again"))
    return sorted(set(problems))


def _missing(error: jsonschema.ValidationError) -> str | None:
    value = error.instance
    return next((r for r in error.validator_value if isinstance(value, dict) and r not in value), None)


def _typo_fixes(errors: list[jsonschema.ValidationError]) -> dict[Path, set[str]]:
    """Per object path, the allowed keys that an unknown key there is a near-miss for."""
    out: dict[Path, set[str]] = {}
    for e in errors:
        if e.validator == "additionalProperties" and isinstance(e.instance, dict):
            allowed = list((e.schema or {}).get("properties", {}))
            for key in e.instance:
                if key not in allowed:
                    out.setdefault(tuple(e.absolute_path), set()).update(
                        difflib.get_close_matches(str(key), allowed, n=1))
    return out
