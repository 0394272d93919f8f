"""Operator commands on top of the admin API: tables for people, `-o json` for scripts."""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from llmgw.admin.labels import confinement_label, node_problems
from llmgw.catalog import read_directory
from llmgw.catalog.durations import parse_duration
from llmgw.cli.client import ApiError, Client, add_options, resolve_client
from llmgw.cli.output import WordTable, fail, print_json
from llmgw.cli.rollout import add_parser as add_rollout_parser
from llmgw.cli.rollout import one_line as rollout_line
from llmgw.safetext import visible

Command = Callable[[argparse.Namespace, Client, Console], int]


def common() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    add_options(p)  # --url, --token, --data-dir: the same in every command (llmgw/adminaccess.py has the rule)
    p.add_argument("-o", "--output", choices=["table", "json"], default="table")
    return p


def _run(fn: Command) -> Callable[[argparse.Namespace, Console], int]:
    def run(args: argparse.Namespace, console: Console) -> int:
        try:
            client = resolve_client(args.url, args.token, args.data_dir)
            return fn(args, client, console)
        except ApiError as exc:
            return fail(console, str(exc))

    return run


def _table(title: str, columns: list[str]) -> Table:
    t = WordTable(title=title, title_justify="left", header_style="bold", expand=False)
    for c in columns:
        t.add_column(c, overflow="fold")
    return t


def _e(x: Any) -> str:
    """Text from a commit, a node, an engine or a router, for a rich line: its control characters
    shown as escapes (an ESC sequence in an engine's error, an OSC 8 link in a commit subject, an
    OSC 0 in a node's GPU class reached the operator's terminal raw), and never read as markup."""
    return escape(visible("" if x is None else str(x)))


# --- commands ---------------------------------------------------------------------------
def status(args: argparse.Namespace, client: Client, console: Console) -> int:
    s = client.request("GET", "/api/v1/summary")
    if args.output == "json":
        print_json(console, s)
        return 0
    lead = s.get("leadership") or {}
    if lead.get("shared"):  # several controllers on one store: say which one this is, and who leads
        since = (time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(lead["last_takeover"]))
                 if lead.get("last_takeover") is not None else "unknown")
        console.print(f"[bold]role[/]      {_e(lead['role'])}  leader {_e(lead.get('leader') or 'none')}"
                      f" at {_e(lead.get('leader_url') or 'unknown')}  epoch {_e(lead.get('epoch'))}"
                      f"  since {_e(since)}")
        for c in lead.get("controllers") or []:  # the others too: is a standby still there to take over?
            console.print(f"  {_e(c['role']):<8} {_e(c.get('url') or c['holder'])}  seen {_e(c['seen_s_ago'])} s ago")
    health = s.get("health")  # a controller from before issue 40 has none
    if health is not None:
        colour = {"ok": "green", "degraded": "yellow"}.get(health["state"], "red")
        failing = [h for h in health["loops"] if h["consecutive_failures"]]
        console.print(f"[bold]health[/]    [{colour}]{_e(health['state'])}[/]"
                      + (f"  ({len(failing)} of {len(health['loops'])} loops failing; the warnings below say why)"
                         if failing else ""))
    sync = s["sync"]
    console.print(f"[bold]sync[/]      {sync['state']}  applied {_e((sync['applied_sha'] or 'none')[:12])}"
                  f"  head {_e((sync['head_sha'] or '')[:12])}  ({_e(sync['branch'])} of {_e(sync['url'])})")
    if sync.get("rejected"):
        r = sync["rejected"]
        console.print(f"[red]rejected[/]  {_e(r['sha'][:12])} by {_e(r['author'])}: {_e(r['subject'])}")
        for p in r["problems"]:
            console.print(f"          {_e(p['file'])}:{p['line']}:{p['col']}: {_e(p['message'])}")
    if sync.get("pending_confirmation"):
        p = sync["pending_confirmation"]
        console.print(f"[yellow]held[/]      {_e(p['sha'][:12])}: {_e('; '.join(p['reasons']))} "
                      "(confirm: llmgw sync --allow-prune)")
    if sync.get("last_error"):
        console.print(f"[red]error[/]     {_e(sync['last_error'])}")
    if sync.get("last_rewrite"):
        w = sync["last_rewrite"]
        what = "rewound" if w["kind"] == "rewind" else "force-pushed"
        console.print(f"[yellow]history[/]   {what} from {_e(w['from_sha'][:12])} to {_e(w['to_sha'][:12])} "
                      f"at {_e(time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(w['time'])))}")
    console.print(f"[bold]nodes[/]     {s['nodes_ready']}/{s['nodes']} ready  "
                  + _e(", ".join(f"{k} {v}" for k, v in sorted(s["nodes_by_state"].items()))))
    console.print(f"[bold]gpus[/]      {s['gpus_total']} total, {s['gpus_unhealthy']} unhealthy")
    console.print(f"[bold]models[/]    {s['models']}")
    console.print(f"[bold]replicas[/]  {s['replicas_ready']}/{s['replicas']} ready  "
                  + _e(", ".join(f"{k} {v}" for k, v in sorted(s["replicas_by_state"].items()))))
    for model, n in sorted(s["unplaced"].items()):
        console.print(f"[red]unplaced[/]  {_e(model)}: {n} replica(s) (llmgw explain {_e(model)})")
    for r in s.get("rollouts", []):  # a controller from before rollouts has none
        console.print(f"[bold]rollout[/]   {rollout_line(r)}")
    for w in s.get("warnings", []):
        console.print(f"[yellow]warning[/]   {_e(w)}")
    return 0


