"""`llmgw up` as a newcomer runs it: a subprocess, no config, an answer in seconds."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import openai
import pytest

from tests.conftest import git
from tests.e2e.processes import LLMGW, free_port, start, stop, wait_for

pytestmark = pytest.mark.slow

NEW_MODEL = """\
name: sim-extra
aliases: [extra]
source: sim://extra
size_gb: 0.1
scaling: {min: 1, max: 1}
profiles:
  - name: sim
    engine: sim
    gpus: 0
    pool: local
"""


def processes_under(root: Path) -> list[int]:
    """Living processes whose command line or working directory lies under ``root``."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            cwd = os.readlink(d / "cwd")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and (str(root) in cmd or cwd.startswith(str(root))):
            found.append(int(d.name))
    return found


def test_up_serves_applies_commits_and_stops_clean(tmp_path: Path) -> None:
    data = tmp_path / "state"
    router_port, admin_port = free_port(), free_port()
    log = tmp_path / "up.log"
    proc = start(["up", "--data-dir", str(data), "--router-port", str(router_port), "--admin-port",
                  str(admin_port)], log)
    try:
        text = wait_for(lambda: "Ctrl-C stops everything" in log.read_text() and log.read_text(), 60,
                        "llmgw up printed its welcome", proc)
        url = re.search(r"router\s+(http://\S+/v1)", text).group(1)
        assert url == f"http://127.0.0.1:{router_port}/v1"
        assert f"token in {data}/admin.token" in text and f"catalog    {data}/catalog" in text
        assert oct((data / "admin.token").stat().st_mode & 0o777) == "0o600"

        client = openai.OpenAI(base_url=url, api_key="unused", timeout=10, max_retries=0)

        def answer(model: str) -> str | None:
            try:
                r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello"}])
            except openai.APIError:
                return None
            return r.choices[0].message.content

        assert wait_for(lambda: answer("gpt-4o-mini"), 60, "an answer from the sim model")

        # A commit in the catalog repository is applied live (the watcher sees it).
        repo = data / "catalog"
        (repo / "models" / "sim-extra.yaml").write_text(NEW_MODEL)
        git(repo, "add", "-A")
        git(repo, "commit", "-q", "-m", "Add sim-extra")
        assert wait_for(lambda: answer("extra"), 60, "the new model served")

        # The tour: `llmgw diff` in the repository plans an uncommitted edit against the live fleet,
        # and the operator commands find the token of this `up` by themselves.
        (repo / "models" / "sim-more.yaml").write_text(NEW_MODEL.replace("sim-extra", "sim-more").replace(
            "[extra]", "[more]").replace("sim://extra", "sim://more"))
        diff = subprocess.run([LLMGW, "diff", "--repo", str(repo)], capture_output=True, text=True, timeout=60,
                              check=False)
        assert diff.returncode == 2, diff.stdout + diff.stderr
        assert re.search(r"llmgw diff [0-9a-f]{12} → working tree", diff.stdout)
        assert "+ model sim-more" in diff.stdout and "(live fleet at http://127.0.0.1:" in diff.stdout
        assert "+ start   sim-more/sim on local" in diff.stdout
        # Models the local node can never hold are not this change's doing: shown apart, not counted.
        assert "Plan: 1 to start, 0 to stop, 0 unplaceable." in diff.stdout
        assert "still cannot be placed, as before this change: bge-large-en-v1.5 (1)" in diff.stdout
        (repo / "models" / "sim-more.yaml").unlink()
        status = subprocess.run([LLMGW, "status", "--data-dir", str(data), "--url", f"http://127.0.0.1:{admin_port}"],
                                capture_output=True, text=True, timeout=60, check=False)
        assert status.returncode == 0 and "sync      synced" in status.stdout, status.stdout + status.stderr
    finally:
        code = stop(proc, signal.SIGINT, timeout=60)
    assert code == 0, log.read_text()[-3000:]
    assert "stopped;" in log.read_text()
    assert processes_under(data) == []

    # Starting again comes back on the same state: the commit made above is still applied.
    log2 = tmp_path / "up2.log"
    proc = start(["up", "--data-dir", str(data), "--router-port", str(router_port), "--admin-port",
                  str(admin_port)], log2)
    try:
        wait_for(lambda: "Ctrl-C stops everything" in log2.read_text(), 60, "second start", proc)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{router_port}/v1", api_key="unused", timeout=10,
                               max_retries=0)

        def extra() -> str | None:
            try:
                return client.chat.completions.create(
                    model="extra", messages=[{"role": "user", "content": "hi"}]).choices[0].message.content
            except openai.APIError:
                return None

        wait_for(extra, 60, "sim-extra served after restart")
    finally:
        assert stop(proc, signal.SIGINT, timeout=60) == 0
    assert processes_under(data) == []


def test_a_port_in_use_is_a_clear_error_naming_the_flag(tmp_path: Path) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        log = tmp_path / "up.log"
        proc = start(["up", "--data-dir", str(tmp_path / "s"), "--router-port", str(port), "--admin-port",
                      str(free_port())], log)
        assert proc.wait(60) == 1
    out = log.read_text()
    assert f"--router-port port {port} on 127.0.0.1 is already in use" in out
    assert "Traceback" not in out
