"""`llmgw validate [PATH] [--rev REV]`: judge a catalog the way the controller will."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from rich.console import Console
from rich.text import Text

from llmgw.catalog import ValidationResult, read_directory, validate_files
from llmgw.cli.output import fail, print_json
from llmgw.errors import CatalogError, GitError
from llmgw.safetext import visible


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("validate", help="validate a catalog directory or a committed revision")
    p.add_argument("path", nargs="?", default=".", help="catalog directory (default: .)")
    p.add_argument("--rev", help="validate this git revision's tree instead of the files on disk")
    p.add_argument("-o", "--output", choices=["text", "json"], default="text")
    p.set_defaults(func=run)


def _display_prefix(path: str) -> str:
    # Paths are printed as the user would open them from where they ran the command, so
    # `llmgw validate examples/catalog` prints clickable `examples/catalog/models/x.yaml:3:1`.
    norm = os.path.normpath(path)
    return "" if norm == "." else norm.rstrip("/") + "/"


def validate_path(path: str, rev: str | None) -> ValidationResult:
    # The CLI is single-threaded, so it may fork: a big catalog is parsed on every core.
    workers = os.cpu_count() or 1
    if rev is None:
        return validate_files(read_directory(path), workers=workers)
    from llmgw.gitops.gitcli import read_tree, resolve_commit, work_tree_root

    root = work_tree_root(path)
    try:
        subdir = Path(path).resolve().relative_to(root).as_posix()
    except ValueError as exc:  # reached through a symlink that leaves the repository
        raise GitError(f"{path}: resolves outside the repository {root}") from exc
    sha = resolve_commit(root, rev)
    files = read_tree(root, sha, subdir="" if subdir == "." else subdir)
    return validate_files(files, revision=sha, workers=workers)


def run(args: argparse.Namespace, console: Console) -> int:
    try:
        result = validate_path(args.path, args.rev)
    except (CatalogError, GitError) as exc:
        return fail(console, str(exc))
    prefix = _display_prefix(args.path)
    if args.output == "json":
        print_json(console, {
            "ok": result.ok,
            "files": result.files,
            "models": len(result.catalog.models) if result.catalog else None,
            "nodes": len(result.catalog.nodes) if result.catalog else None,
            "revision": result.catalog.revision if result.catalog else None,
            "problems": [{**p.to_json(), "file": prefix + p.file} for p in result.problems],
        })
        return 0 if result.ok else 1
    for p in result.problems:
        # Text, never markup; visible(): a file name or an echoed key may carry terminal escapes.
        line = Text(visible(f"{prefix}{p.file}:{p.line}:{p.col}:"), style="bold")
        line.append(visible(f" {p.message}"), style="")
        console.print(line)
    if result.ok and result.catalog is not None:
        c = result.catalog
        console.print(Text(f"✓ {visible(args.path)}: {len(c.models)} models, {len(c.nodes)} nodes, valid",
                           style="green"))
        return 0
    files = len({p.file for p in result.problems})
    console.print(Text(
        f"✗ {len(result.problems)} problem{'s' * (len(result.problems) != 1)} "
        f"in {files} file{'s' * (files != 1)}", style="red"))
    return 1