def nodes(args: argparse.Namespace, client: Client, console: Console) -> int:
    data = client.request("GET", "/api/v1/nodes")
    if args.output == "json":
        print_json(console, data)
        return 0
    t = _table("nodes", ["NODE", "STATE", "GPUS FREE/TOTAL", "CLASSES", "DISK FREE/TOTAL GB", "REPLICAS",
                         "AGENT", "CONFINEMENT", "SEEN", "PROBLEMS"])
    for n in data:
        disk = f"{n['disk_free_gb']:g}/{n['disk_total_gb']:g}" if n["disk_total_gb"] is not None else "shared"
        seen = "never" if n["last_seen_seconds_ago"] is None else f"{n['last_seen_seconds_ago']:.0f}s ago"
        conf = confinement_label(n.get("confinement"))
        t.add_row(_e(n["id"]), _e(n["state"]), f"{n['gpu_free']}/{n['gpu_total']}", _e(",".join(n["gpu_classes"])),
                  disk, str(n["replicas"]), _e(n["agent_version"]),
                  f"[bold red]{_e(conf)}[/]" if conf.endswith("root!") else _e(conf), seen,
                  _e("; ".join(node_problems(n))))
    console.print(t)
    return 0


def _own_model(args: argparse.Namespace, client: Client, console: Console) -> int:
    """`llmgw models add PATH` with a model's files: served by the `llmgw up` on this machine
    (its data dir), as `llmgw up --model PATH` would: the local node may read the folder, then
    the catalog entry is committed through the API."""
    from llmgw.control.up import UpLayout, check_served, model_to_serve, serve_folder, write_agent_config
    from llmgw.errors import ConfigError
    from llmgw.paths import default_data_dir

    layout = UpLayout(Path(args.data_dir).resolve() if args.data_dir else default_data_dir())
    if not layout.agent_config.exists():
        return fail(console, f"{args.file}: a model's files are served by the `llmgw up` of this machine, and "
                             f"{layout.data_dir} is not one's data dir (give --data-dir); for a fleet, add a YAML "
                             "file whose source names where the nodes get the weights")
    try:
        served = model_to_serve(layout, Path(args.file), layout.catalog, name=args.name)
        if check_served(read_directory(layout.catalog), served):
            console.print(f"{_e(served.model.name)} is served already ({_e(served.model.source)})")
            return 0
        serve_folder(layout, served.model.folder)
        write_agent_config(layout)  # the running local agent starts again on it
    except ConfigError as exc:
        return fail(console, str(exc))
    code = _write(args, client, console, "POST", "/api/v1/models", {"yaml": served.text})
    if code == 0 and args.output != "json":
        console.print(f"{_e(served.model.name)} on {_e(served.engine)}, read from {_e(served.model.source)}; "
                      "`llmgw replicas` says when it is ready")
    return code


