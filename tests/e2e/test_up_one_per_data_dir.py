"""A second `llmgw up` on a data dir that one already runs on is refused first thing: it names the
data dir and the process holding it, and writes nothing there (its node config, its catalog)."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest

from tests.e2e.processes import LLMGW, free_port, start, stop, wait_for


@pytest.mark.slow
def test_a_second_up_on_the_same_data_dir_is_refused_before_it_touches_anything(tmp_path: Path) -> None:
    data = tmp_path / "state"
    ports = ["--router-port", str(free_port()), "--admin-port", str(free_port())]
    log = tmp_path / "up.log"
    first = start(["up", "--data-dir", str(data), *ports], log)
    try:
        wait_for(lambda: "Ctrl-C stops everything" in log.read_text(), 60, "the first up is up", first)
        agent_config = data / "node" / "agent.json"
        before = {p: p.stat().st_mtime_ns for p in (agent_config, data / "catalog" / ".git" / "HEAD")}
        # The same ports too: the data dir is the answer, not "port in use".
        out = subprocess.run([LLMGW, "up", "--data-dir", str(data), *ports], capture_output=True, text=True,
                             timeout=60, check=False, stdin=subprocess.DEVNULL)
        text = " ".join((out.stdout + out.stderr).split())
        assert out.returncode == 1, text
        assert f"data dir {data / 'controller'} is in use by another llmgw process (pid {first.pid})" in text
        assert "already in use" not in text and "Traceback" not in text
        assert {p: p.stat().st_mtime_ns for p in before} == before
        assert first.poll() is None
    finally:
        assert stop(first, signal.SIGINT, timeout=60) == 0
