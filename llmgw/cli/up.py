"""`llmgw up`: the whole system on one machine — controller, router, admin API, dashboard,
a local node running simulated engines — with one command and no configuration."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import shlex
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape

from llmgw.cli.client import URL_FILE
from llmgw.cli.serve import run_until_signal
from llmgw.paths import default_data_dir

if TYPE_CHECKING:
    from llmgw.compose.server import Running
    from llmgw.control.up import UpLayout


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="run everything on this machine: the example catalog on simulated engines")
    p.add_argument("--catalog", help="catalog directory to start from (default: the bundled examples/catalog)")
    p.add_argument("--data-dir", help=f"where state lives (default: {default_data_dir()})")
    p.add_argument("--router-port", type=_port, default=8080, help="OpenAI-compatible API port (default 8080)")
    p.add_argument("--admin-port", type=_port, default=8081, help="admin API and dashboard port (default 8081)")
    p.add_argument("--model", metavar="PATH",
                   help="also serve your own model: a .gguf file (llama.cpp) or a directory with config.json "
                        "and *.safetensors (vLLM); committed to the catalog, read where it lies")
    p.add_argument("--name", help="the name clients ask for (with --model; default: from the file name)")
    p.add_argument("--key", metavar="NAME",
                   help="make an API key NAME at start (printed once, only its hash kept) and serve only with "
                        "keys from then on; an existing NAME is kept")
    p.add_argument("--tenant", help="with --key: the tenant it counts in")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=run)


def _port(value: str) -> int:
    """A TCP port to listen on. 0 is refused too: it would listen on a random port while the
    welcome, the address file and the tour name the one given."""
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a port number") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port to listen on (1-65535)")
    return port


def _option_errors(args: argparse.Namespace) -> list[str]:
    """Values that would be ignored or misread: each an error naming its option."""
    errors = [f"{flag}: an empty path (an unset shell variable?); leave the option out for the default"
              for flag, value in (("--catalog", args.catalog), ("--data-dir", args.data_dir))
              if value is not None and not value.strip()]
    if args.name is not None and args.model is None:
        errors.append("--name: names the model given with --model, and there is none")
    if args.tenant is not None and args.key is None:
        errors.append("--tenant: is the tenant of the key made with --key, and there is none")
    from llmgw.control.keys import NAME

    # Before anything starts: a key refused after the start would leave the router open to anyone.
    for flag, value in (("--key", args.key), ("--tenant", args.tenant)):
        if value is not None and not NAME.fullmatch(value):
            errors.append(f"{flag}: {value!r}: letters, digits, '.', '_' or '-', starting with a letter or digit, "
                          "at most 64 characters")
    if args.model is not None and not args.model.strip():
        errors.append("--model: an empty path (an unset shell variable?)")
    if args.router_port == args.admin_port:
        errors.append(f"--router-port and --admin-port are both {args.router_port}: each listener needs its own port")
    return errors


def run(args: argparse.Namespace, console: Console) -> int:
    from llmgw.cli.output import fail
    from llmgw.compose.server import check_free, start
    from llmgw.control.config import Listen
    from llmgw.control.datadir import hold_data_dir
    from llmgw.control.own_model import describe
    from llmgw.control.up import UpLayout, prepare
    from llmgw.errors import LlmgwError
    from llmgw.stdio import guard

    # Before logging (its handler keeps the stream it is given): output that cannot abort or block
    # the shutdown below, whatever became of the pipe or terminal it goes to.
    guard()
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from llmgw.redact import redact_logs
    redact_logs()  # as `llmgw controller`: no URL's credential in a log line
    if errors := _option_errors(args):
        return max(fail(console, e) for e in errors)
    data_dir = Path(args.data_dir).resolve() if args.data_dir is not None else default_data_dir()
    try:
        # An existing data dir's lock first (another `up` on it says so, whatever ports it holds);
        # then the ports, before anything is written: a refused `up` leaves no new data dir behind.
        if UpLayout(data_dir).controller_dir.exists():
            hold_data_dir(UpLayout(data_dir).controller_dir)
        check_free(Listen("127.0.0.1", args.admin_port), "--admin-port")
        check_free(Listen("127.0.0.1", args.router_port), "--router-port")
        cfg = prepare(data_dir, catalog=Path(args.catalog).resolve() if args.catalog is not None else None,
                      router_port=args.router_port, admin_port=args.admin_port, lock=True,
                      model=Path(args.model) if args.model else None, name=args.name)
    except LlmgwError as exc:
        return fail(console, str(exc))
    layout = UpLayout(data_dir)
    own = describe(Path(args.model), name=args.name).name if args.model else None

    async def main(stop: asyncio.Event) -> None:
        running = await start(cfg, router_flag="--router-port", admin_flag="--admin-port", owns_engines=True)
        # From here on the reconciler may be starting engines: whatever happens next, the
        # `finally` stops them. (A signal that came while starting has set `stop` already.)
        url_file = layout.data_dir / URL_FILE
        try:
            # With admin.token, the address operator commands (`--data-dir`, or none) and `llmgw diff`
            # in the catalog repository send that token to: written only once this controller listens.
            _write_atomically(url_file, running.admin_url + "\n")
            made = _make_key(console, running, args.key, args.tenant) if args.key else None
            _welcome(console, running.router_url, running.admin_url, layout, cfg.admin_token, own,
                     (args.key, made) if args.key else None)
            await stop.wait()
        finally:
            await _shut_down(console, running, url_file)

    return run_until_signal(main, console)


async def _shut_down(console: Console, running: Running, url_file: Path) -> None:
    """Stop everything, engines included: `up` owns its engines, none outlives it."""
    try:
        console.print("stopping: in-flight requests, the control plane, then the engines…")
    finally:  # output is guarded (llmgw.stdio) and cannot raise; if it ever did, the engines still stop
        await running.close(stop_engines=True)
    # A stopped `up`'s port may be anyone's next: no command should send the token there.
    with contextlib.suppress(OSError):
        if url_file.read_text().strip() == running.admin_url:
            url_file.unlink()
    console.print("stopped; `llmgw up` again comes back on the same catalog and state.")


def _write_atomically(path: Path, text: str) -> None:
    """Readers see the old file or the new one, never half of a URL."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _dashboard_link(console: Console, admin: str, layout: UpLayout, token: str) -> str:
    """The dashboard link a newcomer can click, carrying the token only to a terminal.

    A newcomer should get in with one click, and the terminal is the user's own, already
    next to the token file it can read. The dashboard trades `?token=` for a cookie and
    redirects to the bare URL, so the token leaves the address bar and the history at once;
    the link stays valid (it is the admin token) but is only needed once per browser.
    When stdout is a log file or a journal instead, a token printed there would outlive the
    session for anyone who reads logs: say where the token is instead.
    """
    if _is_tty(console):
        return f"{admin}/?token={token}   (one click signs this browser in; the token leaves the URL)"
    return f"{admin}/   (first visit: add ?token= and the token in {layout.token_file})"


