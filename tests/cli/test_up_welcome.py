"""`llmgw up`'s welcome on a narrow terminal: every address and the dashboard link printed whole."""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console

from llmgw.cli import up
from llmgw.control.up import UpLayout


def test_the_dashboard_link_is_whole_on_an_80_column_terminal(monkeypatch, tmp_path: Path) -> None:  # noqa: ANN001
    monkeypatch.setattr(up, "_is_tty", lambda _console: True)
    out = io.StringIO()
    console = Console(file=out, width=80, force_terminal=True, color_system=None)
    token = "T" * 20 + "-" + "x" * 22  # 43 characters, as up's tokens are
    layout = UpLayout(tmp_path / "a-rather-long-data-directory-name" / "state")
    up._welcome(console, "http://127.0.0.1:8080", "http://127.0.0.1:8081", layout, token, None)
    text = out.getvalue()
    assert f"http://127.0.0.1:8081/?token={token}" in text  # on one line, not cut nor wrapped
    assert f"token in {layout.token_file}" in text and f"catalog    {layout.catalog}" in text


def test_a_refused_up_leaves_no_data_dir(run_cli, tmp_path: Path) -> None:  # noqa: ANN001
    import socket

    data = tmp_path / "new-state"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with socket.socket() as free:
            free.bind(("127.0.0.1", 0))
            admin = free.getsockname()[1]
        code, out = run_cli("up", "--data-dir", str(data), "--router-port", str(port), "--admin-port", str(admin))
    assert code != 0 and "port" in out
    assert not data.exists()


def test_tables_wrap_between_words_and_become_blocks_when_the_words_do_not_fit() -> None:
    """Seen: below ~150 columns every table folded ids mid-word ("sim-cha" / "t-g1")."""
    from llmgw.cli.fleet import _table

    def render(width: int) -> str:
        out = io.StringIO()
        t = _table("replicas", ["REPLICA", "MODEL", "STATE", "WHERE", "ENDPOINT", "ERROR"])
        t.add_row("sim-chat-g1", "sim-chat", "ready", "local gpus 0", "http://127.0.0.1:39001",
                  "engine on local exited with code 1: something long happened here")
        Console(file=out, width=width, color_system=None).print(t)
        return out.getvalue()

    for width in (200, 100, 60, 40):
        text = render(width)
        for word in ("sim-chat-g1", "sim-chat", "http://127.0.0.1:39001", "happened"):
            assert word in text, (width, text)  # never split inside
        assert all(len(line.rstrip()) <= width for line in text.splitlines()), text
    assert "  ENDPOINT  http://127.0.0.1:39001" in render(60)  # one block per row
