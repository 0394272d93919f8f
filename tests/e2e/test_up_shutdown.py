"""The request path of `llmgw up` (the same server wiring as `llmgw controller`): a client that
goes away cancels the engine's work, and a closed terminal (SIGHUP) with a request in flight
stops everything within seconds, engines included."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import threading
import time
import urllib.request
from pathlib import Path

import openai
import pytest

from tests.e2e.processes import free_port, start, stop, wait_for
from tests.e2e.test_up import processes_under

pytestmark = pytest.mark.slow
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "catalog"
SLOW = """\
name: slow
source: sim://slow
size_gb: 0.1
scaling: {min: 1, max: 1}
profiles:
  - {name: sim, engine: sim, gpus: 0, pool: local, args: ["--ttft", "2", "--tokens-per-second", "5"]}
"""


def admin(url: str, token: str, path: str):  # noqa: ANN201
    req = urllib.request.Request(url + path, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def cancelled(endpoint: str) -> float:
    with urllib.request.urlopen(endpoint + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines()
               if x.startswith("llmgw_sim_requests_cancelled_total"))


def post_and_leave(port: int, body: bytes, after: float) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        time.sleep(after)  # then the client goes away without reading an answer


def test_a_client_that_leaves_cancels_the_engine_and_sighup_stops_everything(tmp_path: Path) -> None:
    catalog = tmp_path / "catalog-src"
    shutil.copytree(EXAMPLES, catalog)
    (catalog / "models" / "slow.yaml").write_text(SLOW)
    data = tmp_path / "state"
    router_port, admin_port = free_port(), free_port()
    log = tmp_path / "up.log"
    proc = start(["up", "--data-dir", str(data), "--catalog", str(catalog), "--router-port", str(router_port),
                  "--admin-port", str(admin_port)], log)
    admin_url = f"http://127.0.0.1:{admin_port}"
    try:
        wait_for(lambda: "Ctrl-C stops everything" in log.read_text(), 60, "llmgw up printed its welcome", proc)
        token = (data / "admin.token").read_text().strip()

        def slow_endpoint() -> str | None:
            reps = [r for r in admin(admin_url, token, "/api/v1/replicas") if r["model"] == "slow"]
            return reps[0]["endpoint"] if reps and reps[0]["state"] == "ready" else None

        endpoint = wait_for(slow_endpoint, 60, "the slow model ready", proc)
        before = cancelled(endpoint)
        hi = [{"role": "user", "content": "hi"}]
        body = json.dumps({"model": "slow", "max_tokens": 200, "messages": hi}).encode()
        post_and_leave(router_port, body, after=0.5)
        # Without handler cancellation the engine would generate its 200 tokens (40 s) for nobody.
        wait_for(lambda: cancelled(endpoint) > before, 5, "the engine saw its request cancelled", proc)

        # A model no node of `up` can run (it wants 16 H100s): answered at once with the reason,
        # not held for the 180 s hold timeout.
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{router_port}/v1", api_key="x", max_retries=0,
                               timeout=30)
        t0 = time.monotonic()
        with pytest.raises(openai.APIStatusError) as err:
            client.chat.completions.create(model="llama-3.1-405b-instruct", messages=hi)
        assert time.monotonic() - t0 < 2.0
        assert err.value.status_code == 503 and "no node can run it" in err.value.message, err.value.message
        assert "llmgw explain llama-3.1-405b-instruct" in err.value.message

        # A request in flight, then the terminal closes.
        worker = threading.Thread(target=post_and_leave, args=(router_port, body, 20), daemon=True)
        worker.start()
        time.sleep(0.5)
    finally:
        t0 = time.monotonic()
        code = stop(proc, signal.SIGHUP, timeout=30)
        took = time.monotonic() - t0
    assert code == 0, log.read_text()[-3000:]
    assert took < 10, f"stopping took {took:.1f} s"
    assert processes_under(data) == [], log.read_text()[-2000:]
