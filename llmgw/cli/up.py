"""`llmgw up`: the whole system on one machine — controller, router, admin API, dashboard,
a local node running simulated engines — with one command and no configuration."""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path

from rich.console import Console
from rich.panel import Panel

from llmgw.cli.serve import run_until_signal
from llmgw.paths import default_data_dir


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="run everything on this machine: the example catalog on simulated engines")
    p.add_argument("--catalog", help="catalog directory to start from (default: the bundled examples/catalog)")
    p.add_argument("--data-dir", help=f"where state lives (default: {default_data_dir()})")
    p.add_argument("--router-port", type=int, default=8080, help="OpenAI-compatible API port (default 8080)")
    p.add_argument("--admin-port", type=int, default=8081, help="admin API and dashboard port (default 8081)")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=run)


def run(args: argparse.Namespace, console: Console) -> int:
    from llmgw.cli.output import fail
    from llmgw.control.server import start
    from llmgw.control.up import UpLayout, prepare
    from llmgw.errors import LlmgwError

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    data_dir = Path(args.data_dir).resolve() if args.data_dir else default_data_dir()
    try:
        cfg = prepare(data_dir, catalog=Path(args.catalog).resolve() if args.catalog else None,
                      router_port=args.router_port, admin_port=args.admin_port)
    except LlmgwError as exc:
        return fail(console, str(exc))
    layout = UpLayout(data_dir)

    async def main() -> None:
        running = await start(cfg, router_flag="--router-port", admin_flag="--admin-port")
        # Lets `llmgw diff` in the catalog repository find this controller and its fleet.
        (layout.data_dir / "admin.url").write_text(running.admin_url + "\n")
        try:
            _welcome(console, running.router_url, running.admin_url, layout, cfg.admin_token)
            await asyncio.Event().wait()
        finally:
            console.print("stopping: engines first, then the control plane…")
            # Unlike a fleet controller, `up` owns its engines: none outlives it.
            await running.controller.reconciler.stop_all()
            await running.close()
            console.print("stopped; `llmgw up` again comes back on the same catalog and state.")

    return run_until_signal(main(), console)


def _welcome(console: Console, router: str, admin: str, layout, token: str) -> None:  # noqa: ANN001
    model = "gpt-4o-mini"
    curl = (f"curl -s {router}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
            f"  -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello\"}}]}}'")
    py = (f"from openai import OpenAI\nclient = OpenAI(base_url=\"{router}/v1\", api_key=\"unused\")\n"
          f"print(client.chat.completions.create(model=\"{model}\", "
          f"messages=[{{\"role\": \"user\", \"content\": \"Hello\"}}]).choices[0].message.content)")
    console.print(Panel.fit(
        f"[bold]router[/]     {router}/v1   (OpenAI API)\n"
        f"[bold]dashboard[/]  {admin}/?token={token}\n"
        f"[bold]admin API[/]  {admin}/api/v1   token in {layout.token_file}\n"
        f"[bold]catalog[/]    {layout.catalog}   edit, `git commit`, and it is applied live\n",
        title="llmgw is up", border_style="green"))
    console.print("Ask a model:", style="bold")
    console.print(curl, markup=False, highlight=False)
    console.print(py, markup=False, highlight=False)
    console.print(f"Operator commands find the token by themselves: [bold]llmgw status --data-dir {layout.data_dir}[/]")
    console.print("Ctrl-C stops everything, engines included.", style="dim")
