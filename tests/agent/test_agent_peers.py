"""The peers a node's engines exchange with across nodes, and the address its workers listen on:
what the node's owner lists (rpc_peers, fabric_address) and nothing a request can widen.

Adversarial review of issue 27 (llama.cpp RPC multi-node); each section says what it found.
Real parts: the agent as a subprocess with a JSON request, the real llama-server and rpc-server
built by scripts/build-llama-server in the project's confinement (bubblewrap, nobody), SmolLM2,
listening sockets standing in for an attacker's peer. Where the engine is an argv echo, what is
checked is whether the agent starts it at all.
"""

from __future__ import annotations

import ipaddress
import json
import random
import socket
import sys
import threading
import urllib.request
from pathlib import Path
from types import ModuleType

import pytest

from tests.agent.helpers import ECHO_ENGINE, Node, wait_for
from tests.e2e.test_llamacpp_fleet import BINARY, GGUF
from tests.e2e.test_multinode_llamacpp import listeners
from tests.fixtures.confinement import confined_settings

# Finding: fabric_address is checked against a deny-list of spellings (0.0.0.0, ::, *, ...), not
# parsed as an address. rpc-server binds with inet_addr(), which reads "0", "0.0", "0x0" and
# "000.0.0.0" as INADDR_ANY: a node config with such a fabric_address loads, the agent starts the
# real rpc-server with --host <that>, and it listens on every interface (RPC has no
# authentication). DESIGN §5/issue 27: "bound only to the node's fabric address (never 0.0.0.0)".
#
# Real parts: the agent as a subprocess with a JSON request, the real rpc-server built by
# scripts/build-llama-server, bubblewrap/nobody confinement as the project's tests use it.
requires_engine = pytest.mark.skipif(BINARY is None, reason="llama-server is not built")
requires_model = pytest.mark.skipif(BINARY is None or GGUF is None, reason="llama-server or SmolLM2 missing")
RPC = BINARY.parent / "rpc-server" if BINARY is not None else None
requires_rpc = pytest.mark.skipif(RPC is None or not RPC.exists(), reason="rpc-server is not built")
WORKER_ARGS = ["--host", "{host}", "--port", "{port}"]


def engine(node: Node, replica_id: str) -> dict:
    return next(e for e in node.ok("status")["engines"] if e["replica_id"] == replica_id)


@requires_rpc
@pytest.mark.parametrize("spelling", ["0", "0.0", "0x0", "000.0.0.0"])
def test_a_wildcard_spelled_otherwise_never_puts_rpc_server_on_every_interface(node: Node, spelling: str) -> None:
    assert RPC is not None
    confined = confined_settings()
    node.write_config(engines={**node.settings["engines"], "rpc-server": str(RPC)},
                      sandbox_paths=[*confined["sandbox_paths"], str(Path(RPC).parents[1])],
                      fabric_address=spelling)
    code, answer = node.run("status")
    if code != 0:
        # What the node boundary should do: the config is refused, naming fabric_address.
        assert "fabric_address" in answer["error"], answer
        return
    started = node.ok("start", {"replica_id": "w", "engine": "rpc-server", "args": WORKER_ARGS})
    port = started["port"]
    try:
        wait_for(lambda: listeners(port) or not engine(node, "w")["alive"], timeout=20)
        bound = listeners(port)
    finally:
        node.ok("stop", {"replica_id": "w", "grace_seconds": 2})
    assert "0.0.0.0" not in bound, (
        f"fabric_address {spelling!r} was accepted and rpc-server listens on {bound} (every interface)")