def _is_tty(console: Console) -> bool:
    # Not console.is_terminal: FORCE_COLOR makes rich claim a terminal while writing to a log.
    try:
        return os.isatty(console.file.fileno())
    except (AttributeError, OSError, ValueError):
        return False


def _command() -> str:
    """How the user can run `llmgw` from anywhere: the bare name when it is this very program on
    PATH, else the path this one was started by (the README's set-up runs `.venv/bin/llmgw up`,
    with nothing on PATH, and a bare `llmgw` in the hint failed)."""
    started = Path(sys.argv[0])
    if started.name != "llmgw":  # `python -m llmgw.cli.main`: no path to offer
        return "llmgw"
    found = shutil.which("llmgw")
    if found and Path(found).resolve() == started.resolve():
        return "llmgw"
    return str(started.absolute())


def _make_key(console: Console, running: Running, name: str, tenant: str | None) -> str | None:
    """`--key NAME`: the key made now, or None when one by that name exists (its value was shown
    when it was made; only its hash is kept) or it cannot be made (said)."""
    from llmgw.control.keys import KeyRefused

    existing = {k["name"]: k for k in running.controller.ops.keys()}
    if name in existing:
        console.print(f"API key {escape(name)} exists (made earlier; only its hash is kept): requests need a key")
        if tenant is not None and existing[name].get("tenant") != tenant:
            console.print(f"[yellow]--tenant {escape(tenant)} is not applied to it: it was made for "
                          f"{escape(str(existing[name].get('tenant') or 'no tenant'))} (revoke it and start again "
                          "to make it anew)[/]")
        return None
    try:
        made = running.controller.ops.create_key(name, ["*"], "llmgw up", tenant)
    except KeyRefused as exc:
        console.print(f"[red]--key: {escape(str(exc))}[/]")
        return None
    return made.key


