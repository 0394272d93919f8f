"""`llmgw rollout status`, `llmgw rollout promote`, `llmgw rollout abort`: the operator's side of rollouts.

A rollout is started by a commit, never by a command: these only look at one, cut its analysis
short (promote) or stop it (abort). Both are recorded as events with the caller's name.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from rich.console import Console
from rich.markup import escape

from llmgw.cli.client import ApiError, Client
from llmgw.cli.output import fail, print_json

PHASE_STYLE = {"canary": "yellow", "promoting": "yellow", "done": "green", "rolled-back": "bold red",
               "aborted": "yellow"}


def _e(x: Any) -> str:
    from llmgw.safetext import visible

    # Reasons and history quote the catalog (model names, a canary's start error): text, never markup.
    return escape(visible("" if x is None else x))


def _pct(v: Any) -> str:
    return "-" if v is None else f"{v * 100:.1f} %"


def _ms(v: Any) -> str:
    return "-" if v is None else f"{v * 1000:.0f} ms"


def _phase(r: dict[str, Any]) -> str:
    style = PHASE_STYLE.get(r["phase"], "")
    return f"[{style}]{_e(r['phase'])}[/]" if style else _e(r["phase"])


def _step(r: dict[str, Any]) -> str:
    if r["strategy"] != "canary" or not r["steps"]:
        return "-"
    return f"{r['step']}/{len(r['steps'])}"


def _analysis(r: dict[str, Any]) -> str:
    a = r.get("analysis")
    if not a:
        return "-"
    c, s = a["canary"], a["stable"]
    return (f"{_e(a['verdict'])} over {a['seconds']:.0f} s: requests {c['requests']} vs {s['requests']}, "
            f"errors {_pct(c['error_rate'])} vs {_pct(s['error_rate'])}, p95 TTFT {_ms(c['ttft_p95'])} vs "
            f"{_ms(s['ttft_p95'])}, p95 ITL {_ms(c['itl_p95'])} vs {_ms(s['itl_p95'])}")


def _window(r: dict[str, Any]) -> str:
    """The current step's requests and the routers they came from, the most canary requests first:
    one router with most of them is most of the evidence (a stolen credential can report made-up
    figures; it can hold a change back, never push one through)."""
    w = r.get("window")
    if not w:
        return ""
    total = w["canary_requests"]
    routers = ", ".join(f"{_e(x['router'])} {x['canary_requests']}" + _share(x, total) for x in w["routers"])
    more = f" and {w['routers_not_shown']} more" if w["routers_not_shown"] else ""
    return (f"{total} canary and {w['stable_requests']} stable requests"
            + (f"; canary requests by router: {routers}{more}" if routers else ""))


def _share(row: dict[str, Any], total: int) -> str:
    """A router's share of the canary requests, with its processes when it has several (a router
    that sends a new process id with each report shows as one with many)."""
    said = [f"{row['canary_requests'] * 100 / total:.0f} %"] if total else []
    if row.get("processes", 1) > 1:
        said.append(f"{row['processes']} processes")
    return f" ({', '.join(said)})" if said else ""


def one_line(r: dict[str, Any]) -> str:
    """A model's rollout in one line (rich markup, catalog text escaped), as `llmgw status` shows it."""
    commit = _e((r.get("revision") or "")[:12]) or "-"
    if r["phase"] == "rolled-back":
        return (f"{_e(r['model'])}: [bold red]rolled back[/] {commit}, keeps its last good version: "
                f"{_e(r['reason'])} (a new commit to it starts a new rollout; `llmgw rollout promote` forces it)")
    if r["phase"] == "aborted":
        return f"{_e(r['model'])}: aborted {commit}: {_e(r['reason'])}"
    if r["phase"] == "canary":
        return (f"{_e(r['model'])}: canary {commit}, step {_step(r)}, {r['percent']:g} % of traffic"
                + (f" ({_e(r['reason'])})" if r.get("reason") else ""))
    return f"{_e(r['model'])}: {_e(r['phase'])} {commit}" + (f" ({_e(r['reason'])})" if r.get("reason") else "")