@requires_rpc
@pytest.mark.parametrize("address", ["::1", "fabric.invalid"])
def test_a_fabric_address_rpc_server_cannot_bind_is_refused_not_crash_looped(node: Node, address: str) -> None:
    """Finding (operator): rpc-server binds with inet_addr() (IPv4 dotted only) and llama-server's
    --rpc parses host:port at the first colon, yet the agent takes any fabric_address (an IPv6
    address, a hostname; advertise_address when unset, which is often a hostname). The worker is
    started, exits at once ("Failed to create server socket"), and the replica fails and restarts
    with backoff forever instead of the node saying what is wrong."""
    assert RPC is not None
    confined = confined_settings()
    node.write_config(engines={**node.settings["engines"], "rpc-server": str(RPC)},
                      sandbox_paths=[*confined["sandbox_paths"], str(Path(RPC).parents[1])],
                      fabric_address=address)
    code, answer = node.run("status")
    if code != 0:
        assert "fabric_address" in answer["error"], answer
        return
    code, answer = node.run("start", {"replica_id": "w", "engine": "rpc-server", "args": WORKER_ARGS})
    if code != 0:
        assert "fabric_address" in answer["error"], answer
        return
    try:
        wait_for(lambda: engine(node, "w")["listening"] or not engine(node, "w")["alive"], timeout=20)
        view = engine(node, "w")
    finally:
        node.ok("stop", {"replica_id": "w", "grace_seconds": 2})
    assert view["listening"], f"fabric_address {address!r} accepted; the worker exited: {view['log_tail'][-3:]}"


# Finding: the agent reads an --rpc item as host:port at the LAST colon (rpartition) and checks
# the host as an IP address; llama.cpp (ggml-rpc.cpp parse_endpoint) splits at the FIRST colon,
# reads the port with stoi (ignoring what follows) and resolves the host with gethostbyname. With
# an IPv6 network in rpc_peers (the agent accepts them, its listening check is IPv4 and IPv6), an
# item such as "0:7311::5:50052" passes as the allowed IPv6 address 0:7311::5 while llama-server
# connects to host "0" (0.0.0.0: this machine) port 7311; with fdXX networks the host part is a
# name (fd12, cafe...) looked up in DNS. The check and the use must parse alike (or the item must
# be refused unless it is IPv4 a.b.c.d:port, the only form this llama.cpp can use).
#
# Real parts: the agent as a subprocess, the real llama-server (confined), a listening socket.


def listening_on_a_four_digit_port() -> socket.socket:
    """A socket listening on 127.0.0.1 at a free port of at most four digits: the port is written
    into an IPv6 group below (decimal for llama.cpp, hex for the agent), which holds four digits at
    most, so the kernel's choice (port 0, five digits) cannot serve. Never a skip: ports are tried
    until one is free."""
    rng = random.Random()
    for port in rng.sample(range(1024, 10000), 500):
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind(("127.0.0.1", port))
        except OSError:
            listener.close()
            continue
        listener.listen()
        return listener
    raise AssertionError("no free port between 1024 and 9999 in 500 tries")


@pytest.mark.slow
@requires_engine
def test_an_allowed_looking_ipv6_rpc_item_does_not_reach_another_address(node: Node) -> None:
    assert BINARY is not None
    listener = listening_on_a_four_digit_port()
    port = listener.getsockname()[1]
    listener.settimeout(30)
    confined = confined_settings()
    node.write_config(engines={**node.settings["engines"], "llama.cpp": str(BINARY)},
                      sandbox_paths=[*confined["sandbox_paths"], str(Path(BINARY).parents[1])],
                      rpc_peers=[f"0:{port}::/32"], fabric_address="127.0.0.1")
    connected: list[tuple[str, int]] = []

    def accept_one() -> None:
        try:
            conn, peer = listener.accept()
        except OSError:
            return
        conn.close()
        connected.append(peer)

    watcher = threading.Thread(target=accept_one, daemon=True)
    watcher.start()
    item = f"0:{port}::5:50052"  # the agent: [0:{port}::5]:50052; llama.cpp: host "0", port {port}
    code, answer = node.run("start", {"replica_id": "h", "engine": "llama.cpp",
                                      "args": ["--host", "{host}", "--port", "{port}", "--rpc", item]})
    try:
        if code != 0:
            assert answer.get("refused") == {"setting": "rpc_peers"}, answer
            return
        watcher.join(timeout=30)  # the head connects while it parses its arguments, or never
    finally:
        if code == 0:
            node.ok("stop", {"replica_id": "h", "grace_seconds": 2})
        listener.close()
    assert not connected, (f"--rpc {item} passed rpc_peers 0:{port}::/32, and llama-server connected "
                           f"to 127.0.0.1:{port} (host '0', port {port}) from {connected}")