def _key_line(console: Console, layout: UpLayout, name: str, key: str) -> str:
    """The key on a terminal (the user's own); to a log it would outlive the session for anyone who
    reads logs, so it goes to a file only the user can read instead."""
    if _is_tty(console):
        return f"api key    {key}   ({name}: shown this once, only its hash is kept)"
    path = layout.data_dir / f"{name}.key"
    # A new file, so its mode is ours: an older one (perhaps made wider by hand) goes first.
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(key + "\n")
    return f"api key    {name}: in {path} (readable by you only; only its hash is kept)"


def _welcome(console: Console, router: str, admin: str, layout: UpLayout, token: str, own: str | None,
             key: tuple[str, str | None] | None = None) -> None:
    """``key``: `--key`'s name and the value made now (None: made at an earlier start)."""
    model = own or "gpt-4o-mini"
    lines = [f"router     {router}/v1   (OpenAI API)",
             f"dashboard  {_dashboard_link(console, admin, layout, token)}",
             f"admin API  {admin}/api/v1   token in {layout.token_file}",
             f"catalog    {layout.catalog}   edit, `git commit`, and it is applied live"]
    bearer, client_key = "", '"unused"'
    name, value = key if key is not None else ("", None)
    path = layout.data_dir / f"{name}.key"
    shown = value is not None and _is_tty(console)
    if value is not None:
        try:
            lines.append(_key_line(console, layout, name, value))
        except OSError as exc:  # the key is lost to everyone: said, with what to do
            lines.append(f"api key    {name}: could not be written to {path} ({exc}): `llmgw keys revoke {name}`, "
                         "then start again")
    if shown:
        bearer, client_key = f" -H \"Authorization: Bearer {value}\"", f'"{value}"'
    elif key is not None and path.exists():  # written now, or at the start that made it
        bearer = f" -H \"Authorization: Bearer $(cat {shlex.quote(str(path))})\""
        client_key = f"open({str(path)!r}).read().strip()"
    curl = (f"curl -s {router}/v1/chat/completions -H 'Content-Type: application/json'{bearer} \\\n"
            f"  -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello\"}}]}}'")
    py = (f"from openai import OpenAI\nclient = OpenAI(base_url=\"{router}/v1\", api_key={client_key})\n"
          f"print(client.chat.completions.create(model=\"{model}\", "
          f"messages=[{{\"role\": \"user\", \"content\": \"Hello\"}}]).choices[0].message.content)")
    # Lines printed whole, never in a box: a box crops at the terminal's width, and a link cut at 80
    # columns (36 of the token's 43 characters) opened as a 401.
    console.rule("[bold green]llmgw is up", align="left", style="green")
    for line in lines:
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    console.rule(style="green")
    if own:
        replicas = escape(f"{_command()} replicas --data-dir {layout.data_dir}")
        console.print(f"[bold]{own}[/] is loading on this machine; `{replicas}` says when it is ready (a real "
                      "engine takes seconds to minutes).")
    console.print("Ask a model:", style="bold")
    console.print(curl, markup=False, highlight=False)
    console.print(py, markup=False, highlight=False)
    console.print("Operator commands find this controller and its token by themselves: "
                  f"[bold]{_command()} status --data-dir {layout.data_dir}[/]")
    console.print("Ctrl-C stops everything, engines included.", style="dim")
