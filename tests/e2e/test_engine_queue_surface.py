"""An engine's queue, as an operator sees it: `llmgw models` (text and JSON), the dashboard's
models table and the router's /metrics, through a real `llmgw controller` process.

The router reads each replica's running and waiting requests off the engine's own /metrics to
route by; an operator could not see them. The simulator here holds one generation at a time
(``--max-running 1``) at 4 tokens a second, so three streams in flight are one running and two
waiting on the engine, whatever the router sent. Each asks for more tokens than the test could
ever wait for: the queue stays as it is until the test ends the streams (their clients leave),
however long a busy machine takes to read it four ways.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.e2e.processes import LLMGW, SIM_CHAT_MODEL_YAML, local_controller, start, stop_everything, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]  # its waits allow 90 s (the default timeout: 60)
TOKEN = "queue-admin-token"
SLOW_ONE_AT_A_TIME = SIM_CHAT_MODEL_YAML + '    args: ["--max-running", "1", "--tokens-per-second", "4"]\n'


def cli(admin: str, *args: str) -> str:
    done = subprocess.run([LLMGW, *args, "--url", admin, "--token", TOKEN], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "COLUMNS": "250"})  # a table a row of which fits
    assert done.returncode == 0, done.stderr
    return done.stdout


def queue(admin: str) -> dict[str, Any] | None:
    done = subprocess.run([LLMGW, "models", "-o", "json", "--url", admin, "--token", TOKEN], capture_output=True,
                          text=True, timeout=60)
    if "cannot reach the controller" in done.stderr:
        return None  # not listening yet
    assert done.returncode == 0, done.stderr
    [m] = json.loads(done.stdout)
    return m["engine_queue"]


def router_gauge(router: str, state: str) -> float | None:
    with urllib.request.urlopen(router + "/metrics", timeout=10) as r:
        text = r.read().decode()
    m = re.search(r'^llmgw_router_engine_requests\{[^}]*state="' + state + r'"[^}]*\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else None


def test_an_engines_running_and_waiting_requests_are_in_llmgw_models_the_dashboard_and_metrics(
        tmp_path: Path) -> None:
    c = local_controller(tmp_path, model_yaml=SLOW_ONE_AT_A_TIME, token=TOKEN)
    router, admin = c.router, c.admin
    controller = start(["controller", "--config", str(c.config)], tmp_path / "controller.log")
    client = openai.OpenAI(base_url=router + "/v1", api_key="unused", timeout=120, max_retries=0)
    threads: list[threading.Thread] = []
    try:
        # Idle and read: zero, not "unknown" (the engine said so).
        idle = wait_for(lambda: queue(admin), 90, "the engine's queue read once", controller)
        assert idle == {"running": 0, "waiting": 0, "replicas": 1}

        leave = threading.Event()

        def stream() -> None:
            # 10,000 tokens at 4 a second: the first stream holds the engine's one slot for 40 min.
            with client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "go"}],
                                                max_tokens=10_000, stream=True) as answer:
                for _ in answer:
                    if leave.is_set():
                        break  # the client goes away: the router cancels the engine's request

        threads = [threading.Thread(target=stream, daemon=True) for _ in range(3)]
        for t in threads:
            t.start()
        busy = wait_for(lambda: (q := queue(admin)) and q["waiting"] == 2 and q, 60,
                        "one running and two waiting in llmgw models", controller)
        assert busy == {"running": 1, "waiting": 2, "replicas": 1}
        assert "1 running, 2 waiting" in cli(admin, "models")
        assert router_gauge(router, "running") == 1 and router_gauge(router, "waiting") == 2
        req = urllib.request.Request(admin + "/", headers={"Authorization": f"Bearer {TOKEN}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            page = r.read().decode()
        assert re.search(r'class="engine-queue">\s*1 running, 2 waiting', page), page[-3000:]

        leave.set()  # each stream leaves at its next token: the one running, then each waiting one in turn
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
        assert wait_for(lambda: queue(admin) == {"running": 0, "waiting": 0, "replicas": 1} or None, 60,
                        "the queue empty again", controller)
    finally:
        stop_everything([controller], c.data)