def _is_model_files(arg: str) -> bool:
    path = Path(arg).expanduser()
    return arg != "-" and (path.is_dir() or path.suffix.lower() == ".gguf")


def models(args: argparse.Namespace, client: Client, console: Console) -> int:
    if args.models_action == "add" and _is_model_files(args.file):
        return _own_model(args, client, console)
    if args.models_action == "add":
        if args.name is not None:
            return fail(console, "--name: names a model given by its files (a .gguf or a model directory)")
        try:  # a missing or binary file is an error message, not a traceback
            text = Path(args.file).read_text(encoding="utf-8") if args.file != "-" else sys.stdin.read()
        except (OSError, UnicodeDecodeError) as exc:
            return fail(console, f"{args.file}: cannot read it: {getattr(exc, 'strerror', None) or exc}")
        try:
            yaml.safe_load(text)
        except yaml.YAMLError as exc:
            return fail(console, f"{args.file}: not valid YAML: {exc}")
        return _write(args, client, console, "POST", "/api/v1/models", {"yaml": text})
    if args.models_action == "remove":
        return _write(args, client, console, "DELETE", f"/api/v1/models/{args.name}", None)
    data = client.request("GET", "/api/v1/models")
    if args.output == "json":
        print_json(console, data)
        return 0
    t = _table("models", ["MODEL", "ALIASES", "READY", "MIN-MAX", "PROFILES", "FALLBACKS", "ROUTING", "CACHE HITS",
                          "QUEUE", "SOURCE"])
    for m in data:
        ready = f"{m['ready_replicas']}/{m['total_replicas']}" + (
            f" ({m['unplaced_replicas']} unplaced)" if m["unplaced_replicas"] else "")
        profiles = ", ".join(f"{p['name']}:{p['engine']}x{p['gpus']}" for p in m["profiles"])
        t.add_row(_e(m["name"]), _e(", ".join(m["aliases"])), ready, f"{m['min_replicas']}-{m['max_replicas']}",
                  _e(profiles), _e(", ".join(m["fallbacks"])), _e(m.get("routing", "")),
                  _hits(m.get("prompt_cache") or {}), _queue(m.get("engine_queue")), _e(m["source"]))
    console.print(t)
    return 0


def _hits(cache: dict[str, Any]) -> str:
    """'est 62% / engine 58%': the router's estimate and the engines' own figure, '-' when unknown."""
    def pct(v: Any) -> str:
        return "-" if not isinstance(v, int | float) else f"{v:.0%}"
    return f"est {pct(cache.get('estimated_hit_ratio'))} / engine {pct(cache.get('engine_hit_ratio'))}"


def _queue(q: Any) -> str:
    """'2 running, 5 waiting' summed over the replicas whose engines report it; '-' when none does."""
    if not isinstance(q, dict):
        return "-"
    return f"{q.get('running', 0)} running, {q.get('waiting', 0)} waiting"


def _write(args: argparse.Namespace, client: Client, console: Console, method: str, path: str, body: Any) -> int:
    try:
        data = client.request(method, path, body, actor=args.actor)
    except ApiError as exc:
        if args.output == "json":
            print_json(console, {"error": str(exc), **(exc.body if isinstance(exc.body, dict) else {})})
            return 1
        fail(console, str(exc))
        for p in (exc.body or {}).get("problems", []) if isinstance(exc.body, dict) else []:
            console.print(f"  {_e(p['file'])}:{p['line']}:{p['col']}: {_e(p['message'])}")
        return 1
    if args.output == "json":
        print_json(console, data)
    else:
        console.print(f"[green]✓[/] commit {_e(data['commit'][:12])}: {_e(data['message'])}")
    return 0


