"""YAML parsing that remembers where every value came from.

PyYAML's loaders throw positions away and silently keep the last of two duplicate keys,
so a catalog error could only say "somewhere in this file" and a duplicated `min:` would
go unnoticed. Here the node tree is composed with libyaml (fast enough for a 1,000-model
catalog) and turned into plain data by hand, recording the line and column of each key
and item under its path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import yaml

from llmgw.catalog.problems import Problem

Path = tuple[str | int, ...]

# libyaml's loader where available; the pure-Python one behaves the same, only slower.
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

# Aliases can make a small file expand into a huge tree (the "billion laughs" document);
# a real catalog file never comes near this many values.
MAX_NODES = 200_000


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


class _Budget:
    def __init__(self) -> None:
        self.left = MAX_NODES


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
    if isinstance(node, yaml.ScalarNode):
        # Most scalars are plain strings; skipping the constructor for them halves parsing.
        if node.tag == _STR_TAG:
            return node.value
        return loader.construct_object(node, deep=True)
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
    except _TooLarge:
        return None, [
            Problem(file, 1, 1, f"document expands to more than {MAX_NODES} values (YAML aliases?)")
        ]
    except RecursionError:
        return None, [Problem(file, 1, 1, "document is nested too deeply")]
    finally:
        loader.dispose()
