"""Real vLLM (scripts/build-vllm-cpu's build), started by the agent as a node runs it (the engine
user, bubblewrap), asked by a start request to publish its KV-cache events to a machine the
request names (127.0.0.2 here: neither the node's fabric address nor in any rpc_peers). vLLM's
ZmqEventPublisher connects there and sends BlockStored events carrying the token ids of every
prompt it caches: every tenant's prompts would leave the node. The agent refuses the flag; should
it ever start such a vLLM again, the test serves a completion and listens for what leaks."""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.request

import pytest

from tests.agent.conftest import node  # noqa: F401 - the agent's local node fixture, used as a parameter
from tests.agent.helpers import Node
from tests.fixtures.vllm import BUILD, one_vllm_at_a_time, requires_vllm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), requires_vllm, one_vllm_at_a_time]


SUB = """\
import sys, zmq
ctx = zmq.Context(); s = ctx.socket(zmq.SUB); s.setsockopt(zmq.SUBSCRIBE, b""); s.bind(sys.argv[1])
print("BOUND", flush=True)
parts = s.recv_multipart()
print("GOT", len(parts), sum(len(p) for p in parts), flush=True)
"""


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def test_real_vllm_in_the_sandbox_does_not_publish_prompt_tokens_to_another_machine(node: Node) -> None:  # noqa: F811
    assert BUILD is not None
    node.write_config(engines={"vllm": [str(BUILD / "bin" / "vllm")]},
                      sandbox_paths=[*node.settings["sandbox_paths"], str(BUILD)],
                      model_dirs=[*node.settings["model_dirs"], str(BUILD / "model")],
                      engine_env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    port = _free_port("127.0.0.2")
    sub = subprocess.Popen([str(BUILD / "venv" / "bin" / "python"), "-c", SUB, f"tcp://127.0.0.2:{port}"],
                           stdout=subprocess.PIPE, text=True)
    # The agent's PATH is the engine's: vLLM's CPU worker runs lscpu (an sshd login has /usr/bin).
    env = node.env(PATH=f"{node.bin}:/usr/local/bin:/usr/bin:/bin")
    try:
        assert sub.stdout is not None and sub.stdout.readline().startswith("BOUND")
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.2:{port}"}
        code, answer = node.run("start", env=env, request={
            "replica_id": "kvleak", "engine": "vllm", "weights": str(BUILD / "model"),
            "args": ["serve", "{weights}", "--served-model-name", "smol", "--host", "{host}", "--port", "{port}",
                     "--enforce-eager", "--max-model-len", "1024", "--max-num-seqs", "2",
                     "--kv-events-config", json.dumps(events)]})
        if code != 0:
            # Refused before anything ran, naming the flag: what the node boundary does.
            assert answer.get("refused") == {"setting": "args"} and "--kv-events-config" in answer["error"], answer
            return
        endpoint = answer["endpoint"]
        log = node.state / "logs" / "engines" / "kvleak.log"
        deadline = time.monotonic() + 600  # not a timing assertion: a bound on a hung load
        while True:
            try:
                with urllib.request.urlopen(endpoint + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            ended = (node.state / "exits" / "kvleak.json").exists()
            assert time.monotonic() < deadline and not ended, log.read_text()[-3000:]
            time.sleep(1)
        # ~400 tokens: whole KV blocks (128 on CPU), under --max-model-len.
        prompt = "Handbook. " + " ".join(f"secret{i}" for i in range(120))
        req = urllib.request.Request(endpoint + "/v1/completions", method="POST", headers={
            "Content-Type": "application/json"}, data=json.dumps({"model": "smol", "prompt": prompt,
                                                                   "max_tokens": 1}).encode())
        with urllib.request.urlopen(req, timeout=120) as r:
            r.read()
        try:
            out, _ = sub.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            out = ""
        assert "GOT" not in out, f"the confined vLLM published its KV events (prompt token ids) to 127.0.0.2: {out}"
    finally:
        node.run("stop", {"replica_id": "kvleak", "grace_seconds": 5}, env=env)
        sub.kill()
        sub.communicate()  # reaps it and closes its stdout
