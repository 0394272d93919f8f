"""`llmgw diff [BASE] [HEAD]`: review what a catalog change does to the fleet before it lands.

Exit codes as `terraform plan -detailed-exitcode`: 0 no change, 2 changes, 1 error
(including a catalog that does not validate).

The fleet to plan against: ``--snapshot FILE``; else a controller named as in every other
command (``--url``/``--token``, ``--data-dir``, or ``LLMGW_ADMIN_URL`` with ``LLMGW_ADMIN_TOKEN``;
``--controller`` is the older spelling of ``--url``); else the `llmgw up` whose catalog this
is, when it runs; else none (catalog changes and validation only).

Whatever happens, the output is a document in the format asked for: an error under
``--format markdown`` is a markdown comment saying what went wrong (CI posts it on the pull
request rather than an empty comment), under ``--format json`` an ``{"error": ...}`` object.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from llmgw.adminaccess import ENV_URL, given
from llmgw.cli.client import ApiError, Client, add_options, resolve_client
from llmgw.cli.output import fail, print_json
from llmgw.errors import CatalogError, GitError

if TYPE_CHECKING:
    from llmgw.plan import FleetSnapshot


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("diff", help="dry run: catalog changes, validation and the plan against the fleet")
    p.add_argument("base", nargs="?", help="base revision (default: the controller's applied one, else origin/BRANCH)")
    p.add_argument("head", nargs="?", help="head revision (default: the working tree, uncommitted edits included)")
    p.add_argument("--repo", default=".", help="the catalog directory in a git checkout (default: .)")
    p.add_argument("--branch", default="main", help="branch the controller follows (default: main)")
    # The controller whose live fleet to plan against.
    add_options(p, url_aliases=("--controller",), fallback="the `llmgw up` whose catalog this is, if it runs")
    p.add_argument("--snapshot", help="plan against a fleet exported by `llmgw inventory export` (instead of a "
                                      "controller)")
    p.add_argument("--format", choices=["text", "markdown", "json"], default="text")
    p.set_defaults(func=run)

    inv = sub.add_parser("inventory", help="the fleet as a file, for `llmgw diff --snapshot` where CI cannot reach it")
    isub = inv.add_subparsers(dest="inventory_action", required=True)
    e = isub.add_parser("export", help="write the live fleet (nodes and replicas) as JSON")
    e.add_argument("-f", "--file", default="-", help="output file (default: stdout)")
    add_options(e)
    e.set_defaults(func=export)


def export(args: argparse.Namespace, console: Console) -> int:
    try:
        data = resolve_client(args.url, args.token, args.data_dir).request("GET", "/api/v1/inventory")
    except ApiError as exc:
        return fail(console, str(exc))
    text = json.dumps(data, indent=2)
    if args.file == "-":
        console.file.write(text + "\n")
    else:
        Path(args.file).write_text(text + "\n")
        console.print(f"wrote {args.file}: {len(data['inventory']['nodes'])} nodes, {len(data['replicas'])} replicas")
    return 0


def _local_up(repo_root: Path) -> Client | None:
    """The controller of a `llmgw up` whose catalog repository this is, if it runs."""
    data = repo_root.parent
    if not ((data / "admin.url").exists() and (data / "admin.token").exists()):
        return None
    try:
        client = resolve_client(None, None, str(data), timeout=5)
        client.request("GET", "/api/v1/healthz")
    except ApiError as exc:
        if exc.status != 503:  # 503: it runs, a loop of its failing; its fleet is still the one to plan on
            return None
    return client


def run(args: argparse.Namespace, console: Console) -> int:
    # Imported here, not at the top: every other command would pay for them at start-up.
    from llmgw.catalog import read_directory
    from llmgw.gitops.gitcli import has_commit, read_tree, resolve_commit, work_tree_root
    from llmgw.plan import FleetSnapshot, build_report, render_json, render_markdown, render_text

    if args.snapshot and (args.url or args.token or args.data_dir):
        return _fail(console, args, "--snapshot and a controller (--url, --token, --data-dir) both name "
                                           "the fleet to plan against: give one")
    try:
        root = repo = work_tree_root(args.repo)
    except GitError as exc:
        return _fail(console, args, str(exc))
    catalog_dir = Path(args.repo).resolve()
    if not catalog_dir.is_relative_to(root):
        # A symlink that leaves the repository: reading through it would publish that
        # directory's files in the comment CI posts.
        return _fail(console, args, f"{args.repo}: resolves outside the repository {root}")
    subdir = catalog_dir.relative_to(root).as_posix()
    subdir = "" if subdir == "." else subdir
    client = None
    try:
        if args.snapshot:
            pass
        elif given(args.url, args.token, args.data_dir):
            # Named (a flag or the environment): a controller that cannot be reached is an error,
            # never a quiet plan without a fleet.
            client = resolve_client(args.url, args.token, args.data_dir)
        else:
            client = _local_up(root)
        base_rev = args.base
        if base_rev is None and client is not None:
            base_rev = client.request("GET", "/api/v1/sync")["applied_sha"]
        if base_rev is None:
            base_rev = f"origin/{args.branch}"
            if not has_commit(repo, base_rev):
                base_rev = "HEAD"  # no remote to compare with: the last commit
        base_sha = resolve_commit(repo, base_rev)
        base_files = read_tree(repo, base_sha, subdir=subdir)
        if args.head:
            head_name = args.head
            head_files = read_tree(repo, resolve_commit(repo, args.head), subdir=subdir)
        else:
            head_name = "working tree"
            head_files = read_directory(catalog_dir)  # checked above to be inside the repository
        fleet, note = None, ""
        if args.snapshot:
            fleet = load_snapshot(Path(args.snapshot))
            note = f"snapshot {Path(args.snapshot).name}"
        elif client is not None:
            fleet = FleetSnapshot.from_json(client.request("GET", "/api/v1/inventory"))
            note = _named(f"live fleet at {client.url}", args)
    except (GitError, CatalogError, ApiError, OSError, ValueError, KeyError) as exc:
        return _fail(console, args, str(exc))
    base_name = (base_sha[:12] if base_rev == base_sha else base_rev if base_rev == base_sha[: len(base_rev)]
                 else f"{base_rev} ({base_sha[:12]})")
    try:
        report = build_report(base_name, base_files, head_name, head_files, fleet, now=time.time(), fleet_note=note)
    except _SHAPE_ERRORS as exc:
        if not args.snapshot:
            raise  # a live controller's inventory is ours: a bug to see, not a file to blame
        # The shapes load_snapshot checks parse; a value of the right shape but a wrong type deeper
        # in (a string where placement counts) only shows when the plan uses it.
        return _fail(console, args, f"--snapshot {args.snapshot}: a value of the wrong type "
                                           f"({type(exc).__name__}: {exc}); export it again with "
                                           "`llmgw inventory export`")
    if args.format == "json":
        print_json(console, render_json(report))
    else:
        text = render_text(report) if args.format == "text" else render_markdown(report)
        console.file.write(text)
        console.file.flush()
    if report.problems:
        return 1
    return 2 if report.changed else 0


# What reading a hand-edited or corrupted snapshot raises: a missing key, a wrong type, a bad enum.
_SHAPE_ERRORS = (KeyError, TypeError, ValueError, AttributeError, IndexError)


def load_snapshot(path: Path) -> FleetSnapshot:
    """The fleet in ``path`` (`llmgw inventory export`'s JSON); ValueError naming the file and the
    JSON path of what is wrong (CI prints it in the PR comment: never a traceback)."""
    from llmgw.decide.replica import Replica
    from llmgw.inventory import Inventory
    from llmgw.plan import FleetSnapshot

    def wrong(where: str, what: str) -> ValueError:
        return ValueError(f"--snapshot {path}: {where}: {what} (expected the JSON of `llmgw inventory export`)")

    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"--snapshot {path}: cannot read it: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise wrong("the file", "not UTF-8 text") from None
    if not text.strip():
        raise wrong("the file", "empty")
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise wrong("the file", f"not JSON ({exc})") from None

    def expect(value: object, kind: type, where: str) -> None:
        if not isinstance(value, kind):
            raise wrong(where, f"a {kind.__name__} was expected, found {json.dumps(value)[:60]}")

    expect(raw, dict, "$")
    expect(raw.get("inventory"), dict, "$.inventory")
    nodes, replicas = raw["inventory"].get("nodes", []), raw.get("replicas", [])
    expect(nodes, list, "$.inventory.nodes")
    expect(replicas, list, "$.replicas")
    # Each element parsed on its own, so the message names the one that is wrong.
    for i, node in enumerate(nodes):
        expect(node, dict, f"$.inventory.nodes[{i}]")
        try:
            Inventory.from_json({"nodes": [node]})
        except _SHAPE_ERRORS as exc:
            raise wrong(f"$.inventory.nodes[{i}]", _why(exc)) from None
    for i, replica in enumerate(replicas):
        expect(replica, dict, f"$.replicas[{i}]")
        try:
            Replica.from_json(replica)
        except _SHAPE_ERRORS as exc:
            raise wrong(f"$.replicas[{i}]", _why(exc)) from None
    try:
        return FleetSnapshot.from_json(raw)
    except _SHAPE_ERRORS as exc:
        raise wrong("$", _why(exc)) from None


def _why(exc: Exception) -> str:
    return f"no key {exc}" if isinstance(exc, KeyError) else f"{type(exc).__name__}: {exc}"


def _named(text: str, args: argparse.Namespace) -> str:
    """``text`` with the controller's URL named by its source when it came from the environment.

    In CI ``$LLMGW_ADMIN_URL`` is a workflow secret (where the fleet's admin API listens) and the
    output is a comment on a pull request anyone may open: the value would be published there.
    """
    url = os.environ.get(ENV_URL, "")
    if args.url or args.token or args.data_dir or args.snapshot or not url:
        return text  # the URL came from a flag, or there is none from the environment
    for form in {url, url.rstrip("/")}:
        if form:
            text = text.replace(form, f"${ENV_URL}")
    return text


def _fail(console: Console, args: argparse.Namespace, message: str) -> int:
    """The error as a document of the format asked for: a PR comment is never left empty."""
    from llmgw.plan.render import render_error_markdown

    fmt, message = args.format, _named(message, args)

    if fmt == "markdown":
        console.file.write(render_error_markdown(message))
        console.file.flush()
        return 1
    if fmt == "json":
        print_json(console, {"error": message})
        return 1
    return fail(console, message)
