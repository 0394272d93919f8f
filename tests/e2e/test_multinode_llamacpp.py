"""One replica split across three nodes, on a real engine: llama.cpp's RPC, end to end.

Real parts only: three sshd nodes on loopback addresses, `llmgw controller` as a process,
`rpc-server` on two workers and `llama-server --rpc` on the head (both built from llama.cpp's
sources by scripts/build-llama-server), SmolLM2-135M, the openai client through the router. The
split replica answers what a single-node replica of the same weights answers at temperature 0;
a worker killed takes the whole replica down and it comes back as a whole; each rpc-server
listens on its node's fabric address and nowhere else (RPC has no authentication).
"""

from __future__ import annotations

import json
import os
import signal
import urllib.request
from pathlib import Path

import openai
import pytest

from tests.conftest import git
from tests.e2e.processes import free_port, start, stop, wait_for
from tests.e2e.test_llamacpp_fleet import BINARY, GGUF, requires_engine
from tests.fixtures.confinement import confined_settings

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # its waits allow 240 s for a replica (the default: 60)

TOKEN = "multinode-admin-token"
RPC = BINARY.parent / "rpc-server" if BINARY is not None else None
requires_rpc = pytest.mark.skipif(RPC is None or not RPC.exists(),
                                  reason="rpc-server is not built: run scripts/build-llama-server")
PROMPTS = ("Name a colour.", "What is two plus two?", "Write one word about the sea.")


def model_yaml(name: str, source: str, *, nodes: int) -> str:
    spread = f"    nodes: {nodes}\n    fabric: loopback\n" if nodes > 1 else ""
    return (f"name: {name}\nsource: {source}\nsize_gb: 0.2\nscaling: {{min: 1, max: 1}}\nprofiles:\n"
            f"  - name: cpu\n    engine: llama.cpp\n    gpus: 0\n    memory_gb: 1\n{spread}"
            '    args: ["--ctx-size", "1024", "--threads", "1"]\n')


def nodes_yaml(fleet) -> str:  # noqa: ANN001 - an SshdFleet
    lines = ["nodes:"]
    for i, n in enumerate(fleet, start=1):
        lines += [f"  - id: n{i}", f"    address: {n.host}", f"    port: {n.port}", "    user: root",
                  "    fabric: loopback", "    disk_gb: 100"]
    return "\n".join(lines) + "\n"


def admin(url: str, path: str):  # noqa: ANN201
    req = urllib.request.Request(url + path, headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def listeners(port: int) -> list[str]:
    """Local addresses with a socket listening on ``port``, from the kernel's own tables."""
    found = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for row in Path(table).read_text().splitlines()[1:]:
            fields = row.split()
            address, hexport = fields[1].rsplit(":", 1)
            if fields[3] == "0A" and int(hexport, 16) == port:
                assert len(address) == width
                raw = bytes.fromhex(address)
                if width == 8:
                    found.append(".".join(str(b) for b in reversed(raw)))
                else:
                    found.append(raw.hex())  # any IPv6 listener is already one too many
    return found


def rpc_pids(host: str) -> list[int]:
    """Live rpc-servers bound to ``host`` (never another test's: its address is this test's)."""
    out = []
    for d in Path("/proc").iterdir():
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if d.name.isdigit() and argv[0] == str(RPC).encode() and host.encode() in argv and state != "Z":
            out.append(int(d.name))
    return out


def resident_bytes(pid: int) -> int:
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def answers(client: openai.OpenAI, model: str) -> list[tuple[str, int]]:
    out = []
    for prompt in PROMPTS:
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                           max_tokens=24, temperature=0)
        out.append((r.choices[0].message.content or "", r.usage.completion_tokens if r.usage else -1))
    return out


