"""bench: weights at fleet scale (issue 42). N node agents fetch one model from a rate-limited
origin, two ways in the same run:

    origin   every node reads the origin itself, all at once (what nodes did before)
    peer     one node reads the origin; the others follow it, reading each chunk from that node's
             peer server as it hashes it, each chunk checked, the rest by its chunk list at the end
             (the plan the controller makes: llmgw.reconciler.lifecycle, tested end to end in
             tests/reconciler/test_peer_fetch_e2e.py)

and ``one``: a single node reading the origin alone, the yardstick. Each node is the real agent
(llmgw/agent/llmgw_agent.py) with its own cache, state and config; the origin is an HTTP server
that shares one bandwidth among its connections and counts what it sends. Rounds rotate the
order of the sides; figures are medians. A last phase kills a node's fetch mid-way and fetches
again: the bytes the origin sends twice are counted.

Goals: peer's origin bytes <= 1.05 x the model size; peer's slowest node done within 1.3 x one
node's time alone; 0 verified bytes read again after a kill.

    python bench/fetch_bench.py [--quick] [--nodes N] [--mb SIZE] [--rate MB_PER_S]

The last line is one JSON object with every figure and ``met``.
"""

from __future__ import annotations

import argparse
import hashlib
import http.server
import json
import os
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from llmgw.agent.parts.protocol import cache_name  # noqa: E402

AGENT = ROOT / "llmgw" / "agent" / "llmgw_agent.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Origin:
    """One file over HTTP, all connections sharing ``rate`` bytes a second; counts bytes sent."""

    def __init__(self, data: bytes, rate: float) -> None:
        self.data, self.rate, self.sent = data, rate, 0
        self.starts: list[int] = []  # the first byte each request asked for (a Range's start)
        self.lock = threading.Lock()
        self.next_free = time.monotonic()
        origin = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *_args: object) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802
                start = 0
                if (rng := self.headers.get("Range", "")).startswith("bytes="):
                    start = int(rng[6:].split("-")[0])
                origin.starts.append(start)
                self.send_response(206 if start else 200)
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(origin.data) - 1}/{len(origin.data)}")
                self.send_header("Content-Length", str(len(origin.data) - start))
                self.end_headers()
                try:
                    for i in range(start, len(origin.data), 256 << 10):
                        piece = origin.data[i:i + (256 << 10)]
                        origin.pace(len(piece))
                        self.wfile.write(piece)
                        with origin.lock:
                            origin.sent += len(piece)
                except OSError:
                    pass  # the node went away (killed mid-fetch)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/model/weights.safetensors"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def pace(self, n: int) -> None:
        """Wait for ``n`` bytes of the shared line."""
        with self.lock:
            now = time.monotonic()
            start = max(now, self.next_free)
            self.next_free = start + n / self.rate
        time.sleep(max(0.0, start + n / self.rate - time.monotonic()))


class Node:
    def __init__(self, root: Path, peer_port: int) -> None:
        self.root = root
        for d in ("cache", "state", "models"):
            (root / d).mkdir(parents=True, exist_ok=True)
        self.config = root / "agent.json"
        self.config.write_text(json.dumps({
            "cache_dir": str(root / "cache"), "state_dir": str(root / "state"), "model_dirs": [str(root / "models")],
            "port_range": [41000, 41010], "advertise_address": "127.0.0.1", "fabric_address": "127.0.0.1",
            "peer_port": peer_port, "engines": {}, "gpus": [{"index": 0, "class": "sim", "memory_gb": 24}],
            "sandbox": "none"}))

    def call(self, verb: str, request: dict) -> dict:
        done = subprocess.run([sys.executable, str(AGENT), "--config", str(self.config), verb],
                              input=json.dumps(request).encode(), capture_output=True, timeout=60, check=False)
        return json.loads(done.stdout)

    def state(self, source: str) -> dict | None:
        try:
            return json.loads((self.root / "state" / "fetches" / f"{cache_name(source)}.json").read_text())
        except (OSError, ValueError):
            return None

    def wait(self, source: str, timeout: float = 900) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.state(source)
            if s is not None and s["state"] != "running":
                if s["state"] != "done":
                    raise RuntimeError(f"fetch failed on {self.root.name}: {s.get('error')}")
                return
            time.sleep(0.05)
        raise RuntimeError("a fetch did not end in time")

    def workers(self) -> list[int]:
        out = []
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    cmd = (d / "cmdline").read_bytes()
                except OSError:
                    continue
                if b"_fetch-worker" in cmd and str(self.config).encode() in cmd:
                    out.append(int(d.name))
        return out

    def stop_peer_server(self) -> None:
        record = self.root / "state" / "peer-server.json"
        if record.exists():
            try:
                os.kill(json.loads(record.read_text())["pid"], signal.SIGKILL)
            except (ProcessLookupError, KeyError, ValueError):
                pass


def fresh_nodes(base: Path, n: int) -> list[Node]:
    made = base / f"run-{secrets.token_hex(4)}"
    return [Node(made / f"n{i}", free_port()) for i in range(n)]


def side_one(base: Path, origin: Origin) -> float:
    [node] = fresh_nodes(base, 1)
    t0 = time.monotonic()
    node.call("fetch", {"source": origin.url})
    node.wait(origin.url)
    took = time.monotonic() - t0
    done_with([node])
    return took


def done_with(nodes: list[Node]) -> None:
    """A side's nodes removed once measured: a full run would hold 13 copies a round otherwise."""
    shutil.rmtree(nodes[0].root.parent, ignore_errors=True)


def side_origin(base: Path, origin: Origin, n: int) -> tuple[float, int]:
    nodes = fresh_nodes(base, n)
    sent0 = origin.sent
    t0 = time.monotonic()
    for node in nodes:
        node.call("fetch", {"source": origin.url})
    for node in nodes:
        node.wait(origin.url)
    took = time.monotonic() - t0
    done_with(nodes)
    return took, origin.sent - sent0