def keys(args: argparse.Namespace, client: Client, console: Console) -> int:
    if args.keys_action == "create":
        models = [m.strip() for m in args.models.split(",") if m.strip()] if args.models else ["*"]
        try:
            was_open = not client.request("GET", "/api/v1/keys")
            made = client.request("POST", "/api/v1/keys", {"name": args.name, "models": models,
                                                           **({"tenant": args.tenant} if args.tenant else {})},
                                  actor=args.actor)
        except ApiError as exc:
            return fail(console, str(exc))
        if args.output == "json":
            print_json(console, made)
            return 0
        whose = f", tenant {_e(made['tenant'])}" if made.get("tenant") else ""
        console.print(f"[green]✓[/] API key {_e(made['name'])} for {_e(', '.join(made['models']))}{whose}; shown this "
                      "once, only its hash is kept:")
        console.print(made["key"], markup=False, highlight=False, soft_wrap=True)  # whole, on its own line
        if was_open:
            console.print("[yellow]The router now needs a key for every request[/] (with no keys it served anyone).")
        return 0
    if args.keys_action == "revoke":
        try:
            client.request("DELETE", f"/api/v1/keys/{urllib.parse.quote(args.name, safe='')}", None, actor=args.actor)
        except ApiError as exc:
            return fail(console, str(exc))
        console.print(f"[green]✓[/] API key {_e(args.name)} revoked: routers refuse it from their next request")
        return 0
    data = client.request("GET", "/api/v1/keys")
    if args.output == "json":
        print_json(console, data)
        return 0
    t = _table("API keys", ["NAME", "MODELS", "TENANT", "KEPT IN", "MADE"])
    for k in data:
        made = time.strftime("%Y-%m-%d %H:%M", time.localtime(k["created_at"])) if k.get("created_at") else "-"
        t.add_row(_e(k["name"]), _e(", ".join(k["models"])), _e(k.get("tenant") or "-"), _e(k["source"]), made)
    console.print(t)
    return 0


def routers(args: argparse.Namespace, client: Client, console: Console) -> int:
    """Router credentials: what a standalone router holds instead of the admin token."""
    if args.routers_action == "create":
        try:
            made = client.request("POST", "/api/v1/routers", {"name": args.name}, actor=args.actor)
        except ApiError as exc:
            return fail(console, str(exc))
        if args.output == "json":
            print_json(console, made)
            return 0
        console.print(f"[green]✓[/] router credential {_e(made['name'])}: it opens the router watch and report "
                      "only; shown this once, only its hash is kept:")
        console.print(made["credential"], markup=False, highlight=False, soft_wrap=True)
        console.print("Give it to that router: LLMGW_ADMIN_TOKEN=<credential> llmgw router --url <this controller>")
        return 0
    if args.routers_action == "revoke":
        try:
            client.request("DELETE", f"/api/v1/routers/{urllib.parse.quote(args.name, safe='')}", None,
                           actor=args.actor)
        except ApiError as exc:
            return fail(console, str(exc))
        console.print(f"[green]✓[/] router credential {_e(args.name)} revoked: its watch ends and its reports "
                      "count no more")
        return 0
    data = client.request("GET", "/api/v1/routers")
    if args.output == "json":
        print_json(console, data)
        return 0
    t = _table("router credentials", ["NAME", "MADE", "LAST REPORT", "IN FLIGHT", "DEMAND (HELD/IN FLIGHT)"])
    for r in data:
        made = time.strftime("%Y-%m-%d %H:%M", time.localtime(r["created_at"])) if r.get("created_at") else "-"
        rep = r.get("report")
        demand = ", ".join(f"{m} {d['held']}/{d['inflight']}" for m, d in sorted((rep or {}).get("demand", {}).items()))
        last = f"{rep['seconds_ago']:.0f}s ago" if rep else "none"
        if rep and rep.get("behind_unbelieved"):
            last += " (says it is behind: not believed)"
        t.add_row(_e(r["name"]), made, last, str(rep["in_flight"]) if rep else "-", _e(demand or "-"))
    console.print(t)
    return 0


