"""A llama.cpp worker (`rpc-server`) on a node: bound to the fabric address only, no files, and
a head that sends its layers only to the peers the node's owner lists.

The engine here stands in for rpc-server with the same flags (-H/--host, -p/--port): what is
checked is the agent's part. tests/e2e/test_multinode_llamacpp.py runs the real one.
"""

from __future__ import annotations

import socket
import sys
from dataclasses import replace

import pytest

from tests.agent.helpers import Node, make_entry, wait_for

# Listens where --host/--port say, like rpc-server, and writes nothing.
FAKE_RPC = (
    "import socket, sys, time; a = sys.argv[1:]; "
    "host = a[a.index('--host') + 1]; port = int(a[a.index('--port') + 1]); "
    "s = socket.socket(); s.bind((host, port)); s.listen(); print('listening', host, port, flush=True); "
    "time.sleep(120)"
)
WORKER_ARGS = ["--host", "{host}", "--port", "{port}"]


@pytest.fixture
def rpc_node(node: Node) -> Node:
    engines = {**node.settings["engines"], "rpc-server": [sys.executable, "-c", FAKE_RPC],
               "llama.cpp": [sys.executable, "-c", "import time; time.sleep(120)"]}
    # The fabric is a second address of the node; bind_address 0.0.0.0 must not reach a worker.
    node.write_config(engines=engines, fabric_address="127.0.0.1", bind_address="0.0.0.0",
                      rpc_peers=["127.0.0.0/24"])
    return node


def engine(node: Node, replica_id: str) -> dict:
    return next(e for e in node.ok("status")["engines"] if e["replica_id"] == replica_id)


def test_worker_listens_on_the_fabric_address_only_and_is_reported_listening(rpc_node: Node) -> None:
    started = rpc_node.ok("start", {"replica_id": "m-g1.r1", "engine": "rpc-server", "args": WORKER_ARGS})
    port = started["port"]
    low, high = rpc_node.ports
    assert low <= port <= high
    assert started["endpoint"] == f"tcp://127.0.0.1:{port}"  # not HTTP: the head's --rpc peer
    # Both in one look: the worker listens before it prints so.
    view = wait_for(lambda: (v := engine(rpc_node, "m-g1.r1"))["listening"]
                    and any(f"listening 127.0.0.1 {port}" in line for line in v["log_tail"]) and v)
    assert view["listening"] is True
    rpc_node.ok("stop", {"replica_id": "m-g1.r1", "grace_seconds": 2})
    assert engine(rpc_node, "m-g1.r1")["listening"] is False


@pytest.mark.parametrize(("args", "setting", "words"), [
    (["--host", "0.0.0.0", "--port", "{port}"], "fabric_address", "listens only on this node's fabric_address"),
    (["--host", "{host}", "--port", "1"], "port_range", "the port is the agent's choice"),
    ([*WORKER_ARGS, "-c"], "args", "'-c' is refused"),
    ([*WORKER_ARGS, "--cache"], "args", "'--cache' is refused"),
    ([*WORKER_ARGS, "--ctx-size", "2048"], "args", "'--ctx-size' is refused"),
    (["--port", "{port}"], "args", "needs --host {host} and --port {port}"),
    ([*WORKER_ARGS, "--threads", "1;sh"], "args", "is not a number"),
])
def test_worker_args_beyond_host_port_threads_device_are_refused(rpc_node: Node, args: list[str], setting: str,
                                                                 words: str) -> None:
    code, answer = rpc_node.run("start", {"replica_id": "w", "engine": "rpc-server", "args": args})
    assert code != 0 and answer.get("refused") == {"setting": setting}, answer
    assert words in answer["error"]
    assert not [e for e in rpc_node.ok("status")["engines"] if e["alive"]]


def test_worker_is_given_no_weights(rpc_node: Node) -> None:
    entry = make_entry(rpc_node.cache, "https://example.com/m.gguf")  # a complete entry the node holds
    code, answer = rpc_node.run("start", {"replica_id": "w", "engine": "rpc-server", "args": WORKER_ARGS,
                                          "weights": entry.name})
    assert code != 0 and answer.get("refused") == {"setting": "engines"}, answer
    assert "no files at all" in answer["error"]


