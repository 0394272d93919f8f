"""Two `llmgw up` started together on the same ports both pass the port check; the one that loses
at listen() says which flag's port is taken, as the check would have, and leaves no engine."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import pytest

from llmgw.compose import server
from llmgw.control.datadir import release_data_dir


def _listening() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_a_port_taken_between_the_check_and_listen_is_the_checks_error(run_cli, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # The other `up` takes the port in the moment between this one's check and its listen():
    # the check is skipped to open that window every time instead of once in a while.
    monkeypatch.setattr(server, "check_free", lambda *_: None)
    data = tmp_path / "d"
    with _listening() as taken:
        port = taken.getsockname()[1]
        try:
            code, out = run_cli("up", "--data-dir", str(data), "--router-port", str(port),
                                "--admin-port", str(_free_port()))
        finally:
            release_data_dir(data / "controller")
    assert code == 1, out
    assert f"error: --router-port port {port} on 127.0.0.1 is already in use" in out
    assert "Traceback" not in out
    assert not (data / "admin.url").exists()
    left = subprocess.run(["pgrep", "-f", str(data)], capture_output=True, text=True, check=False).stdout
    assert left == "", f"engines left running: {left}"