def audit(args: argparse.Namespace, client: Client, console: Console) -> int:
    """The audit trail, or (``verify``) whether its chain is unbroken."""
    if args.audit_action == "verify":
        verdict = client.request("GET", "/api/v1/audit/verify")
        if args.output == "json":
            print_json(console, verdict)
        elif verdict["ok"]:
            console.print(f"[green]✓[/] the audit chain holds: {verdict['rows']} rows")
        else:
            console.print(f"[red]✗[/] the audit chain is broken at row {_e(verdict['broken_at'])}: "
                          f"{_e(verdict['why'])}")
        return 0 if verdict["ok"] else 1
    since = 0.0
    if args.since:
        try:
            since = time.time() - parse_duration(args.since)
        except ValueError as exc:
            return fail(console, f"--since {args.since!r}: {exc} (a duration such as 90m, 24h or 7d)")
    rows = client.request("GET", "/api/v1/audit", query={"since": str(since), "limit": str(args.limit)})
    if args.output == "json":
        print_json(console, rows)
        return 0
    t = _table("audit trail", ["#", "TIME", "WHO", "ROLE", "FROM", "WHAT", "RESULT", "REVISION"])
    for r in rows:
        t.add_row(str(r["id"]), time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["time"])), _e(r["who"]),
                  _e(r["role"]), _e(r["source"]), _e(r["action"]), _e(r["result"]), _e(r["revision"][:12] or "-"))
    console.print(t)
    return 0


def login(args: argparse.Namespace, console: Console) -> int:
    """Keep a token for one controller (an ID token from the organisation's provider, pasted on
    stdin), after the controller said whom it names; later commands with ``--url`` alone use it."""
    import sys

    from llmgw.adminaccess import save_login

    if "," in args.url:
        return fail(console, "llmgw login takes one --url: the one controller this token is for (it goes nowhere "
                             "else)")
    token = sys.stdin.readline().strip()
    if not token:
        return fail(console, "no token on stdin: paste the ID token your identity provider gave you")
    try:
        me = Client(args.url.rstrip("/"), token, timeout=30, source="llmgw login").request("GET", "/api/v1/whoami")
    except ApiError as exc:
        return fail(console, f"{exc} (nothing saved)")
    path = save_login(args.url, token)
    console.print(f"[green]✓[/] signed in to {_e(args.url)} as {_e(me['name'])} ({_e(me['role'])}); the token is "
                  f"kept in {_e(path)} for this URL only")
    return 0


def logout(args: argparse.Namespace, console: Console) -> int:
    from llmgw.adminaccess import save_login, saved_login

    if saved_login(args.url) is None:
        console.print(f"no token was saved for {_e(args.url)}")
        return 0
    save_login(args.url, None)
    console.print(f"[green]✓[/] the token for {_e(args.url)} is forgotten")
    return 0


def replicas(args: argparse.Namespace, client: Client, console: Console) -> int:
    data = client.request("GET", "/api/v1/replicas", query={"model": args.model})
    if args.output == "json":
        print_json(console, data)
        return 0
    t = _table("replicas", ["REPLICA", "MODEL", "PROFILE", "STATE", "WHERE", "ENDPOINT", "AGE", "IDLE", "WEIGHTS",
                            "ERROR"])
    for r in data:
        where = "; ".join(f"{s['node']} gpus {','.join(map(str, s['gpus'])) or '-'}" for s in r["shards"])
        idle = "-" if r["idle_seconds"] < 0 else f"{r['idle_seconds']:.0f}s"
        t.add_row(_e(r["id"]), _e(r["model"]), _e(r["profile"]), _e(r["state"]), _e(where), _e(r["endpoint"]),
                  f"{r['age_seconds']:.0f}s", idle, _e(_weights(r.get("weights") or {})), _e(r["error"]))
    console.print(t)
    return 0


def _weights(w: dict) -> str:
    """Where a replica's weights come from, and while they come, how far each node is."""
    fetch = w.get("fetch")
    if not fetch:
        return str(w.get("source") or "-")
    parts = []
    for node, p in fetch.items():
        done, total = p.get("bytes_done") or 0, p.get("bytes_total")
        how_far = f"{done / total:.0%} of {_amount(total)}" if total else f"{_amount(done)} so far"
        parts.append(f"{node} {how_far} from {p.get('from') or w.get('source')}")
    return "; ".join(parts)


