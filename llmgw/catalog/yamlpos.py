"""YAML parsing that remembers where every value came from.

PyYAML's loaders throw positions away and silently keep the last of two duplicate keys,
so a catalog error could only say "somewhere in this file" and a duplicated `min:` would
go unnoticed. Here the node tree is composed with libyaml (fast enough for a 1,000-model
catalog) and turned into plain data by hand, recording the line and column of each key
and item under its path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import yaml

from llmgw.catalog.problems import Problem

Path = tuple[str | int, ...]

# libyaml's loader where available; the pure-Python one behaves the same, only slower.
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

# A real catalog file never comes near this many values. Aliases are refused outright (see
# _AliasFound), so a file's values are bounded by its bytes; this is a second bound.
MAX_NODES = 200_000
# No catalog number is written longer; a longer one would raise out of int()/float() later.
MAX_DIGITS = 30


@dataclass
class Document:
    """One parsed file: its data and the position (1-based line, col) of each path."""

    file: str
    data: Any
    positions: dict[Path, tuple[int, int]] = field(default_factory=dict)

    def at(self, path: Path) -> tuple[int, int]:
        """Position of ``path``, or of its nearest ancestor that has one (a missing key)."""
        p = tuple(path)
        while p:
            if p in self.positions:
                return self.positions[p]
            p = p[:-1]
        return self.positions.get((), (1, 1))

    def problem(self, path: Path, message: str) -> Problem:
        line, col = self.at(path)
        return Problem(self.file, line, col, message)


_STR_TAG = "tag:yaml.org,2002:str"
_INT_TAG = "tag:yaml.org,2002:int"
_FLOAT_TAG = "tag:yaml.org,2002:float"


class _Budget:
    def __init__(self) -> None:
        self.left = MAX_NODES
        # Node identities already built: libyaml returns the SAME node for every alias of an
        # anchor, so a second visit is an alias. One 400 KB string aliased 190,000 times in a
        # 752 KB file expanded to 76 GB once anything formatted it (review 3).
        self.seen: set[int] = set()


class _AliasFound(Exception):
    pass


class _Refused(Exception):
    """A value was refused (its problem recorded); the document is not fit for the schema."""


def _number(node: yaml.ScalarNode, loader: Any, doc: Document, problems: list[Problem]) -> Any:
    """A scalar that is not a plain string; a huge or non-finite number becomes a problem.

    int("9" * 5000) raises ValueError, a 400-digit int raises OverflowError when a rule turns
    it into a float, and .nan compares false with every bound, so it would pass them all.
    """
    line, col = _mark(node)
    # Its text, not its digits: 0x and 5,000 "f"s, or YAML 1.1's base-60 1:2:3:..., is as huge.
    if node.tag in (_INT_TAG, _FLOAT_TAG) and len(node.value) > MAX_DIGITS:
        problems.append(Problem(doc.file, line, col, f"number is written in more than {MAX_DIGITS} characters"))
        raise _Refused
    try:
        value = loader.construct_object(node, deep=True)
    except (ValueError, OverflowError) as exc:
        problems.append(Problem(doc.file, line, col, f"value cannot be read: {str(exc)[:100]}"))
        raise _Refused from None
    if isinstance(value, float) and not math.isfinite(value):
        problems.append(Problem(doc.file, line, col, "a number must be finite (not .nan or .inf)"))
        raise _Refused
    return value


def _mark(node: yaml.Node) -> tuple[int, int]:
    return node.start_mark.line + 1, node.start_mark.column + 1


def _build(
    node: yaml.Node,
    path: Path,
    loader: Any,
    doc: Document,
    problems: list[Problem],
    budget: _Budget,
) -> Any:
    budget.left -= 1
    if budget.left < 0:
        raise _TooLarge
    if id(node) in budget.seen:
        raise _AliasFound
    budget.seen.add(id(node))
    if isinstance(node, yaml.ScalarNode):
        # Most scalars are plain strings; skipping the constructor for them halves parsing.
        if node.tag == _STR_TAG:
            return node.value
        return _number(node, loader, doc, problems)
    if isinstance(node, yaml.SequenceNode):
        out_list = []
        for i, item in enumerate(node.value):
            doc.positions[path + (i,)] = _mark(item)
            out_list.append(_build(item, path + (i,), loader, doc, problems, budget))
        return out_list
    if isinstance(node, yaml.MappingNode):
        out: dict[Any, Any] = {}
        first_seen: dict[Any, tuple[int, int]] = {}
        for key_node, value_node in node.value:
            key = _build(key_node, path, loader, doc, problems, budget)
            line, col = _mark(key_node)
            if not isinstance(key, str | int | float | bool) and key is not None:
                problems.append(Problem(doc.file, line, col, "a mapping key must be a plain value"))
                continue
            if key in first_seen:
                prev = first_seen[key]
                problems.append(
                    Problem(doc.file, line, col, f'duplicate key "{key}" (first defined at line {prev[0]})')
                )
                continue
            first_seen[key] = (line, col)
            step: Path = (key,)  # type: ignore[assignment]  # a plain key, checked above
            doc.positions[path + step] = (line, col)
            out[key] = _build(value_node, path + step, loader, doc, problems, budget)
        return out
    raise TypeError(f"unexpected YAML node {node!r}")  # compose only yields the three kinds


class _TooLarge(Exception):
    pass


def parse_yaml(file: str, text: str) -> tuple[Document | None, list[Problem]]:
    """Parse one YAML document; on any problem the document is None or partial.

    Never raises for bad input: a syntax error, a second document, or a document that
    expands past MAX_NODES becomes a Problem at the place it was found.
    """
    problems: list[Problem] = []
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, [Problem(file, 1, 1, "file is empty; expected a mapping")]
        doc = Document(file, None, {(): _mark(node)})
        doc.data = _build(node, (), loader, doc, problems, _Budget())
        return doc, problems
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
        what = " ".join(x for x in (exc.context, exc.problem) if x)
        if "expected a single document" in what:
            what = "a catalog file holds one YAML document, but found a second one here"
        else:
            what = f"YAML syntax error: {what}"
        return None, [Problem(file, line, col, what)]
    except yaml.YAMLError as exc:
        return None, [Problem(file, 1, 1, f"YAML error: {exc}")]
    except _Refused:
        return None, problems
    except _AliasFound:
        return None, [_alias_problem(file, text)]
    except _TooLarge:
        return None, [
            Problem(file, 1, 1, f"document expands to more than {MAX_NODES} values (YAML aliases?)")
        ]
    except RecursionError:
        return None, [Problem(file, 1, 1, "document is nested too deeply")]
    finally:
        loader.dispose()


def _alias_problem(file: str, text: str) -> Problem:
    """The first alias in ``text``, found again with the event parser for its position.

    Only run once an alias was seen, so a catalog without aliases pays nothing for it.
    Catalog files do not need aliases; refusing them keeps a file's cost bounded by its bytes.
    """
    try:
        for event in yaml.parse(text, Loader=_Loader):
            if isinstance(event, yaml.AliasEvent):
                line, col = event.start_mark.line + 1, event.start_mark.column + 1
                name = str(event.anchor)[:40]
                return Problem(file, line, col, f"YAML aliases (*{name}) are not allowed in a catalog")
    except yaml.YAMLError:
        pass
    return Problem(file, 1, 1, "YAML aliases are not allowed in a catalog")