# Finding: the peer check of issue 27 covers llama.cpp's --rpc only. A vLLM rank's --master-addr
# and an SGLang rank's --dist-init-addr name the machine every rank of the replica joins (torch
# distributed rendezvous and collectives, vLLM's pickled message queues): a tampered controller or a
# merged catalog commit points a node's rank at a machine of its own, which then receives the
# node's activations and drives what the rank runs. The agent starts it without looking; the same
# node's rpc_peers refuses the llama.cpp equivalent (--rpc 10.9.9.9:...).
#
# Real parts: the agent as a subprocess; the engine is the node's executable for the vllm/sglang
# engine names (an argv echo: what is checked is whether the agent starts it at all).
@pytest.mark.parametrize(("engine", "args"), [
    ("vllm", ["serve", "m", "--headless", "--nnodes", "2", "--node-rank", "1",
              "--master-addr", "10.9.9.9", "--master-port", "29501"]),
    ("vllm", ["serve", "m", "--headless", "--nnodes=2", "--node-rank=1", "--master-addr=10.9.9.9"]),
    ("sglang", ["-m", "sglang.launch_server", "--nnodes", "2", "--node-rank", "1",
                "--dist-init-addr", "10.9.9.9:5000"]),
])
def test_a_rank_joins_only_peers_the_node_lists(node: Node, engine: str, args: list[str]) -> None:
    node.write_config(engines={**node.settings["engines"], engine: [sys.executable, "-c", ECHO_ENGINE]},
                      fabric_address="127.0.0.1", rpc_peers=["127.0.0.0/24"])
    # The llama.cpp form of the same thing is refused on this node:
    node.write_config(engines={**node.settings["engines"], "llama.cpp": [sys.executable, "-c", ECHO_ENGINE]})
    code, answer = node.run("start", {"replica_id": "h", "engine": "llama.cpp", "args": ["--rpc", "10.9.9.9:1"]})
    assert code != 0 and answer.get("refused") == {"setting": "rpc_peers"}, answer

    code, answer = node.run("start", {"replica_id": "r1", "engine": engine, "args": args})
    if code == 0:
        node.ok("stop", {"replica_id": "r1", "grace_seconds": 2})
    assert code != 0 and answer.get("refused"), (
        f"{engine} rank started with its rendezvous at 10.9.9.9, outside the node's peers 127.0.0.0/24: {answer}")


# Finding: rpc_peers is walked around with llama-server's router mode. The agent checks a head's
# `--rpc` against the node's rpc_peers, but lets `--models-preset FILE` through as a mere read
# inside the weights entry. That INI file is llama-server arguments for the model instances the
# router spawns (`rpc = host:port`, and every other flag), and its content is whatever the catalog's
# source is: a merged catalog commit points a head at an rpc-server of its own (the head then sends
# it the model's layers and trusts what it computes), which rpc_peers exists to prevent (issue 27).
#
# Real parts: the agent as a subprocess (fetch, then start), the real llama-server built by
# scripts/build-llama-server in the project's confinement (bubblewrap, nobody), SmolLM2, and a
# listening socket standing in for the attacker's rpc-server at an address outside rpc_peers.
ATTACKER = "127.0.1.5"  # loopback, but outside the node's rpc_peers 127.0.0.0/24