def _amount(n: float) -> str:
    """Bytes as a reader takes them in: 812 KB, 4.0 MB, 140.3 GB."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def explain(args: argparse.Namespace, client: Client, console: Console) -> int:
    data = client.request("GET", "/api/v1/explain-placement", query={"model": args.model})
    if args.output == "json":
        print_json(console, data)
        return 0
    for line in data["text"]:
        console.print(_e(line))
    return 0


def node_state(state: str) -> Command:
    def run(args: argparse.Namespace, client: Client, console: Console) -> int:
        data = client.request("POST", f"/api/v1/nodes/{args.node}/state", {"state": state})
        if args.output == "json":
            print_json(console, data)
        else:
            console.print(f"node {_e(data['id'])} is now [bold]{_e(data['state'])}[/]")
        return 0

    return run


def takeover(args: argparse.Namespace, client: Client, console: Console) -> int:
    data = client.request("POST", f"/api/v1/nodes/{args.node}/takeover", {"stop_foreign": args.stop_foreign})
    if args.output == "json":
        print_json(console, data)
        return 0
    if data.get("already"):
        console.print(f"node {_e(data['node'])} is already driven by this controller ({_e(data['holder'])}, "
                      f"epoch {data['epoch']})")
        return 0
    console.print(f"node {_e(data['node'])} is now driven by {_e(data['holder'])} (epoch {data['epoch']}); "
                  "the controller that held it before is refused from now on")
    for engine in data["stopped"]:
        console.print(f"  stopped {_e(engine)} (started by the other controller)")
    return 0


def weights(args: argparse.Namespace, client: Client, console: Console) -> int:
    if args.weights_action == "orphans":
        data = client.request("GET", "/api/v1/weights/orphans")
        if args.output == "json":
            print_json(console, data)
            return 0
        t = _table("orphaned weights (cache entries no model in the catalog wants)",
                   ["NODE", "PATH", "GB", "SOURCE"])
        for o in data["orphans"]:
            t.add_row(_e(o["node"]), _e(o["path"]), f"{o['bytes'] / 1024**3:.2f}", _e(o["source"]))
        console.print(t)
        for node, paths in sorted(data["foreign"].items()):
            for p in paths:
                console.print(f"[dim]foreign (never collected)[/] {_e(node)}: {_e(p)}")
        return 0
    with console.status("asking nodes to remove orphans…" if args.collect else "listing orphans…"):
        data = client.request("POST", "/api/v1/weights/collect", {"collect": bool(args.collect)})
    if args.output == "json":
        print_json(console, data)
        return 0
    for r in data["results"]:
        verdict = "removed" if r.get("removed") else f"refused: {r.get('reason')}"
        console.print(f"{_e(r['node'])}: {_e(r['path'])}: {_e(verdict)}")
    if not args.collect:
        for o in data["orphans"]:
            console.print(f"{_e(o['node'])}: {_e(o['path'])}: would ask to remove")
    console.print(_e(data["summary"]))
    return 0


def events(args: argparse.Namespace, client: Client, console: Console) -> int:
    after = 0
    while True:
        data = client.request("GET", "/api/v1/events", query={"after": after, "limit": args.limit})
        for e in data:
            after = max(after, e["id"])
            if args.output == "json":
                console.file.write(json.dumps(e) + "\n")
            else:
                when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e["time"]))
                console.print(f"{when}  {_e(e['kind']):<22} {_e(e['subject'])}  {_e(e['message'])}")
        console.file.flush()
        if not args.follow:
            return 0
        time.sleep(args.interval)


def usage(args: argparse.Namespace, client: Client, console: Console) -> int:
    query = {"since": args.since, "until": args.until, "by": args.by,
             **({"step": args.step} if args.step else {}),
             **{g: getattr(args, g) for g in ("tenant", "key", "model") if getattr(args, g)}}
    data = client.request("GET", "/api/v1/usage", query=query)
    if args.output == "json":
        print_json(console, data)
        return 0
    by = data["by"]
    span = f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime(data['since']))} to " \
           f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime(data['until']))} UTC"
    t = _table(f"usage, {span}", [g.upper() for g in by] + list(_SUM_HEADS.values()))
    for r in data["rows"]:
        t.add_row(*(_e(r[g] or "-") for g in by), *_sums(r))
    total = data["total"]
    t.add_section()
    t.add_row(*(["all"] + [""] * (len(by) - 1) if by else []), *_sums(total))
    console.print(t)
    if data.get("series") is not None:  # --step: once read as JSON only, silently dropped from the table
        console.print(_series_table(data))
    if total["counted_from_stream"]:
        console.print(f"requests cut short or without a usage report: {total['counted_from_stream']} (their "
                      "completion tokens were counted from the stream; their prompt tokens are not known)")
    if data.get("budgets"):
        b = _table("budgets (this period)", ["TENANT", "MODEL", "BUDGET", "USED", "LEFT", "RESETS", "REFUSED"])
        for x in data["budgets"]:
            used = "-" if x["used"] is None else f"{x['used']:,}"
            left = "-" if x["left"] is None else f"{x['left']:,}"
            resets = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(x["resets_at"]))
            refused = "-" if x.get("refused") is None else f"{x['refused']:,}"
            b.add_row(_e(x["tenant"]), _e(x["model"] or "all"), f"{x['tokens']:,} per {_e(x['per'])}", used, left,
                      resets, refused)
        console.print(b)
    return 0


def _series_table(data: dict[str, Any]) -> Table:
    """--step: each tenant's sums per step, oldest first (steps without use are not listed)."""
    step = data["step"]
    width = f"{step // 3600}h" if step % 3600 == 0 else f"{step // 60}m"
    t = _table(f"per {width}, by tenant", ["FROM (UTC)", "TENANT", *_SUM_HEADS.values()])
    for p in sorted(data["series"], key=lambda p: (p["time"], p["tenant"] or "")):
        t.add_row(time.strftime("%Y-%m-%d %H:%M", time.gmtime(p["time"])), _e(p["tenant"] or "-"), *_sums(p))
    return t