def status(args: argparse.Namespace, client: Client, console: Console) -> int:
    if args.model:
        data = client.request("GET", f"/api/v1/rollouts/{_path(args.model)}")
        if args.output == "json":
            print_json(console, data)
            return 0
        _detail(console, data)
        return 0
    rows = client.request("GET", "/api/v1/rollouts")
    if args.output == "json":
        print_json(console, rows)
        return 0
    if not rows:
        console.print("no rollouts: a commit that changes a model's engines starts one")
        return 0
    from llmgw.cli.output import WordTable

    t = WordTable(title="rollouts", title_justify="left", header_style="bold", expand=False)
    for col in ("MODEL", "PHASE", "STRATEGY", "STEP", "CANARY %", "COMMIT", "LAST ANALYSIS (CANARY VS STABLE)",
                "REASON"):
        t.add_column(col, overflow="fold")
    for r in rows:
        t.add_row(_e(r["model"]), _phase(r), _e(r["strategy"]), _step(r), f"{r['percent']:g}",
                  _e((r.get("revision") or "")[:12]), _analysis(r), _e(r["reason"]))
    console.print(t)
    return 0


def _detail(console: Console, r: dict[str, Any]) -> None:
    console.print(f"[bold]{_e(r['model'])}[/]: {_phase(r)} ({_e(r['strategy'])}), commit "
                  f"{_e((r.get('revision') or '-')[:12])}, started "
                  f"{_e(time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(r['started_at'])))}")
    if r["strategy"] == "canary" and r["steps"]:
        steps = ", ".join(f"{s:g} %" for s in r["steps"])
        console.print(f"  step {_step(r)} (steps {steps}, {r['interval']:g} s each); canary takes {r['percent']:g} %"
                      + (f", replica {_e(r['canary'])}" if r.get("canary") else ""))
    console.print(f"  versions: {_e(r['stable'])} → {_e(r['target'])} (serving {_e(r['serving_version'])})")
    if r.get("reason"):
        console.print(f"  reason: {_e(r['reason'])}")
    window = _window(r)
    if window:
        console.print(f"  this step so far: {window}")
    console.print(f"  last analysis: {_analysis(r)}")
    if r.get("analysis"):
        console.print(f"    {_e(r['analysis']['reason'])}")
    for line in r["history"]:
        console.print(f"  {_e(line)}")


def act(verb: str) -> Any:
    def run(args: argparse.Namespace, client: Client, console: Console) -> int:
        try:
            data = client.request("POST", f"/api/v1/rollouts/{_path(args.model)}/{verb}", actor=args.actor)
        except ApiError as exc:
            if args.output == "json":
                print_json(console, {"error": str(exc)})
                return 1
            return fail(console, str(exc))
        if args.output == "json":
            print_json(console, data)
            return 0
        done = "promoted: the rest is replaced with the new version" if verb == "promote" else \
            "aborted: the model goes back to the version it ran"
        console.print(f"{_e(data['model'])}: {done} ({_phase(data)})")
        return 0

    return run


def _path(name: str) -> str:
    import urllib.parse

    # A model name goes into the path as one segment (a "/" or "?" in what was typed stays in it).
    return urllib.parse.quote(name, safe="")


def add_parser(sub: argparse._SubParsersAction, common: argparse.ArgumentParser, wrap: Any) -> None:
    p = sub.add_parser("rollout", help="rollouts of catalog changes: status, promote a canary, abort")
    rsub = p.add_subparsers(dest="rollout_action", required=True, metavar="ACTION")
    s = rsub.add_parser("status", parents=[common], help="each model's last rollout, or one model's in detail")
    s.add_argument("model", nargs="?")
    s.set_defaults(func=wrap(status))
    for verb, help_ in (("promote", "promote the canary now (skips the rest of the analysis), or a rolled-back "
                                    "version"),
                        ("abort", "abort the rollout in progress: back to the version the model ran")):
        a = rsub.add_parser(verb, parents=[common], help=help_)
        a.add_argument("model")
        a.add_argument("--actor", help="who does it, for the event (default: the API's name)")
        a.set_defaults(func=wrap(act(verb)))