def ask(port: int) -> None:
    """One chat request for the preset's model: the router spawns its instance to answer it."""
    body = json.dumps({"model": "smol", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            r.read()
    except OSError:
        pass  # the instance fails once the fake peer hangs up: the connection is what counts


@pytest.mark.slow
@pytest.mark.timeout(240)
@requires_model
def test_a_head_cannot_reach_an_rpc_peer_outside_rpc_peers_through_a_models_preset(node: Node,
                                                                                   tmp_path: Path) -> None:
    assert BINARY is not None and GGUF is not None
    confined = confined_settings()
    node.write_config(engines={**node.settings["engines"], "llama.cpp": str(BINARY)},
                      sandbox_paths=[*confined["sandbox_paths"], str(Path(BINARY).parents[1])],
                      rpc_peers=["127.0.0.0/24"], fabric_address="127.0.0.1")
    # The direct form is refused: the boundary this test holds the other form to.
    code, answer = node.run("start", {"replica_id": "h0", "engine": "llama.cpp",
                                      "args": ["--rpc", f"{ATTACKER}:50052"]})
    assert code != 0 and answer.get("refused") == {"setting": "rpc_peers"}, answer

    attacker = socket.socket()
    attacker.bind((ATTACKER, 0))
    attacker.listen()
    attacker.settimeout(90)
    # The catalog's source: an INI file (what a merged commit can name as a model's source).
    source_dir = tmp_path / "src"
    source_dir.mkdir()
    (source_dir / "preset.ini").write_text(
        f"[smol]\nmodel = {GGUF}\nrpc = {ATTACKER}:{attacker.getsockname()[1]}\n")
    fetched = node.fetch_until_done(f"file://{source_dir / 'preset.ini'}")
    started = node.run("start", {"replica_id": "h", "engine": "llama.cpp", "weights": fetched["name"],
                                 "args": ["--host", "{host}", "--port", "{port}", "--threads", "1",
                                          "--models-preset", "{weights}/preset.ini"]})
    code, answer = started
    if code != 0:
        # What the node boundary should do: refuse, naming what.
        attacker.close()
        assert "models-preset" in answer["error"], answer
        return
    port = answer["port"]
    connected: list[tuple[str, int]] = []
    try:
        def head_up() -> bool:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    return True
            except OSError:
                return False

        wait_for(head_up, timeout=60)

        def accept_one() -> None:
            try:
                conn, peer = attacker.accept()
            except OSError:
                return  # nothing came (what the boundary should give)
            conn.close()  # the spawned instance fails at once: nothing is left hanging
            connected.append(peer)

        watcher = threading.Thread(target=accept_one, daemon=True)
        watcher.start()
        ask(port)  # the router spawns the instance and answers (an error) once it has failed
        watcher.join(timeout=10)
    finally:
        node.ok("stop", {"replica_id": "h", "grace_seconds": 2})
        attacker.close()
    assert not connected, (f"the head (--models-preset from its weights) connected to {ATTACKER}, outside "
                           f"rpc_peers 127.0.0.0/24, from {connected}")


# The rest of the class (the fixes of the findings above, each rule in every spelling).
PEERS = ("127.0.0.0/24",)
OWN = "10.1.0.7"  # the node's own fabric address: a rank 0's --master-addr is its own


def check(agent_module: ModuleType, kind: str, args: list[str]) -> None:
    agent_module.check_args(kind, args, area="/nonexistent/area", read_roots=(),
                            rpc_peers=tuple(ipaddress.ip_network(p) for p in PEERS), fabric_address=OWN)


@pytest.mark.parametrize(("kind", "args"), [
    ("llama.cpp", ["--rpc", "127.0.0.2:50052,127.0.0.3:50052"]),
    ("llama.cpp", [f"--rpc={OWN}:50052"]),
    ("vllm", ["--master-addr", "127.0.0.2", "--master-port", "29501"]),
    ("vllm", ["--master-addr", OWN]),
    ("vllm", ["-dpa", "127.0.0.9"]),
    ("sglang", ["--dist-init-addr", "127.0.0.2:5000"]),
])
def test_peers_the_node_lists_or_its_own_fabric_address_are_let_through(agent_module: ModuleType, kind: str,
                                                                        args: list[str]) -> None:
    check(agent_module, kind, args)


@pytest.mark.parametrize(("kind", "args"), [
    # llama.cpp reads host:port at the first colon (stoi, gethostbyname): only a.b.c.d:port is read alike.
    ("llama.cpp", ["--rpc", "127.0.0.2:50052x"]), ("llama.cpp", ["--rpc", "127.0.0.2:0"]),
    ("llama.cpp", ["--rpc", "127.0.0.2:65536"]), ("llama.cpp", ["--rpc", "127.1:50052"]),
    ("llama.cpp", ["--rpc", "0177.0.0.2:50052"]), ("llama.cpp", ["--rpc", "127.0.0.2:50052,"]),
    ("llama.cpp", ["--rpc", " 127.0.0.2:50052"]), ("llama.cpp", ["--rpc", "127.0.0.2"]),
    ("llama.cpp", ["--rpc", "[::ffff:127.0.0.2]:50052"]), ("llama.cpp", ["--rpc", "localhost:50052"]),
    # vLLM: every argparse spelling of --master-addr and --data-parallel-address.
    ("vllm", ["--master-addr", "10.9.9.9"]), ("vllm", ["--master_addr=10.9.9.9"]),
    ("vllm", ["--master-a", "10.9.9.9"]), ("vllm", ["--data-parallel-address", "10.9.9.9"]),
    ("vllm", ["-dpa10.9.9.9"]), ("vllm", ["--master-addr", "evil.example"]), ("vllm", ["--master-addr"]),
    # SGLang: its two names, a host it would resolve, a port it would not read.
    ("sglang", ["--dist-init-addr", "10.9.9.9:5000"]), ("sglang", ["--nccl-init-addr", "10.9.9.9:5000"]),
    ("sglang", ["--dist-init", "10.9.9.9:5000"]), ("sglang", ["--dist-init-addr", "sgl-0:5000"]),
    ("sglang", ["--dist-init-addr", "[::1]:5000"]), ("sglang", ["--dist-init-addr=127.0.0.2:5000:1"]),
])
def test_a_peer_outside_rpc_peers_or_read_otherwise_by_its_engine_is_refused(agent_module: ModuleType, kind: str,
                                                                            args: list[str]) -> None:
    with pytest.raises(agent_module.Refused) as refused:
        check(agent_module, kind, args)
    assert refused.value.setting == "rpc_peers" and "rpc_peers" in str(refused.value)


@pytest.mark.parametrize(("kind", "args"), [
    ("llama.cpp", ["--models-preset", "/nonexistent/area/p.ini"]), ("llama.cpp", ["--models-dir=/nonexistent/area"]),
    ("llama.cpp", ["--models_preset", "x.ini"]), ("llama.cpp", ["-hf", "someone/model"]),
    ("llama.cpp", ["--hf-repo", "someone/model"]), ("llama.cpp", ["-mu", "https://example.com/m.gguf"]),
    ("llama.cpp", ["-dr", "gemma3"]), ("llama.cpp", ["--hf-repo-draft", "a/b"]),
    ("llama.cpp", ["--mmproj-url", "https://example.com/p.gguf"]), ("llama.cpp", ["--gpt-oss-20b-default"]),
    ("vllm", ["--config", "/nonexistent/area/args.yaml"]), ("sglang", ["--conf", "/nonexistent/area/a.yaml"]),
])
def test_flags_taking_a_model_or_arguments_from_elsewhere_are_refused_naming_the_flag(
        agent_module: ModuleType, kind: str, args: list[str]) -> None:
    with pytest.raises(agent_module.Refused) as refused:
        check(agent_module, kind, args)
    assert args[0].partition("=")[0].replace("_", "-") in str(refused.value).replace("_", "-") or \
        "--config" in str(refused.value)
    assert "does not check" in str(refused.value)


def test_vllm_host_ip_is_the_nodes_own_fabric_address(node: Node) -> None:
    node.write_config(engines={**node.settings["engines"], "vllm": [sys.executable, "-c", ECHO_ENGINE]},
                      fabric_address="127.0.0.1", rpc_peers=["127.0.0.0/24"])
    code, answer = node.run("start", {"replica_id": "v", "engine": "vllm", "args": ["serve", "m"],
                                      "env": {"VLLM_HOST_IP": "10.9.9.9"}})
    assert code != 0 and answer.get("refused") == {"setting": "fabric_address"}, answer
    assert "VLLM_HOST_IP" in answer["error"]
    started = node.ok("start", {"replica_id": "v", "engine": "vllm", "args": ["serve", "m"],
                                "env": {"VLLM_HOST_IP": "{fabric_address}"}})
    assert started["pid"]
    node.ok("stop", {"replica_id": "v", "grace_seconds": 2})


@pytest.mark.parametrize(("address", "words"), [
    ("127.1", "write it as 127.0.0.1"), ("0x7f000001", "write it as 127.0.0.1"),
    ("224.0.0.1", "not one unicast address"), ("255.255.255.255", "not one unicast address"),
    ("::", "not one unicast address"), ("0.0.0.0", "not one unicast address"), ("fabric.example", "not an IP"),
])
def test_an_explicit_fabric_address_is_one_unicast_ip_address_in_one_spelling(node: Node, address: str,
                                                                               words: str) -> None:
    node.write_config(fabric_address=address)
    _, error = node.fail("status")
    assert "fabric_address" in error and words in error, error


def test_a_hostname_advertise_address_serves_but_is_no_rpc_server_address(node: Node) -> None:
    """A node advertised by name (no fabric_address) keeps working for single-node replicas; a
    worker on it is refused with the reason instead of an rpc-server that exits at once."""
    settings = {k: v for k, v in node.settings.items() if k != "fabric_address"}
    node.settings.clear()
    node.write_config(**{**settings, "advertise_address": "node-a.example",
                         "engines": {**settings["engines"], "rpc-server": [sys.executable, "-c", ECHO_ENGINE]}})
    node.ok("status")
    code, answer = node.run("start", {"replica_id": "w", "engine": "rpc-server",
                                      "args": ["--host", "{host}", "--port", "{port}"]})
    assert code != 0 and answer.get("refused") == {"setting": "fabric_address"}, answer
    assert "IPv4" in answer["error"]


# Issue 39: a catalog commit took another replica's llama.cpp worker (rpc_peers is the whole
# fabric). The start request names the replica's own peers; a rank's peer flags may name only those.
@pytest.mark.parametrize(("kind", "args", "own"), [
    ("llama.cpp", ["--rpc", "127.0.0.2:50052,127.0.0.3:50052"], ("127.0.0.2:50052", "127.0.0.3:50052")),
    ("vllm", ["--master-addr", "127.0.0.2"], ("127.0.0.2:29501",)),
    ("sglang", ["--dist-init-addr", "127.0.0.2:5000"], ("127.0.0.2:5000",)),
])
def test_a_rank_may_name_its_own_replicas_peers(agent_module: ModuleType, kind: str, args: list[str],
                                                 own: tuple[str, ...]) -> None:
    agent_module.check_args(kind, args, area="/nonexistent/area", read_roots=(), own_peers=own,
                            rpc_peers=tuple(ipaddress.ip_network(p) for p in PEERS), fabric_address=OWN)


@pytest.mark.parametrize(("kind", "args", "own"), [
    # Another replica's worker, inside rpc_peers: refused (it served this replica's neighbour).
    ("llama.cpp", ["--rpc", "127.0.0.2:50052,127.0.0.9:50060"], ("127.0.0.2:50052",)),
    ("llama.cpp", ["--rpc", "127.0.0.9:50060"], ()),
    ("vllm", ["--master-addr", "127.0.0.9"], ("127.0.0.2:29501",)),
    ("vllm", ["--data-parallel-address", "127.0.0.9"], ("127.0.0.2:29501",)),
    ("sglang", ["--dist-init-addr", "127.0.0.9:5000"], ("127.0.0.2:5000",)),
    ("sglang", ["--dist-init-addr", "127.0.0.2:5001"], ("127.0.0.2:5000",)),  # another replica's port
])
def test_a_peer_of_another_replica_is_refused_even_inside_rpc_peers(agent_module: ModuleType, kind: str,
                                                                    args: list[str], own: tuple[str, ...]) -> None:
    with pytest.raises(agent_module.Refused) as refused:
        agent_module.check_args(kind, args, area="/nonexistent/area", read_roots=(), own_peers=own,
                                rpc_peers=tuple(ipaddress.ip_network(p) for p in PEERS), fabric_address=OWN)
    assert "not one of this replica's own peers" in str(refused.value)


def test_a_start_request_naming_its_peers_is_held_to_them(node: Node) -> None:
    """The agent as a process: the head of replica B pointed at replica A's worker is not started."""
    node.write_config(engines={**node.settings["engines"], "llama.cpp": [sys.executable, "-c", ECHO_ENGINE]},
                      fabric_address="127.0.0.1", rpc_peers=["127.0.0.0/24"])
    code, answer = node.run("start", {"replica_id": "b-r0", "engine": "llama.cpp", "peers": ["127.0.0.3:50070"],
                                      "args": ["--rpc", "127.0.0.2:50052"]})
    assert code != 0 and "not one of this replica's own peers (127.0.0.3:50070)" in json.dumps(answer), answer
    code, answer = node.run("start", {"replica_id": "b-r0", "engine": "llama.cpp", "peers": "127.0.0.2:50052",
                                      "args": []})
    assert code != 0 and "peers must be a list" in json.dumps(answer)
    started = node.ok("start", {"replica_id": "b-r0", "engine": "llama.cpp", "peers": ["127.0.0.3:50070"],
                                "args": ["--rpc", "127.0.0.3:50070"]})
    assert started["pid"]
    node.ok("stop", {"replica_id": "b-r0", "grace_seconds": 2})


# Issue 39: SGLang flags that reach other machines passed the agent (a host:port is not a URL; @FILE
# is read by SGLang as more arguments; a config file shipped in the weights names a remote URL).
MOONCAKE = json.dumps({"master_server_address": "203.0.113.5:50051", "protocol": "tcp"})


@pytest.mark.parametrize("args", [
    ["--hicache-storage-backend", "mooncake", "--hicache-storage-backend-extra-config", MOONCAKE],
    ["--hicache-storage-backend", "file", "--hicache-storage-backend-extra-config", MOONCAKE],
    ["--hicache-storage-backend=dynamic"],
    ["--hicache_storage_backend", "hf3fs"],
    ["--hicache-storage-backend-e", '{"module_path": "evil", "class_name": "X"}'],
    ["--hicache-storage-backend-extra-config", "@/etc/llmgw/agent.json"],
    ["@/etc/llmgw/agent.json"],
    ["--lmcache-config-file", "/nonexistent/area/lmcache.yaml"],
    ["--flexkv-config-file=/nonexistent/area/f.json"],
    ["--hicache-storage-remote-url", "http://203.0.113.5"],  # a flag of the family it does not know
    ["--mooncake-master", "203.0.113.5:50051"],
])
def test_sglang_flags_that_reach_other_machines_are_refused(agent_module: ModuleType, args: list[str]) -> None:
    with pytest.raises(agent_module.Refused):
        check(agent_module, "sglang", args)


@pytest.mark.parametrize("args", [
    ["--hicache-ratio", "2", "--hicache-write-policy", "write_through", "--hicache-mem-layout", "page_first"],
    ["--hicache-storage-backend", "file", "--hicache-storage-backend-extra-config",
     json.dumps({"file_path": "/nonexistent/area/hicache", "max_size": "20G", "prefetch_threshold": 64})],
])
def test_sglang_flags_that_stay_on_the_node_pass(agent_module: ModuleType, args: list[str]) -> None:
    check(agent_module, "sglang", args)


def test_vllm_reads_no_argument_file_and_no_unknown_kv_transfer_flag(agent_module: ModuleType) -> None:
    for args in (["@args.txt"], ["--kv-transfer-params", "{}"]):
        with pytest.raises(agent_module.Refused):
            check(agent_module, "vllm", args)