def test_wildcard_fabric_address_is_a_config_error(rpc_node: Node) -> None:
    rpc_node.write_config(fabric_address="0.0.0.0")
    _, error = rpc_node.fail("status")
    assert "fabric_address must be one address of this node" in error


@pytest.mark.parametrize(("peers", "ok"), [
    ("127.0.0.2:50052,127.0.0.3:50052", True),
    ("127.0.0.2:50052,10.9.9.9:50052", False),
    ("evil.example:50052", False),
    ("[::1]:50052", False),
])
def test_head_sends_layers_only_to_rpc_peers(rpc_node: Node, peers: str, ok: bool) -> None:
    code, answer = rpc_node.run("start", {"replica_id": "h", "engine": "llama.cpp",
                                          "args": ["--host", "{host}", "--port", "{port}", "--rpc", peers]})
    if ok:
        assert code == 0, answer
        rpc_node.ok("stop", {"replica_id": "h", "grace_seconds": 2})
    else:
        assert code != 0 and answer.get("refused") == {"setting": "rpc_peers"}, answer
        assert "rpc_peers" in answer["error"]


def test_head_without_rpc_peers_is_refused_any_rpc(rpc_node: Node) -> None:
    rpc_node.write_config(rpc_peers=[])
    code, answer = rpc_node.run("start", {"replica_id": "h", "engine": "llama.cpp", "args": ["--rpc=127.0.0.2:1"]})
    assert code != 0 and "allowed: none" in answer["error"], answer


def test_fabric_placeholders_in_env_are_the_nodes_own(rpc_node: Node) -> None:
    rpc_node.write_config(env_allow=["LLMGW_TEST_VALUE"], fabric_interface="fab0")
    started = rpc_node.ok("start", {"replica_id": "e", "engine": "pyecho", "args": ["{fabric_address}"],
                                    "env": {"LLMGW_TEST_VALUE": "={fabric_interface}@{fabric_address}"}})
    wait_for(lambda: not engine(rpc_node, "e")["alive"])
    line = engine(rpc_node, "e")["log_tail"][-1]
    assert '"argv": ["127.0.0.1"]' in line and '"value": "=fab0@127.0.0.1"' in line, line
    assert started["endpoint"].startswith("http://")


def test_listening_is_read_for_the_fabric_address_and_port_alone(agent_module) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert agent_module.listening("127.0.0.1", port)
        # Another address on the same port (the worker's fabric address would be elsewhere) is not it.
        assert not agent_module.listening("127.0.0.2", port)
        assert not agent_module.listening("::1", port)
    assert not agent_module.listening("127.0.0.1", port)
    if socket.has_ipv6:
        with socket.socket(socket.AF_INET6) as s6:
            try:
                s6.bind(("::1", 0))
            except OSError:
                return  # no IPv6 loopback on this machine
            s6.listen()
            assert agent_module.listening("::1", s6.getsockname()[1])


def test_a_node_without_rpc_server_refuses_a_worker_naming_its_engines(node: Node) -> None:
    code, answer = node.run("start", {"replica_id": "w", "engine": "rpc-server", "args": WORKER_ARGS})
    # A refusal (the replica fails, backs off and stops its other shards), not a request error.
    assert code != 0 and answer.get("refused") == {"setting": "engines"}, answer
    assert "engine 'rpc-server' is not allowed on this node" in answer["error"]


def test_fabric_interface_is_found_from_the_fabric_address(agent_module, rpc_node: Node) -> None:
    cfg = agent_module.load_config(str(rpc_node.config))
    assert cfg.fabric_address == "127.0.0.1" and cfg.fabric_interface is None
    assert agent_module.fabric_interface(cfg) == "lo"  # the kernel's interface holding 127.0.0.1
    # An address no interface holds: refused, naming the setting that fixes it.
    with pytest.raises(agent_module.Refused, match="fabric_interface"):
        agent_module.fabric_interface(replace(cfg, fabric_address="192.0.2.77"))
