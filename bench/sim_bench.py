"""Requests per second the engine simulator carries at zero latency, against bare aiohttp.

Router benchmarks put the simulator behind llmgw; they measure the router only if the simulator
is never the bottleneck. This runs ``python -m llmgw.engines.sim`` with no ttft and no pacing and,
in the same run, a bare aiohttp server answering a constant JSON body (the peer: the floor of the
HTTP stack both stand on), each pinned to core 0, and drives them with wrk (the load generator
bench/router_bench.py uses) on core 1 at concurrency 32 over keep-alive connections, with the same
request body. Figures: non-streamed chat, streamed chat (16 tokens, SSE), bare.

Both servers are up and warmed alike before the first round; each round measures the three in an
order rotated by one per round, so none is always first on a box whose load moves. Figures are
medians over rounds; the ratio is the median of per-round ratios. (A Python load generator, as
this bench had before, tops out near these servers' rate and makes any ratio look like 1.)
Goal: the simulator keeps at least half of bare aiohttp's rate on non-streamed chat.

    python bench/sim_bench.py [--quick] [--seconds S] [--rounds N] [--concurrency N]

The last line of output is one JSON object (DESIGN §8); exit status 1 when the goal is not met.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from llmgw.engines.testing import SimProcess, free_port  # noqa: E402

SERVER_CORE, LOAD_CORE = 0, 1

BARE = """
import sys
from aiohttp import web
BODY = b'{"id":"x","object":"chat.completion","choices":[]}'
async def h(_r):
    return web.Response(body=BODY, content_type="application/json")
app = web.Application()
app.router.add_post("/v1/chat/completions", h)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None)
"""

CHAT = {"model": "bench", "messages": [{"role": "user", "content": "Benchmark me"}], "max_tokens": 16}


def script(tmp: Path, name: str, body: dict) -> Path:
    path = tmp / f"{name}.lua"
    path.write_text('wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
                    f"wrk.body = {json.dumps(json.dumps(body))}\n")
    return path


def wrk(url: str, lua: Path, *, seconds: float, concurrency: int) -> tuple[float, int]:
    """(requests/s, non-2xx answers and socket errors) of one wrk run."""
    out = subprocess.run(["taskset", "-c", str(LOAD_CORE), "wrk", "-t1", f"-c{concurrency}",
                          f"-d{max(1, round(seconds))}s", "-s", str(lua), url],
                         capture_output=True, text=True, timeout=seconds + 60, check=True).stdout
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    if rps is None:
        raise RuntimeError(f"wrk printed no rate: {out[-500:]}")
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    return float(rps.group(1)), (int(non2xx.group(1)) if non2xx else 0) + (
        sum(int(x) for x in sock.groups()) if sock else 0)


def wait_listening(port: int, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"bare aiohttp exited ({proc.returncode})")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"bare aiohttp did not listen on {port} within {timeout} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds of 1 s per figure (instead of 5 of 5 s)")
    parser.add_argument("--seconds", type=float, default=None, help="seconds per figure and round")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args(argv)
    if shutil.which("wrk") is None or shutil.which("taskset") is None:
        # Still the one JSON line a caller reads (DESIGN §8): nothing measured is not met.
        print("wrk and taskset are needed: apt-get install -y wrk util-linux", file=sys.stderr)
        print(json.dumps({"bench": "sim", "goal": "non-streamed sim chat >= 0.5x bare aiohttp at concurrency 32, "
                          "no errors", "not_measured": ["sim_vs_bare: wrk or taskset is missing"], "met": False}))
        return 1
    seconds = args.seconds or (1.0 if args.quick else 5.0)
    rounds = args.rounds or (3 if args.quick else 5)
    c = args.concurrency
    os.sched_setaffinity(0, {LOAD_CORE})
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="llmgw-sim-bench-") as tmpdir, SimProcess("bench") as sim:
        tmp = Path(tmpdir)
        bare = subprocess.Popen([sys.executable, "-c", BARE, str(port)], stdout=subprocess.DEVNULL)
        try:
            os.sched_setaffinity(sim.pid, {SERVER_CORE})
            os.sched_setaffinity(bare.pid, {SERVER_CORE})
            wait_listening(port, bare, 10)
            targets = {"sim_chat": (sim.endpoint, script(tmp, "chat", CHAT)),
                       "sim_stream": (sim.endpoint, script(tmp, "stream", {**CHAT, "stream": True})),
                       "bare_aiohttp": (f"http://127.0.0.1:{port}", script(tmp, "bare", CHAT))}
            for base, lua in targets.values():  # the same warm-up for each
                wrk(base + "/v1/chat/completions", lua, seconds=1, concurrency=c)
            rps: dict[str, list[float]] = {name: [] for name in targets}
            errors = dict.fromkeys(targets, 0)
            names = list(targets)
            for r in range(rounds):
                for name in names[r % len(names):] + names[:r % len(names)]:
                    base, lua = targets[name]
                    rate, errs = wrk(base + "/v1/chat/completions", lua, seconds=seconds, concurrency=c)
                    rps[name].append(round(rate, 1))
                    errors[name] += errs
        finally:
            bare.terminate()
            bare.wait(10)

    med = {name: statistics.median(values) for name, values in rps.items()}
    # A round where bare served nothing has no ratio, and then the ratio is not measured (leaving the
    # round out would let the others decide).
    per_round = [a / b if b else None for a, b in zip(rps["sim_chat"], rps["bare_aiohttp"], strict=True)]
    ratio = statistics.median(r for r in per_round if r is not None) if None not in per_round else None
    print(f"sim chat (non-streamed, 16 tokens): {med['sim_chat']:9.0f} req/s  rounds {rps['sim_chat']}")
    print(f"sim chat (SSE, 16 chunks):          {med['sim_stream']:9.0f} req/s  rounds {rps['sim_stream']}")
    print(f"bare aiohttp (constant body):       {med['bare_aiohttp']:9.0f} req/s  rounds {rps['bare_aiohttp']}")
    report = {
        "bench": "sim", "metric": round(med["sim_chat"]), "unit": "req/s", "load_generator": "wrk",
        "rounds": rounds, "seconds": seconds, "concurrency": c,
        "statistic": "median over rounds (order rotated each round); ratio: median of per-round ratios",
        "sim_chat_rps": round(med["sim_chat"]), "sim_stream_rps": round(med["sim_stream"]),
        "bare_aiohttp_rps": round(med["bare_aiohttp"]), "sim_vs_bare": None if ratio is None else round(ratio, 3),
        "sim_vs_bare_rounds": [None if r is None else round(r, 3) for r in per_round],
        "errors": errors,
        "goal": "non-streamed sim chat >= 0.5x bare aiohttp at concurrency 32, no errors",
        "met": ratio is not None and ratio >= 0.5 and not any(errors.values()),
    }
    print(json.dumps(report))
    return 0 if report["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
