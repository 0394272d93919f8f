"""Requests per second the engine simulator carries at zero latency, against bare aiohttp.

Router benchmarks put the simulator behind llmgw; they measure the router only if the simulator
is never the bottleneck. This runs ``python -m llmgw.engines.sim`` with no ttft and no pacing,
drives it with an aiohttp load generator at concurrency 32 (keep-alive), and in the same run
drives a bare aiohttp server answering a constant JSON body (the peer: the floor of the HTTP
stack both stand on). Figures: non-streamed chat, streamed chat (16 tokens, SSE), bare.
Goal: the simulator keeps at least half of bare aiohttp's rate on non-streamed chat.

    python bench/sim_bench.py [--quick] [--seconds S] [--concurrency N]

The last line of output is one JSON object (DESIGN §8).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from llmgw.engines.testing import SimProcess, free_port  # noqa: E402

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


async def drive(url: str, body: dict, *, seconds: float, concurrency: int) -> tuple[int, int]:
    """(completed requests, errors) over ``seconds`` with ``concurrency`` keep-alive workers."""
    payload = json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    done = errors = 0
    stop_at = time.monotonic() + seconds
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        async def worker() -> None:
            nonlocal done, errors
            while time.monotonic() < stop_at:
                async with session.post(url, data=payload, headers=headers) as resp:
                    await resp.read()
                    if resp.status == 200:
                        done += 1
                    else:
                        errors += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done, errors


def measure(url: str, body: dict, *, seconds: float, concurrency: int) -> tuple[float, int]:
    asyncio.run(drive(url, body, seconds=0.5, concurrency=concurrency))  # warm up connections and caches
    done, errors = asyncio.run(drive(url, body, seconds=seconds, concurrency=concurrency))
    return done / seconds, errors


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 s per figure instead of 10")
    parser.add_argument("--seconds", type=float, default=None)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    seconds = args.seconds or (3.0 if args.quick else 10.0)
    c = args.concurrency

    with SimProcess("bench") as sim:
        url = sim.endpoint + "/v1/chat/completions"
        chat_rps, chat_err = measure(url, CHAT, seconds=seconds, concurrency=c)
        print(f"sim chat (non-streamed, 16 tokens): {chat_rps:9.0f} req/s  errors={chat_err}")
        stream_rps, stream_err = measure(url, {**CHAT, "stream": True}, seconds=seconds, concurrency=c)
        print(f"sim chat (SSE, 16 chunks):          {stream_rps:9.0f} req/s  errors={stream_err}")

    port = free_port()
    bare = subprocess.Popen([sys.executable, "-c", BARE, str(port)], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                asyncio.run(drive(f"http://127.0.0.1:{port}/v1/chat/completions", CHAT, seconds=0.01,
                                  concurrency=1))
                break
            except aiohttp.ClientConnectionError:
                time.sleep(0.05)
        bare_rps, bare_err = measure(f"http://127.0.0.1:{port}/v1/chat/completions", CHAT, seconds=seconds,
                                     concurrency=c)
        print(f"bare aiohttp (constant body):       {bare_rps:9.0f} req/s  errors={bare_err}")
    finally:
        bare.terminate()
        bare.wait(10)

    ratio = chat_rps / bare_rps if bare_rps else 0.0
    print(json.dumps({
        "bench": "sim", "metric": round(chat_rps), "unit": "req/s",
        "sim_chat_rps": round(chat_rps), "sim_stream_rps": round(stream_rps), "bare_aiohttp_rps": round(bare_rps),
        "sim_vs_bare": round(ratio, 3), "errors": chat_err + stream_err + bare_err,
        "concurrency": c, "seconds": seconds,
        "goal": "non-streamed sim chat >= 0.5x bare aiohttp at concurrency 32",
        "met": ratio >= 0.5 and chat_err + stream_err == 0,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
