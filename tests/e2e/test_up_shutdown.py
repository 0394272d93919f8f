"""The request path of `llmgw up` (the same server wiring as `llmgw controller`): a client that
goes away cancels the engine's work, and a closed terminal (SIGHUP) with a request in flight
stops everything within seconds, engines included.

And shutdown that the terminal cannot abort: `llmgw up 2>&1 | tee up.log`, then Ctrl-C, once
left every engine running (tee died with the Ctrl-C, and up's "stopping…" line met a closed
pipe). Whatever state its output is in — a pipe whose reader left, a full pipe nobody reads, a
terminal that closed — INT, TERM and HUP stop every engine, its sandbox and its monitor."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from llmgw.cli.client import URL_FILE
from tests.e2e.processes import LLMGW, free_port, start, stop, wait_for
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


def sim_metric(endpoint: str, name: str) -> float:
    with urllib.request.urlopen(endpoint + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith(name))


def cancelled(endpoint: str) -> float:
    return sim_metric(endpoint, "llmgw_sim_requests_cancelled_total")


def running(endpoint: str) -> float:
    return sim_metric(endpoint, "vllm:num_requests_running")


def post_and_leave(port: int, body: bytes, leave: threading.Event) -> None:
    """Send a request, then go away without reading an answer once ``leave`` is set (or after 5 min)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        leave.wait(300)


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
        leave = threading.Event()
        client_thread = threading.Thread(target=post_and_leave, args=(router_port, body, leave), daemon=True)
        client_thread.start()
        # The client leaves once the engine is at work on its request (not after a guess at how long
        # the router takes to pass it on: gone before that, there is nothing for the engine to cancel).
        wait_for(lambda: running(endpoint) >= 1, 60, "the engine at work on the request", proc)
        leave.set()
        client_thread.join(30)
        # Without handler cancellation the engine would generate its 200 tokens (40 s) for nobody:
        # never counted as cancelled, however long this waits.
        wait_for(lambda: cancelled(endpoint) > before, 30, "the engine saw its request cancelled", proc)
        wait_for(lambda: running(endpoint) == 0, 30, "the engine idle again", proc)

        # A model no node of `up` can run (it wants 16 H100s): answered at once with the reason,
        # not held for the 180 s hold timeout.
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{router_port}/v1", api_key="x", max_retries=0,
                               timeout=30)
        t0 = time.monotonic()
        with pytest.raises(openai.APIStatusError) as err:
            client.chat.completions.create(model="llama-3.1-405b-instruct", messages=hi)
        assert time.monotonic() - t0 < 60  # not held for the 180 s hold timeout (a bound that a busy box cannot trip)
        assert err.value.status_code == 503 and "no node can run it" in err.value.message, err.value.message
        assert "llmgw explain llama-3.1-405b-instruct" in err.value.message

        # A request in flight (the engine at work on it, its client staying), then the terminal closes.
        stay = threading.Event()
        threading.Thread(target=post_and_leave, args=(router_port, body, stay), daemon=True).start()
        wait_for(lambda: running(endpoint) >= 1, 60, "the engine at work on the request", proc)
    finally:
        t0 = time.monotonic()
        code = stop(proc, signal.SIGHUP, timeout=60)
        took = time.monotonic() - t0
    assert code == 0, log.read_text()[-3000:]
    # The drain (5 s) and the stop grace (5 s), not the request's end (its engine needs 40 s more,
    # its client never leaves) nor a hang to the kill.
    assert took < 30, f"stopping took {took:.1f} s"
    # An engine's monitor writes the exit record the stop waits for, then ends: waited for too.
    wait_for(lambda: processes_under(data) == [], 30, "nothing left under the data dir")


WELCOME = b"Ctrl-C stops everything"
# The example catalog's models that the local node of `up` can run.
LOCAL_MODELS = {"sim-chat", "sim-embed"}


