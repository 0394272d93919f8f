"""The catalog reference in the README, generated from the schemas' own descriptions.

`python -m llmgw.catalog.reference --write README.md` refreshes the block between the
markers; a test fails when the README and the schemas disagree, so they cannot drift.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from llmgw.catalog.schema import load_schema

BEGIN = "<!-- catalog-reference:begin (generated from schemas/: python -m llmgw.catalog.reference) -->"
END = "<!-- catalog-reference:end -->"
FILES = (("settings", "llmgw.yaml"), ("nodes", "nodes.yaml"), ("model", "models/&lt;name&gt;.yaml"))


def _type(s: dict[str, Any], root: dict[str, Any]) -> str:
    if "$ref" in s:
        s = {**_deref(s["$ref"], root), **{k: v for k, v in s.items() if k != "$ref"}}
    if "enum" in s:
        return " \\| ".join(f"`{v}`" for v in s["enum"])
    t = s.get("type", "")
    if t == "array":
        return f"list of {_type(s.get('items', {}), root)}"
    return t if isinstance(t, str) else " or ".join(t)


def _deref(ref: str, root: dict[str, Any]) -> dict[str, Any]:
    node: Any = root
    for part in ref.lstrip("#/").split("/"):
        node = node[part]
    return node


def _rows(schema: dict[str, Any], root: dict[str, Any], prefix: str = "") -> list[str]:
    if "$ref" in schema:
        schema = {**_deref(schema["$ref"], root), **{k: v for k, v in schema.items() if k != "$ref"}}
    rows = []
    required = set(schema.get("required", ()))
    for name, prop in schema.get("properties", {}).items():
        full = f"{prefix}{name}"
        if "$ref" in prop:
            prop = {**_deref(prop["$ref"], root), **{k: v for k, v in prop.items() if k != "$ref"}}
        desc = " ".join(str(prop.get("description", "")).split()).replace("|", "\\|")
        req = "yes" if name in required else ""
        rows.append(f"| `{full}` | {_type(prop, root)} | {req} | {desc} |")
        if prop.get("type") == "object" and "properties" in prop:
            rows += _rows(prop, root, full + ".")
        items = prop.get("items", {})
        if "$ref" in items:
            items = _deref(items["$ref"], root)
        if prop.get("type") == "array" and isinstance(items, dict) and "properties" in items:
            rows += _rows(items, root, full + "[].")
    return rows


def render_reference() -> str:
    out = [BEGIN, ""]
    for kind, title in FILES:
        schema = load_schema(kind)
        out += [f"#### {title}", "", " ".join(str(schema.get("description", "")).split()), "",
                "| key | type | required | meaning |", "|---|---|---|---|", *_rows(schema, schema), ""]
    out.append(END)
    return "\n".join(out)


def splice(readme: str) -> str:
    start, end = readme.index(BEGIN), readme.index(END) + len(END)
    return readme[:start] + render_reference() + readme[end:]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--write", metavar="README", help="replace the generated block in this file")
    args = p.parse_args(argv)
    if args.write:
        path = Path(args.write)
        path.write_text(splice(path.read_text()))
    else:
        sys.stdout.write(render_reference() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
