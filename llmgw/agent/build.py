"""Join the agent's modules (llmgw/agent/parts) into the one file a node runs (DESIGN §4).

A node has nothing but python3, and the controller uploads llmgw/agent/llmgw_agent.py as it is and
checks its hash; the agent is still written as modules. `python -m llmgw.agent.build` concatenates
the parts in the fixed order of PARTS, drops their imports of each other, merges their standard
library imports into one header and keeps the first part's docstring as the file's. The output is
a pure function of the parts' text (no time, no paths, no ordering taken from a dict or the file
system), so two builds give the same bytes and the uploaded hash only moves when the code does.
The generated file is committed: tests/agent/test_agent_build.py fails when it and the parts differ.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

AGENT_DIR = Path(__file__).resolve().parent
PARTS_DIR = AGENT_DIR / "parts"
OUTPUT = AGENT_DIR / "llmgw_agent.py"
PARTS_PACKAGE = "llmgw.agent.parts"
# Each part imports only from parts before it (no cycles): the order the joined file defines them in.
PARTS = (
    "protocol", "config", "files", "cache", "lease", "sources", "local", "download", "s3", "spawn", "growing", "peer",
    "fetch", "peerflags", "args", "sandbox", "records", "engines", "stopping", "status", "inventory", "guard", "main",
)
HEADER = "# generated from llmgw/agent/parts by python -m llmgw.agent.build: edit the parts\n"
LINE_LENGTH = 120


class BuildError(Exception):
    """A part the single file cannot be made from (a top-level import outside the standard library)."""


@dataclass
class _Imports:
    plain: set[str] = field(default_factory=set)
    froms: dict[str, set[str]] = field(default_factory=dict)

    def add(self, node: ast.Import | ast.ImportFrom, *, where: str) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                _require_stdlib(alias.name, where=where)
                if alias.asname:
                    raise BuildError(f"{where}: `import {alias.name} as {alias.asname}` is not supported")
                self.plain.add(alias.name)
            return
        module = node.module or ""
        if node.level or not module:
            raise BuildError(f"{where}: relative imports are not supported; import from {PARTS_PACKAGE}")
        _require_stdlib(module, where=where)
        for alias in node.names:
            if alias.asname:
                raise BuildError(f"{where}: `from {module} import {alias.name} as {alias.asname}` is not supported")
            self.froms.setdefault(module, set()).add(alias.name)

    def render(self) -> str:
        out = [f"import {name}\n" for name in sorted(self.plain)]
        for module in sorted(self.froms):
            out.append(_from_line(module, sorted(self.froms[module], key=_name_order)))
        return "".join(out)


def _name_order(name: str) -> tuple[int, str]:
    # The order ruff's isort keeps names in (constants, classes, functions), so the output is lint-clean.
    if name.isupper() and len(name) > 1:
        return 0, name
    return (1 if name[:1].isupper() else 2), name


def _from_line(module: str, names: list[str]) -> str:
    line = f"from {module} import {', '.join(names)}\n"
    if len(line) - 1 <= LINE_LENGTH:
        return line
    return f"from {module} import (\n" + "".join(f"    {name},\n" for name in names) + ")\n"


def _require_stdlib(module: str, *, where: str) -> None:
    # The node has python3 and nothing else: one third-party import would make the agent fail there.
    if module.split(".")[0] not in sys.stdlib_module_names:
        raise BuildError(f"{where}: imports {module!r}, which is not in the standard library")


def _part_body(name: str, source: str, imports: _Imports) -> tuple[str | None, str]:
    """The part's docstring and its code without its top-level imports; its stdlib ones go to `imports`.

    Imports inside functions stay where they are: they are deliberate (a module only one verb needs,
    kept off every other verb's start-up; an optional package a node may lack, behind ImportError).
    """
    where = f"llmgw/agent/parts/{name}.py"
    tree = ast.parse(source, filename=where)
    lines = source.splitlines(keepends=True)
    drop: set[int] = set()
    docstring = ast.get_docstring(tree, clean=False)
    body = tree.body
    if docstring is not None:
        first = body[0]
        drop.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
        body = body[1:]
    for node in body:
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        span = range(node.lineno, (node.end_lineno or node.lineno) + 1)
        drop.update(span)
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            continue
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PARTS_PACKAGE + "."):
            continue
        imports.add(node, where=f"{where}:{node.lineno}")
    kept = "".join(line for number, line in enumerate(lines, start=1) if number not in drop)
    return docstring, kept.strip("\n") + "\n"


def build(parts_dir: Path = PARTS_DIR) -> str:
    """The text of the single agent file, made from the parts in PARTS order."""
    imports = _Imports()
    docstring: str | None = None
    sections = []
    for name in PARTS:
        source = (parts_dir / f"{name}.py").read_text(encoding="utf-8")
        part_doc, code = _part_body(name, source, imports)
        if name == PARTS[0]:
            docstring = part_doc
        sections.append(f"# ---- llmgw/agent/parts/{name}.py ----\n\n{code}")
    if docstring is None:
        raise BuildError(f"llmgw/agent/parts/{PARTS[0]}.py: needs the module docstring the node file opens with")
    head = f'#!/usr/bin/env python3\n{HEADER}"""{docstring}"""\n\nfrom __future__ import annotations\n\n'
    return head + imports.render() + "\n" + "\n\n".join(sections)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmgw.agent.build", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if llmgw_agent.py differs from the parts")
    args = parser.parse_args(argv)
    try:
        text = build()
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    current = OUTPUT.read_text(encoding="utf-8") if OUTPUT.exists() else None
    if args.check:
        if current != text:
            print(f"{OUTPUT} is out of date: run python -m llmgw.agent.build", file=sys.stderr)
            return 1
        return 0
    if current != text:
        OUTPUT.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
