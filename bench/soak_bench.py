"""bench: the request path under abuse — nothing lost, nothing sent twice, memory flat (issue 14).

One `llmgw up` (router, controller and admin API in one process, as an operator runs it) with
two simulated engine replicas, under the common limit of 1,024 descriptors, is driven at once by

    streams   clients streaming chat completions; a third of them disconnect after a few chunks
    whole     clients asking for whole answers; a quarter of them give up after 50 ms
    slow      streaming clients with a tiny receive buffer reading 64 bytes every 10 ms
    idle      connections opened and left idle, kept near the router's connection cap
    admin     GET /api/v1/summary every 0.25 s, timed
    fault     half way through, one engine is killed (SIGKILL); the controller starts it again

Every request carries a unique ``user`` field, and each engine logs the ``user`` of each request
it accepted (the simulator's ``--request-log``), so deliveries are counted per client request and
per engine, not inferred from totals. A request is *lost* when its client got no answer at all: no
status, or a stream cut with neither ``[DONE]`` nor an error event (a disconnect the client made
itself is not lost). The same mix runs once as a warm-up before the router's RSS is read, so
"flat" compares two rounds of the same work, not a cold process with a warm one.

    python bench/soak_bench.py [--quick] [--duration S]

Goals: 0 requests lost; at most one delivery of a request per engine (and two in all); router
RSS after the soak within 10 % of before; the admin API answering throughout (p99 < 1 s). The
issue names no peer for this one: the peers' rates are measured by bench/router_bench.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import yaml

REPO = Path(__file__).resolve().parent.parent
LLMGW = str(Path(sys.executable).parent / "llmgw")
MODEL = "sim-chat"
FD_LIMIT = 1024


@dataclass
class Tally:
    sent: int = 0
    complete: int = 0
    errors: int = 0          # answered with an error (status or SSE error event): not lost
    left: int = 0            # the client disconnected on purpose
    lost: int = 0
    lost_examples: list[str] = field(default_factory=list)
    admin_ms: list[float] = field(default_factory=list)
    admin_failures: int = 0
    idle_open: int = 0
    killed: int = 0

    def lose(self, what: str) -> None:
        self.lost += 1
        if len(self.lost_examples) < 5:
            self.lost_examples.append(what)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def make_catalog(tmp: Path) -> Path:
    """The example catalog with the simulated chat model held at two paced replicas."""
    catalog = tmp / "catalog"
    shutil.copytree(REPO / "examples" / "catalog", catalog)
    path = catalog / "models" / "sim-chat.yaml"
    model = yaml.safe_load(path.read_text())
    model["scaling"] = {"min": 2, "max": 2, "idle_after": "1h", "target_inflight": 1000}
    model["profiles"][0]["args"] = ["--tokens-per-second", "400", "--request-log", "requests.log"]
    path.write_text(yaml.safe_dump(model))
    return catalog


def limited() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))


async def wait_ready(admin: str, token: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as s:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"llmgw up exited ({proc.returncode})")
            try:
                async with s.get(f"{admin}/api/v1/replicas", timeout=aiohttp.ClientTimeout(total=2)) as r:
                    replicas = await r.json() if r.status == 200 else []
                ready = [x for x in replicas if x.get("model") == MODEL and x.get("state") == "ready"]
                if len(ready) >= 2:
                    return
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(0.3)
    raise RuntimeError(f"two {MODEL} replicas were not ready within {timeout} s")


def body(user: str, *, stream: bool, tokens: int) -> bytes:
    return json.dumps({"model": MODEL, "user": user, "stream": stream, "max_tokens": tokens,
                       "messages": [{"role": "user", "content": f"Soak {user}: say something."}]}).encode()


class Soak:
    def __init__(self, router: str, admin: str, token: str, tally: Tally, prefix: str, saved: Path) -> None:
        self.router, self.admin, self.token, self.tally, self.prefix = router, admin, token, tally, prefix
        self.saved = saved  # where a killed engine's request log is kept
        self.ids = 0
        self.stop_at = 0.0

    def next_id(self) -> str:
        self.ids += 1
        self.tally.sent += 1
        return f"{self.prefix}-{self.ids}"

    async def stream_client(self, session: aiohttp.ClientSession, rng: random.Random) -> None:
        while time.monotonic() < self.stop_at:
            user = self.next_id()
            leave = rng.random() < 1 / 3
            try:
                async with session.post(f"{self.router}/v1/chat/completions", data=body(user, stream=True, tokens=48),
                                        headers={"Content-Type": "application/json"}) as r:
                    if r.status != 200:
                        await r.read()
                        self.tally.errors += 1
                        continue
                    seen, done, failed = 0, False, False
                    async for line in r.content:
                        if line.startswith(b"data: [DONE]"):
                            done = True
                        elif line.startswith(b'data: {"error"'):
                            failed = True
                        elif line.startswith(b"data:"):
                            seen += 1
                            if leave and seen >= 3:
                                break
                    if leave and not done and not failed:
                        self.tally.left += 1
                    elif done:
                        self.tally.complete += 1
                    elif failed:
                        self.tally.errors += 1
                    else:
                        self.tally.lose(f"{user}: stream ended without [DONE] or an error")
            except (aiohttp.ClientError, TimeoutError) as exc:
                self.tally.lose(f"{user}: {type(exc).__name__}: {exc}")

    async def whole_client(self, session: aiohttp.ClientSession, rng: random.Random) -> None:
        while time.monotonic() < self.stop_at:
            user = self.next_id()
            leave = rng.random() < 1 / 4

            async def ask(user: str = user) -> None:
                async with session.post(f"{self.router}/v1/chat/completions",
                                        data=body(user, stream=False, tokens=32),
                                        headers={"Content-Type": "application/json"}) as r:
                    answer = await r.json(content_type=None)
                    if r.status == 200 and answer.get("choices"):
                        self.tally.complete += 1
                    elif "error" in answer:
                        self.tally.errors += 1
                    else:
                        self.tally.lose(f"{user}: {r.status} without choices or error")

            try:
                if leave:
                    try:
                        await asyncio.wait_for(ask(), 0.05)
                    except TimeoutError:
                        self.tally.left += 1
                else:
                    await ask()
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                self.tally.lose(f"{user}: {type(exc).__name__}: {exc}")

    async def slow_client(self) -> None:
        host, port = self.router.removeprefix("http://").split(":")
        while time.monotonic() < self.stop_at:
            user = self.next_id()
            data = body(user, stream=True, tokens=300)  # ~45 KB: more than the socket buffers hold
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.setblocking(False)
            try:
                await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
                reader, writer = await asyncio.open_connection(sock=sock, limit=4096)
                writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))
                got = b""
                async with asyncio.timeout(120):
                    while piece := await reader.read(64):
                        got += piece
                        await asyncio.sleep(0.01)
                writer.close()
                if b"data: [DONE]" in got:
                    self.tally.complete += 1
                elif b'"error"' in got:
                    self.tally.errors += 1
                else:
                    self.tally.lose(f"{user}: slow stream ended without [DONE] or an error ({len(got)} bytes)")
            except (OSError, TimeoutError) as exc:
                self.tally.lose(f"{user}: slow client: {type(exc).__name__}: {exc}")
                sock.close()

    async def idle_pressure(self, count: int) -> None:
        """Keep ``count`` idle connections open (the router closes idle ones; they are reopened)."""
        host, port = self.router.removeprefix("http://").split(":")
        socks: list[socket.socket] = []
        try:
            while time.monotonic() < self.stop_at:
                socks = [s for s in socks if not _closed(s)]
                while len(socks) < count:
                    s = socket.socket()
                    s.setblocking(False)
                    try:
                        await asyncio.get_running_loop().sock_connect(s, (host, int(port)))
                    except OSError:
                        s.close()
                        break
                    socks.append(s)
                self.tally.idle_open = max(self.tally.idle_open, len(socks))
                await asyncio.sleep(0.5)
        finally:
            for s in socks:
                s.close()

    async def admin_probe(self, session: aiohttp.ClientSession) -> None:
        headers = {"Authorization": f"Bearer {self.token}"}
        while time.monotonic() < self.stop_at:
            t0 = time.monotonic()
            try:
                async with session.get(f"{self.admin}/api/v1/summary", headers=headers,
                                       timeout=aiohttp.ClientTimeout(total=10)) as r:
                    await r.read()
                    if r.status != 200:
                        raise aiohttp.ClientError(f"status {r.status}")
                self.tally.admin_ms.append((time.monotonic() - t0) * 1000)
            except (aiohttp.ClientError, TimeoutError):
                self.tally.admin_failures += 1
            await asyncio.sleep(0.25)

    async def kill_an_engine(self, after: float) -> None:
        """SIGKILL one engine half way: its streams are cut mid-answer and its new requests fail
        to connect, the cases where a router is tempted to send a request again."""
        await asyncio.sleep(after)
        for proc in Path("/proc").iterdir():
            try:
                argv = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            # The engine itself, not the bwrap that started it (argv[0] a python).
            if b"llmgw.engines.sim" in argv and b"--request-log" in argv and b"bwrap" not in argv[0]:
                pid = int(proc.name)
                # Stopped first, its log copied, then killed: the engine's area is made fresh when
                # it is started again, and the deliveries it logged must still be counted.
                os.kill(pid, signal.SIGSTOP)
                shutil.copyfile(proc / "cwd" / "requests.log", self.saved / "killed-engine.requests.log")
                os.kill(pid, signal.SIGKILL)
                self.tally.killed += 1
                return

    async def run(self, seconds: float, *, streams: int, whole: int, slow: int, idle: int,
                  fault: bool = False) -> None:
        self.stop_at = time.monotonic() + seconds
        rng = random.Random(len(self.prefix))
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=120, sock_read=60)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session, \
                aiohttp.ClientSession() as admin_session:
            await asyncio.gather(
                *(self.stream_client(session, random.Random(rng.random())) for _ in range(streams)),
                *(self.whole_client(session, random.Random(rng.random())) for _ in range(whole)),
                *(self.slow_client() for _ in range(slow)),
                self.idle_pressure(idle), self.admin_probe(admin_session),
                *([self.kill_an_engine(seconds / 2)] if fault else []))


def _closed(s: socket.socket) -> bool:
    try:
        return s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def deliveries(data_dir: Path, prefix: str) -> tuple[int, int, int]:
    """(most deliveries of one request to one engine, most in all, requests delivered at least once)."""
    per_engine: Counter[tuple[str, str]] = Counter()
    total: Counter[str] = Counter()
    for log in data_dir.rglob("*requests.log"):
        for line in log.read_text().splitlines():
            if line.startswith(prefix + "-"):
                per_engine[(str(log), line)] += 1
                total[line] += 1
    return max(per_engine.values(), default=0), max(total.values(), default=0), len(total)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a short soak (the whole run under a minute)")
    p.add_argument("--duration", type=float, default=None, help="seconds of soak (default 120, quick 15)")
    args = p.parse_args(argv)
    seconds = args.duration or (15.0 if args.quick else 120.0)
    warmup = 4.0 if args.quick else 20.0
    mix = {"streams": 60, "whole": 20, "slow": 8, "idle": 180} if args.quick else \
        {"streams": 150, "whole": 40, "slow": 16, "idle": 180}
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="llmgw-soak-"))
    router_port, admin_port = free_port(), free_port()
    router, admin = f"http://127.0.0.1:{router_port}", f"http://127.0.0.1:{admin_port}"
    data = tmp / "data"
    log = tmp / "up.log"
    with log.open("ab") as fh:
        proc = subprocess.Popen([LLMGW, "up", "--data-dir", str(data), "--catalog", str(make_catalog(tmp)),
                                 "--router-port", str(router_port), "--admin-port", str(admin_port)],
                                stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=limited,
                                start_new_session=True, env={**os.environ, "COLUMNS": "200"})
    try:
        deadline = time.monotonic() + 60
        while not (data / "admin.token").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        token = (data / "admin.token").read_text().strip()
        asyncio.run(wait_ready(admin, token, proc, 60))
        print(f"llmgw up ready in {time.monotonic() - started:.1f} s; warm-up {warmup:g} s", file=sys.stderr)
        warm = Tally()
        asyncio.run(Soak(router, admin, token, warm, "warm", tmp).run(warmup, **mix))
        time.sleep(1.0)
        rss_before = rss_kib(proc.pid)
        print(f"soak {seconds:g} s: {mix}", file=sys.stderr)
        tally = Tally()
        t0 = time.monotonic()
        asyncio.run(Soak(router, admin, token, tally, "soak", tmp).run(seconds, **mix, fault=True))
        soak_seconds = time.monotonic() - t0
        time.sleep(2.0)  # idle connections closed, handlers gone
        rss_after = rss_kib(proc.pid)
        per_engine, per_request, delivered = deliveries(tmp, "soak")
        log_bytes = log.stat().st_size
        alive = proc.poll() is None
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    growth = (rss_after - rss_before) / rss_before if rss_before else float("inf")
    admin_p99 = pct(tally.admin_ms, 0.99)
    met = (tally.lost == 0 and tally.killed == 1 and per_engine <= 1 and per_request <= 2 and growth <= 0.10 and alive
           and tally.admin_failures == 0 and admin_p99 < 1000 and proc.returncode == 0)
    for example in tally.lost_examples:
        print(f"lost: {example}", file=sys.stderr)
    if not alive:
        print(log.read_text()[-3000:], file=sys.stderr)
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"requests {tally.sent} in {soak_seconds:.1f} s: {tally.complete} complete, {tally.errors} errors answered, "
          f"{tally.left} left by their client, {tally.lost} lost (engines killed half way: {tally.killed}); "
          f"{delivered} reached an engine, most deliveries "
          f"of one request: {per_engine} per engine, {per_request} in all", file=sys.stderr)
    print(f"router RSS {rss_before / 1024:.1f} MiB before, {rss_after / 1024:.1f} MiB after ({growth:+.1%}); "
          f"admin p50 {statistics.median(tally.admin_ms) if tally.admin_ms else float('nan'):.1f} ms, "
          f"p99 {admin_p99:.1f} ms, {tally.admin_failures} failed; up to {tally.idle_open} idle connections held",
          file=sys.stderr)
    print(json.dumps({
        "bench": "soak", "quick": args.quick, "seconds": round(soak_seconds, 1), "mix": mix,
        "requests": tally.sent, "complete": tally.complete, "errors_answered": tally.errors,
        "left_by_client": tally.left, "lost": tally.lost, "delivered": delivered,
        "max_deliveries_per_engine": per_engine, "max_deliveries_per_request": per_request,
        "rss_before_mib": round(rss_before / 1024, 1), "rss_after_mib": round(rss_after / 1024, 1),
        "rss_growth": round(growth, 4),
        "admin_p50_ms": round(statistics.median(tally.admin_ms), 2) if tally.admin_ms else None,
        "admin_p99_ms": round(admin_p99, 2), "admin_failures": tally.admin_failures,
        "idle_connections": tally.idle_open, "engines_killed": tally.killed, "log_bytes": log_bytes,
        "fd_limit": FD_LIMIT,
        "clean_exit": proc.returncode == 0,
        "goal": "0 lost; <=1 delivery per engine, <=2 per request; RSS within 10%; admin p99 < 1 s, no failures",
        "met": met,
    }))
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