@requires_engine
@requires_rpc
def test_llama_cpp_replica_split_across_three_nodes(sshd_fleet, tmp_path) -> None:
    confined = confined_settings()
    assert BINARY is not None and RPC is not None and GGUF is not None
    fleet = sshd_fleet(3, agent_extra={
        "engines": {"llama.cpp": str(BINARY), "rpc-server": str(RPC)},
        "sandbox_paths": [*confined["sandbox_paths"], str(BINARY.parents[1])],
        # Each node's fabric address is its advertised one (127.x.y.z); heads may send layers to the fleet.
        "rpc_peers": ["127.0.0.0/8"],
    })
    source = f"file://{GGUF}"
    repo = tmp_path / "catalog"
    (repo / "models").mkdir(parents=True)
    git(repo, "init", "-q", "-b", "main")
    (repo / "nodes.yaml").write_text(nodes_yaml(fleet))
    (repo / "models" / "smol-split.yaml").write_text(model_yaml("smol-split", source, nodes=3))
    (repo / "models" / "smol-one.yaml").write_text(model_yaml("smol-one", source, nodes=1))
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "SmolLM2 on one node and split across three")

    router_port, admin_port = free_port(), free_port()
    config = tmp_path / "controller.yaml"
    config.write_text(json.dumps({
        "repo": str(repo), "data_dir": str(tmp_path / "data"), "fetch_interval": "1s",
        "listen": {"router": f"127.0.0.1:{router_port}", "admin": f"127.0.0.1:{admin_port}"},
        "ssh": {"key": str(fleet.client_key), "known_hosts": str(fleet.known_hosts)},
        "admin_token": TOKEN, "reconciler": {"tick_interval": "300ms", "stop_grace": "5s", "backoff_base": "1s"},
    }))
    proc = start(["controller", "--config", str(config)], tmp_path / "controller.log")
    admin_url = f"http://127.0.0.1:{admin_port}"
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{router_port}/v1", api_key="unused", timeout=120,
                           max_retries=0)
    hosts = {f"n{i}": n.host for i, n in enumerate(fleet, start=1)}

    def split() -> dict | None:
        return next((r for r in admin(admin_url, "/api/v1/replicas") if r["model"] == "smol-split"), None)

    def both_ready() -> bool:
        reps = admin(admin_url, "/api/v1/replicas")
        return len(reps) == 2 and all(r["state"] == "ready" for r in reps)

    try:
        wait_for(both_ready, 240, "both replicas ready", proc)
        r = split()
        assert r is not None
        head, *workers = r["shards"]
        assert [s["rank"] for s in r["shards"]] == [0, 1, 2]
        assert len({s["node"] for s in r["shards"]}) == 3

        # Workers first, the head once both answered (its events say so, in that order).
        events = [e for e in admin(admin_url, "/api/v1/events") if e["subject"] == r["id"]]
        kinds = [e["kind"] for e in events]
        assert kinds.index("replica-starting") < kinds.index("replica-ready")
        starting = [e["message"] for e in events if e["kind"] == "replica-starting"]
        assert "workers started on" in starting[0] and "every worker answers; head started" in starting[1]

        # Each worker's rpc-server listens on its node's fabric address only, never a wildcard.
        for w in workers:
            assert w["endpoint"] == f"tcp://{hosts[w['node']]}:{w['port']}"
            assert listeners(w["port"]) == [hosts[w["node"]]], (w, listeners(w["port"]))
        # Only the head holds the weights: nothing was fetched onto the workers' nodes.
        nodes = {f"n{i}": n for i, n in enumerate(fleet, start=1)}
        bare = [w["node"] for w in workers if not _serves_one(admin_url, w["node"])]
        assert bare and all(list(nodes[n].cache_dir.iterdir()) == [] for n in bare), \
            {n: list(nodes[n].cache_dir.iterdir()) for n in bare}

        # The split replica answers what one node answers, token for token, at temperature 0.
        wait_for(lambda: {m.id for m in client.models.list().data if getattr(m, "ready", False)}
                 >= {"smol-split", "smol-one"}, 60, "the router lists both as ready", proc)
        one = answers(client, "smol-one")
        assert all(text.strip() for text, _ in one), one
        assert answers(client, "smol-split") == one
        # The workers hold the layers: an idle rpc-server is ~6 MB, each here holds part of the
        # ~94 MB of weights (seen: 55 and 80 MB), which the head sent them over RPC.
        for w in workers:
            [pid] = rpc_pids(hosts[w["node"]])
            assert resident_bytes(pid) > GGUF.stat().st_size // 4, (w, resident_bytes(pid))

        # A worker killed: the replica fails as a whole, every shard is stopped, and it serves again.
        victim = workers[-1]
        [pid] = rpc_pids(hosts[victim["node"]])
        seen = max(e["id"] for e in admin(admin_url, "/api/v1/events"))
        os.kill(pid, signal.SIGKILL)

        def after(kind: str) -> list[dict]:
            return [e for e in admin(admin_url, "/api/v1/events")
                    if e["id"] > seen and e["subject"] == r["id"] and e["kind"] == kind]

        wait_for(lambda: after("replica-failed"), 60, "the split replica failed", proc)
        [stopped] = wait_for(lambda: after("replica-shards-stopped"), 60, "every shard stopped", proc)
        assert stopped["message"].index(head["node"]) < stopped["message"].index(workers[0]["node"])
        wait_for(lambda: after("replica-ready"), 240, "the split replica ready again", proc)
        again = split()
        assert again is not None and again["id"] == r["id"] and again["state"] == "ready"
        assert all(s["pid"] not in (None, old["pid"]) for s, old in zip(again["shards"], r["shards"], strict=True))
        assert len(rpc_pids(hosts[victim["node"]])) == 1
        wait_for(lambda: any(m.id == "smol-split" and getattr(m, "ready", False) for m in client.models.list().data),
                 60, "the router lists smol-split as ready again", proc)
        assert answers(client, "smol-split") == one
    finally:
        stop(proc, signal.SIGTERM, timeout=30)


def _serves_one(admin_url: str, node: str) -> bool:
    """Whether the single-node replica runs on ``node`` (its weights are then there for it)."""
    return any(r["model"] == "smol-one" and r["shards"][0]["node"] == node
               for r in admin(admin_url, "/api/v1/replicas"))
