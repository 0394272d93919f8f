"""Push → applied latency through the webhook, median of 20 pushes.

A real bare remote, a person's clone that pushes, the controller's follower with a long
poll interval (so only the webhook can make it fetch), and the webhook served by aiohttp
on loopback. Each round: commit + push, POST the signed webhook, wait until the sync
status shows the new sha. The time counted starts when `git push` returns — the moment a
git host would send its webhook. The peer is Argo CD's default: it polls every 3
minutes, so its expected push → applied latency without a webhook is ~90 s (half the
interval), which no run here can measure; it is reported as that constant.

    python bench/gitops_bench.py [--quick]

The last line is one JSON object (DESIGN §8); exit status 1 when the goal is not met. A push the
webhook refuses, or that is not applied within 30 s, ends the rounds: not met, whatever the
pushes before it measured.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llmgw.gitops import DesiredState, GitMirror, GitOpsFollower, Store  # noqa: E402
from llmgw.gitops.webhook import webhook_handler  # noqa: E402
from tests.catalog.corpus import SMALL, write_catalog  # noqa: E402

SECRET = "bench-secret"
ENV = {**os.environ, "GIT_AUTHOR_NAME": "Bench", "GIT_AUTHOR_EMAIL": "bench@example.com",
       "GIT_COMMITTER_NAME": "Bench", "GIT_COMMITTER_EMAIL": "bench@example.com"}


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, env=ENV, check=True, capture_output=True, text=True,
                          timeout=30).stdout.strip()


async def bench(rounds: int, tmp: Path) -> tuple[list[float], str | None]:
    """The latency of each push applied, and why the rounds stopped early (a push not applied
    within 30 s), or None when every push was applied."""
    bare, clone = tmp / "remote.git", tmp / "person"
    git(tmp, "init", "-q", "--bare", "-b", "main", str(bare))
    clone.mkdir()
    git(clone, "init", "-q", "-b", "main")
    git(clone, "remote", "add", "origin", str(bare))
    write_catalog(clone)
    git(clone, "add", "-A")
    git(clone, "commit", "-q", "-m", "init")
    git(clone, "push", "-q", "origin", "HEAD:main")

    store = Store(tmp / "data" / "state.db").open()
    follower = GitOpsFollower(GitMirror(str(bare), "main", tmp / "data" / "mirror.git"), DesiredState(), store,
                              interval=3600)
    runner: web.AppRunner | None = None
    latencies: list[float] = []
    try:
        await follower.start()
        app = web.Application()
        app.router.add_post("/hook", webhook_handler(SECRET, follower.trigger))
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}/hook"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            while follower.status.applied_sha is None:
                await asyncio.sleep(0.01)
            for i in range(rounds):
                (clone / "models" / f"m{i}.yaml").write_text(
                    SMALL.replace("name: small", f"name: m{i}").replace("[tiny]", f"[m{i}-alias]"))
                git(clone, "add", "-A")
                git(clone, "commit", "-q", "-m", f"add m{i}")
                git(clone, "push", "-q", "origin", "HEAD:main")
                sha = git(clone, "rev-parse", "HEAD")
                t0 = time.perf_counter()
                body = json.dumps({"ref": "refs/heads/main", "after": sha}).encode()
                sig = "sha256=" + hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()
                async with session.post(url, data=body, headers={"X-Hub-Signature-256": sig}) as r:
                    if r.status != 202:
                        return latencies, f"round {i}: the webhook answered {r.status}"
                while follower.status.applied_sha != sha:
                    if time.perf_counter() - t0 > 30:
                        return latencies, f"round {i}: not applied after 30 s ({follower.status})"
                    await asyncio.sleep(0.002)
                latencies.append(time.perf_counter() - t0)
        return latencies, None
    finally:
        if runner is not None:
            await runner.cleanup()
        await follower.close()
        store.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="10 pushes instead of 20 (under a minute)")
    args = parser.parse_args(argv)
    rounds = 10 if args.quick else 20
    with tempfile.TemporaryDirectory(prefix="llmgw-gitops-bench-") as tmp:
        lat, stopped = asyncio.run(bench(rounds, Path(tmp)))
    # A push never applied is not met: the figures are those of the pushes before it.
    median = statistics.median(lat) if lat else None
    argo_default_poll_s = 180.0
    report = {
        "bench": "gitops",
        "rounds": rounds,
        "applied": len(lat),
        "stopped": stopped,
        "push_to_applied_median_s": None if median is None else round(median, 4),
        "push_to_applied_p90_s": round(sorted(lat)[-(-len(lat) * 9 // 10) - 1], 4) if lat else None,
        "push_to_applied_max_s": round(max(lat), 4) if lat else None,
        "argocd_default_poll_interval_s": argo_default_poll_s,
        "argocd_expected_latency_without_webhook_s": argo_default_poll_s / 2,
        "goal": f"every push applied through the webhook, median push -> applied under 1 s (of {rounds})",
        "met": stopped is None and len(lat) == rounds and median is not None and median < 1.0,
    }
    if stopped is not None:
        print(f"stopped: {stopped}", file=sys.stderr)
    if median is not None:
        print(f"push → applied through the webhook: median {median * 1000:.0f} ms over {len(lat)} pushes")
    print(json.dumps(report))
    return 0 if report["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