def side_peer(base: Path, origin: Origin, n: int, data_sha: str) -> tuple[float, int]:
    nodes = fresh_nodes(base, n)
    sent0 = origin.sent
    t0 = time.monotonic()
    first, rest = nodes[0], nodes[1:]
    first.call("fetch", {"source": origin.url})
    name = cache_name(origin.url)
    for node in rest:  # each follows the first as it reads the origin, its lists signed with a key of its own
        token, mac_key = secrets.token_urlsafe(32), secrets.token_hex(32)
        seed = first.call("seed", {"name": name, "token_sha256": hashlib.sha256(token.encode()).hexdigest(),
                                   "ttl": 3600, "mac_key": mac_key})
        if "url" not in seed:
            raise RuntimeError(f"seed refused: {seed}")
        node.call("fetch", {"source": origin.url,
                            "peer": {"url": seed["url"], "token": token, "follow": True, "mac_key": mac_key}})
    for node in nodes:
        node.wait(origin.url)
    took = time.monotonic() - t0
    first.stop_peer_server()
    for node in nodes:
        got = hashlib.sha256((node.root / "cache" / name / "weights.safetensors").read_bytes()).hexdigest()
        if got != data_sha:
            raise RuntimeError(f"{node.root.name} holds other bytes than the origin's")
    done_with(nodes)
    return took, origin.sent - sent0


def kill_phase(base: Path, origin: Origin, size: int) -> tuple[int, int]:
    """A node's fetch killed half-way and run again: (bytes it had verified and written when killed,
    of those the bytes it asked the origin for again). What was in flight and never written (a
    socket's buffers) is not verified: it is read again, and not counted here."""
    [node] = fresh_nodes(base, 1)
    node.call("fetch", {"source": origin.url})
    partial = node.root / "cache" / (".tmp-" + cache_name(origin.url)) / "weights.safetensors"
    deadline = time.monotonic() + 300
    while not (partial.exists() and partial.stat().st_size > size // 2) and time.monotonic() < deadline:
        time.sleep(0.02)
    for pid in node.workers():
        os.kill(pid, signal.SIGKILL)
    while node.workers():
        time.sleep(0.02)
    had = partial.stat().st_size
    asked = len(origin.starts)
    node.call("fetch", {"source": origin.url})
    node.wait(origin.url)
    resumed_at = min(origin.starts[asked:], default=size)
    return had, max(0, had - resumed_at)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="64 MB, 4 nodes, 2 rounds (under a minute)")
    ap.add_argument("--nodes", type=int)
    ap.add_argument("--mb", type=int)
    ap.add_argument("--rate", type=float, help="the origin's line, MB/s (shared by its connections)")
    ap.add_argument("--rounds", type=int)
    a = ap.parse_args()
    n = a.nodes or (4 if a.quick else 6)
    mb = a.mb or (64 if a.quick else 1024)
    rate = (a.rate or (32.0 if a.quick else 64.0)) * 1e6
    rounds = a.rounds or (2 if a.quick else 3)
    data = os.urandom(mb << 20)
    data_sha = hashlib.sha256(data).hexdigest()
    origin = Origin(data, rate)
    started = time.monotonic()
    ones, origins, peers, origin_bytes, peer_bytes = [], [], [], [], []
    with tempfile.TemporaryDirectory(prefix="llmgw-fetch-bench-") as tmp:
        base = Path(tmp)
        for r in range(rounds):
            order = ["one", "origin", "peer"]
            order = order[r % 3:] + order[:r % 3]  # each side first in turn
            for side in order:
                if side == "one":
                    took = side_one(base, origin)
                    ones.append(took)
                elif side == "origin":
                    took, sent = side_origin(base, origin, n)
                    origins.append(took)
                    origin_bytes.append(sent)
                else:
                    took, sent = side_peer(base, origin, n, data_sha)
                    peers.append(took)
                    peer_bytes.append(sent)
                print(f"round {r + 1} {side}: {took:.2f} s", flush=True)
        had, again = kill_phase(base, origin, len(data))
    one, all_origin, all_peer = statistics.median(ones), statistics.median(origins), statistics.median(peers)
    size = len(data)
    checks = {
        "peer: origin bytes <= 1.05 x size": max(peer_bytes) <= 1.05 * size,
        "peer: all nodes done within 1.3 x one node's time": all_peer <= 1.3 * one,
        "kill: 0 verified bytes read again": had > 0 and again == 0,
    }
    result = {
        "bench": "fetch", "quick": a.quick, "nodes": n, "size_bytes": size, "origin_rate_mb_s": rate / 1e6,
        "rounds": rounds, "one_node_s": round(one, 2), "every_node_from_origin_s": round(all_origin, 2),
        "peer_s": round(all_peer, 2), "peer_vs_one": round(all_peer / one, 3),
        "origin_vs_one": round(all_origin / one, 3),
        "origin_bytes_every_node_from_origin": int(statistics.median(origin_bytes)),
        "origin_bytes_peer": int(max(peer_bytes)), "origin_bytes_peer_vs_size": round(max(peer_bytes) / size, 4),
        "bytes_verified_at_kill": had, "verified_bytes_read_again_after_kill": again,
        "elapsed_s": round(time.monotonic() - started, 1),
        "goal": "origin bytes <= 1.05 x model size; all nodes within 1.3 x one node's time; 0 bytes again after a kill",
        "checks": checks, "met": all(checks.values()),
    }
    for k, v in checks.items():
        print(f"  {'ok  ' if v else 'FAIL'} {k}")
    print(json.dumps(result))
    return 0 if result["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