# REFUSED: requests the tenant's limits turned away (never sent to an engine, not among REQUESTS).
_SUM_HEADS = {"requests": "REQUESTS", "errors": "ERRORS", "refused": "REFUSED", "prompt_tokens": "PROMPT",
              "completion_tokens": "COMPLETION", "total_tokens": "TOTAL"}


def _sums(r: dict[str, Any]) -> list[str]:
    return [f"{r.get(c, 0):,}" for c in _SUM_HEADS]


def sync(args: argparse.Namespace, client: Client, console: Console) -> int:
    with console.status("fetching…"):
        data = client.request("POST", "/api/v1/sync", {"allow_prune": bool(args.allow_prune)})
    if args.output == "json":
        print_json(console, data)
    else:
        console.print(f"{_e(data['state'])}: applied {_e((data['applied_sha'] or 'none')[:12])}, "
                      f"head {_e((data['head_sha'] or '')[:12])}")
        if data.get("pending_confirmation"):
            console.print("held by the prune guard: " + _e("; ".join(data["pending_confirmation"]["reasons"]))
                          + " — confirm with `llmgw sync --allow-prune`")
        if data.get("rejected"):
            for p in data["rejected"]["problems"]:
                console.print(f"  {_e(p['file'])}:{p['line']}:{p['col']}: {_e(p['message'])}")
    return 0 if data["state"] == "synced" else 1