@contextlib.contextmanager
def up_writing_to(tmp_path: Path, out: int, *, args: tuple[str, ...] = (), ctty: bool = False,
                  ) -> Iterator[tuple[subprocess.Popen, Path, str]]:
    """`llmgw up` with stdout and stderr on descriptor ``out``; (the process, its data dir, the admin URL).

    ``ctty``: ``out`` is a terminal, made the controlling terminal of up's own session (as a shell
    in a terminal window runs it), so closing the terminal hangs it up."""
    data = tmp_path / "state"
    admin_port = free_port()
    argv = [LLMGW, "up", "--data-dir", str(data), "--router-port", str(free_port()), "--admin-port", str(admin_port),
            *args]
    if ctty:  # util-linux setsid: a new session whose controlling terminal is stdin (no fork: the same pid)
        argv = ["setsid", "--ctty", *argv]
    proc = subprocess.Popen(argv, stdin=out if ctty else subprocess.DEVNULL, stdout=out, stderr=out,
                            env={**os.environ, "COLUMNS": "200"}, start_new_session=not ctty)
    try:
        yield proc, data, f"http://127.0.0.1:{admin_port}"
    finally:
        if proc.poll() is None:  # the test failed: leave nothing behind for the next one
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        for pid in processes_under(data):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def engines_ready(proc: subprocess.Popen, data: Path, admin_url: str) -> list[int]:
    """Wait until every model the local node can run is ready; the pids of each engine, its process
    group (a sandboxed engine's leader is bwrap) and its monitor, found from the agent's own records."""
    token = wait_for(lambda: (data / "admin.token").exists() and (data / "admin.token").read_text().strip(), 60,
                     "the admin token written", proc)

    def ready() -> bool:
        states = {r["model"]: r["state"] for r in admin(admin_url, token, "/api/v1/replicas")}
        return all(states.get(m) == "ready" for m in LOCAL_MODELS)

    wait_for(ready, 90, "the local models ready", proc)
    records = [json.loads(f.read_text()) for f in (data / "node" / "state" / "engines").glob("*.json")]
    assert {r["labels"]["llmgw.model"] for r in records} >= LOCAL_MODELS
    pids = []
    for r in records:
        leader = _stat(r["pid"])
        assert leader is not None, r  # else "all gone" below could pass with nothing ever running
        members = [p for p in _pids() if (st := _stat(p)) and st["pgid"] == r["pid"]]
        monitor = leader["ppid"]
        assert b"_engine-monitor" in Path(f"/proc/{monitor}/cmdline").read_bytes(), r
        if r.get("sandbox") == "bwrap":
            assert Path(f"/proc/{r['pid']}/cmdline").read_bytes().split(b"\0")[0].endswith(b"bwrap")
            assert len(members) >= 2, r  # bwrap and the engine inside it
        pids += [*members, monitor]
    return pids


def _pids() -> list[int]:
    return [int(d.name) for d in Path("/proc").iterdir() if d.name.isdigit()]


def _stat(pid: int) -> dict[str, int] | None:
    """A living (not zombie) process's parent and process group, or None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else {"ppid": int(fields[1]), "pgid": int(fields[2])}


def assert_all_stopped(proc: subprocess.Popen, data: Path, pids: list[int]) -> None:
    """`up` exits 0 having run its shutdown to the end, and nothing it ran is left."""
    assert proc.wait(120) == 0
    # The shutdown's last step (the address file is withdrawn after the engines are stopped) ran.
    assert not (data / URL_FILE).exists()
    wait_for(lambda: not [p for p in pids if _stat(p)], 30, "every engine, sandbox and monitor gone")
    assert processes_under(data) == []


def read_until(fd: int, marker: bytes, proc: subprocess.Popen) -> bytes:
    seen = b""
    while marker not in seen:
        chunk = os.read(fd, 65536)
        assert chunk, f"up's output ended before {marker!r} (exit {proc.poll()}): {seen[-2000:]!r}"
        seen += chunk
    return seen


@pytest.mark.timeout(240)
def test_sigint_with_output_to_a_pipe_whose_reader_left_stops_every_engine(tmp_path: Path) -> None:
    """`llmgw up 2>&1 | tee up.log`, then Ctrl-C: tee exits first, then up gets SIGINT."""
    reader, writer = os.pipe()
    with up_writing_to(tmp_path, writer) as (proc, data, admin_url):
        os.close(writer)
        read_until(reader, WELCOME, proc)
        pids = engines_ready(proc, data, admin_url)
        os.close(reader)  # tee is gone: up's next write meets a closed pipe
        proc.send_signal(signal.SIGINT)
        assert_all_stopped(proc, data, pids)


@pytest.mark.timeout(240)
def test_sigterm_with_output_to_a_full_pipe_nobody_reads_stops_every_engine(tmp_path: Path) -> None:
    """A reader that never reads (a paused pager, a stuck log shipper): the pipe is full before up
    writes a byte, and up logs at info level. It must still serve, and stop everything on TERM."""
    reader, writer = os.pipe()
    # Our own open file of the same pipe, non-blocking, to fill it without blocking this test.
    filler = os.open(f"/proc/self/fd/{writer}", os.O_WRONLY | os.O_NONBLOCK)
    for size in (65536, 1):
        try:
            while True:
                os.write(filler, b"x" * size)
        except BlockingIOError:
            pass
    with up_writing_to(tmp_path, writer, args=("--log-level", "info")) as (proc, data, admin_url):
        os.close(writer)
        pids = engines_ready(proc, data, admin_url)  # up's event loop is not stuck in a write
        proc.send_signal(signal.SIGTERM)
        assert_all_stopped(proc, data, pids)
    os.close(filler)
    os.close(reader)


@pytest.mark.timeout(240)
def test_a_closed_terminal_and_repeated_signals_stop_every_engine(tmp_path: Path) -> None:
    """The terminal window closes: the kernel hangs up up's terminal (SIGHUP, and writes fail with
    EIO), and the shell passes on HUP, and an impatient user presses Ctrl-C: a later signal does
    not cut the shutdown the first one began."""
    terminal, tty = pty.openpty()
    with up_writing_to(tmp_path, tty, ctty=True) as (proc, data, admin_url):
        os.close(tty)
        seen = read_until(terminal, WELCOME, proc)
        assert b"?token=" in seen  # up saw a terminal (the clickable dashboard link is for terminals only)
        pids = engines_ready(proc, data, admin_url)
        os.close(terminal)  # the window closes
        for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, sig)
        assert_all_stopped(proc, data, pids)