def add_parsers(sub: argparse._SubParsersAction) -> None:
    c = common()

    def add(name: str, fn: Command, help_: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, parents=[c], help=help_)
        p.set_defaults(func=_run(fn))
        return p

    add("status", status, "sync state and fleet summary")
    add_rollout_parser(sub, c, _run)
    add("nodes", nodes, "nodes with GPUs, disk and state")
    p = add("models", models, "list, add or remove models (adding/removing writes a git commit)")
    msub = p.add_subparsers(dest="models_action")
    a = msub.add_parser("add", parents=[c], help="add a model from a YAML file, or serve a .gguf file or model "
                                                 "directory on this machine's `llmgw up`")
    a.add_argument("file", help="a model's YAML (- for stdin), a .gguf file, or a directory with config.json "
                                "and *.safetensors")
    a.add_argument("--name", help="with a model's files: the name clients ask for (default: from the file name)")
    a.add_argument("--actor", help="commit author (default: the API's name)")
    r = msub.add_parser("remove", parents=[c], help="remove a model")
    r.add_argument("name")
    r.add_argument("--actor")
    for q in (a, r):
        q.set_defaults(func=_run(models))
    p.set_defaults(models_action=None)
    p = add("keys", keys, "API keys: list, create (shown once, only its hash kept) or revoke; no restart")
    ksub = p.add_subparsers(dest="keys_action")
    k = ksub.add_parser("create", parents=[c], help="make an API key and print it once")
    k.add_argument("name")
    k.add_argument("--models", help="comma-separated model names or aliases it may use (default: every model)")
    k.add_argument("--tenant", help="the tenant whose limits and usage it counts in (a tenant in the catalog that "
                                    "names the key wins)")
    k.add_argument("--actor")
    k = ksub.add_parser("revoke", parents=[c], help="revoke an API key made with create")
    k.add_argument("name")
    k.add_argument("--actor")
    ksub.add_parser("list", parents=[c], help="list API keys (names and models)")
    for q in ksub.choices.values():
        q.set_defaults(func=_run(keys))
    p.set_defaults(keys_action=None)
    p = add("audit", audit, "the audit trail of every change (who, role, from where, what, the result, the revision)")
    p.add_argument("--since", help="only rows this recent (a duration: 90m, 24h, 7d)")
    p.add_argument("--limit", type=int, default=1000, help="at most this many rows (default 1000)")
    asub = p.add_subparsers(dest="audit_action")
    asub.add_parser("verify", parents=[c], help="recompute the hash chain: exit 1 and the broken row if it does not "
                                                "hold").set_defaults(func=_run(audit))
    p.set_defaults(audit_action=None)
    for name, fn, help_ in (("login", login, "keep a token from your identity provider for one controller "
                                              "(read from stdin; checked with the controller first)"),
                            ("logout", logout, "forget the token `llmgw login` kept for a controller")):
        q = sub.add_parser(name, help=help_)  # --url only: the token comes on stdin, never from elsewhere
        q.add_argument("--url", required=True, help="the controller's admin API address (the token is for it alone)")
        q.set_defaults(func=fn)
    p = add("routers", routers, "router credentials: list, create (shown once) or revoke; a router's opens "
                                "only the watch and the report")
    rsub = p.add_subparsers(dest="routers_action")
    k = rsub.add_parser("create", parents=[c], help="make a router's credential and print it once")
    k.add_argument("name", help="the router it is for (its reports are that router's)")
    k.add_argument("--actor")
    k = rsub.add_parser("revoke", parents=[c], help="revoke a router's credential")
    k.add_argument("name")
    k.add_argument("--actor")
    rsub.add_parser("list", parents=[c], help="list router credentials and what each router's last report moves")
    for q in rsub.choices.values():
        q.set_defaults(func=_run(routers))
    p.set_defaults(routers_action=None)
    p = add("replicas", replicas, "replicas and where they run")
    p.add_argument("--model")
    p = add("explain", explain, "why a model runs where it runs, or cannot run")
    p.add_argument("model")
    for verb, state in (("cordon", "cordon"), ("uncordon", "uncordon"), ("drain", "drain")):
        p = add(verb, node_state(state), f"{verb} a node")
        p.add_argument("node")
    p = add("weights", weights, "orphaned weights: list, or collect them")
    wsub = p.add_subparsers(dest="weights_action", required=True)
    wsub.add_parser("orphans", parents=[c], help="list orphaned cache entries").set_defaults(func=_run(weights))
    wc = wsub.add_parser("collect", parents=[c], help="list what would be removed; delete only with --collect")
    wc.add_argument("--collect", action="store_true", help="really ask the nodes to delete")
    wc.set_defaults(func=_run(weights))
    p = add("events", events, "the event log")
    p.add_argument("--follow", "-f", action="store_true")
    p.add_argument("--limit", type=int, default=100)
    p.add_argument("--interval", type=float, default=1.0)
    p = add("usage", usage, "tokens and requests per tenant, API key and model (the usage ledger)")
    p.add_argument("--since", default="24h", help="from: a duration back (24h, 7d), unix seconds or ISO 8601 "
                                                  "(UTC unless it says otherwise); default 24h")
    p.add_argument("--until", default="now", help="to (the same forms); default now")
    p.add_argument("--by", default="tenant,key,model", help="group by some of tenant,key,model (comma-separated)")
    p.add_argument("--step", help="also each tenant's use per step of this length (1h, 5m, ...)")
    for g in ("tenant", "key", "model"):
        p.add_argument(f"--{g}", help=f"only this {g}")
    p = add("sync", sync, "fetch now; with --allow-prune, confirm a commit held by the prune guard")
    p.add_argument("--allow-prune", action="store_true")
