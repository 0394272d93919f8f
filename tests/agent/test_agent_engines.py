"""start / stop / status: engines from the node's allow-list, detached from the agent, stopped by
process group, with their exit codes recorded."""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import time
from types import ModuleType

import pytest

from tests.agent.helpers import Node, http_status, make_entry, own_start_time, wait_for

HTTP_ARGS = ["{port}", "--bind", "127.0.0.1"]


def engine_status(node: Node, replica_id: str) -> dict:
    [engine] = [e for e in node.ok("status")["engines"] if e["replica_id"] == replica_id]
    return engine


def test_engine_starts_serves_outlives_the_agent_and_stops(node: Node) -> None:
    labels = {"model": "llama", "profile": "cpu", "revision": "abc123", "shard_rank": "0"}
    started = node.ok("start", {"replica_id": "llama-0", "engine": "pyhttp", "args": HTTP_ARGS, "gpus": [],
                                "port": None, "weights": None, "labels": labels})
    low, high = node.ports
    assert low <= started["port"] <= high
    assert started["endpoint"] == f"http://127.0.0.1:{started['port']}"
    assert started["already_running"] is False and started["log"].endswith("llama-0.log")
    # The agent process that started it has exited: the engine still answers.
    wait_for(lambda: http_status(started["endpoint"]) == 200)

    status = engine_status(node, "llama-0")
    assert status["alive"] is True and status["exit_code"] is None
    assert (status["pid"], status["port"], status["engine"], status["labels"]) == (
        started["pid"], started["port"], "pyhttp", labels)
    assert any("Serving HTTP" in line for line in status["log_tail"])

    again = node.ok("start", {"replica_id": "llama-0", "engine": "pyhttp", "args": HTTP_ARGS})
    assert (again["pid"], again["already_running"]) == (started["pid"], True)

    stopped = node.ok("stop", {"replica_id": "llama-0", "grace_seconds": 5})
    assert stopped == {"replica_id": "llama-0", "stopped": True, "was_running": True, "exit_code": -15}
    assert http_status(started["endpoint"]) is None
    assert node.ok("stop", {"replica_id": "llama-0"}) == {
        "replica_id": "llama-0", "stopped": True, "was_running": False, "exit_code": -15}
    status = engine_status(node, "llama-0")
    assert status["alive"] is False and status["exit_code"] == -15


def test_stop_of_an_unknown_replica_is_fine(node: Node) -> None:
    assert node.ok("stop", {"replica_id": "never-started"}) == {
        "replica_id": "never-started", "stopped": True, "was_running": False, "exit_code": None}


def test_argv_is_the_configured_prefix_plus_args_with_exact_placeholders(node: Node) -> None:
    entry = make_entry(node.cache, "hf://org/model@main")
    args = ["--port", "{port}", "--model", "{weights}", "--host", "{host}", "{other}", "{port}{port}",
            "x{weights}y", "{PORT}", "{ port }"]
    started = node.ok("start", {"replica_id": "echo", "engine": "pyecho", "args": args, "gpus": [0, 2],
                                "env": {"LLMGW_TEST_VALUE": "from-request"}, "weights": entry.name})
    status = wait_for(lambda: (s := engine_status(node, "echo"))["exit_code"] is not None and s)
    assert status["alive"] is False and status["exit_code"] == 0
    printed = json.loads(next(line for line in status["log_tail"] if line.startswith("{")))
    port = str(started["port"])
    assert printed == {
        "argv": ["--port", port, "--model", str(entry), "--host", "127.0.0.1", "{other}", port + port,
                 f"x{entry}y", "{PORT}", "{ port }"],
        "cuda": "0,2",
        "value": "from-request",
    }
    assert status["weights"] == str(entry)


def test_operator_copy_in_model_dirs_can_be_the_weights(node: Node) -> None:
    own = node.models / "llama"
    own.mkdir()
    node.ok("start", {"replica_id": "own", "engine": "pyecho", "args": ["{weights}"], "weights": str(own)})
    status = wait_for(lambda: (s := engine_status(node, "own"))["exit_code"] is not None and s)
    assert json.loads(status["log_tail"][-1])["argv"] == [str(own)]
    assert json.loads(status["log_tail"][-1])["cuda"] == ""


def test_requested_port_is_used_when_free_and_another_is_chosen_when_busy(node: Node) -> None:
    low, _ = node.ports
    with socket.socket() as busy:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        busy.bind(("127.0.0.1", low))
        busy.listen()
        first = node.ok("start", {"replica_id": "p1", "engine": "pysleep", "port": low})
        assert first["port"] != low
        second = node.ok("start", {"replica_id": "p2", "engine": "pysleep", "port": first["port"]})
        assert second["port"] not in (low, first["port"])  # taken by a live engine, even if not bound
    third = node.ok("start", {"replica_id": "p3", "engine": "pysleep", "port": 80})  # outside the range
    assert node.ports[0] <= third["port"] <= node.ports[1]
    for replica in ("p1", "p2", "p3"):
        node.ok("stop", {"replica_id": replica, "grace_seconds": 1})


@pytest.mark.parametrize(("request_", "message"), [
    ({"replica_id": "r", "engine": "/bin/sh"}, "is not allowed"),
    ({"replica_id": "../etc/x", "engine": "pyecho"}, "replica_id must match"),
    ({"replica_id": "r", "engine": "pyecho", "env": {"LD_PRELOAD": "/tmp/evil.so"}}, "LD_PRELOAD is not allowed"),
    ({"replica_id": "r", "engine": "pyecho", "env": {"PYTHONPATH": "/tmp"}}, "PYTHONPATH is not allowed"),
    ({"replica_id": "r", "engine": "pyecho", "args": "--x"}, "args must be a list"),
    ({"replica_id": "r", "engine": "pyecho", "gpus": [True]}, "gpus must be"),
    ({"replica_id": "r", "engine": "pyecho", "args": ["{weights}"]}, "names no weights"),
    ({"replica_id": "r", "engine": "pyecho", "weights": "llmgw-" + "0" * 64}, "not a complete cache entry"),
    ({"replica_id": "r", "engine": "pyecho", "weights": "/etc"}, "model_dirs"),
])
def test_start_refuses_what_the_node_does_not_allow(node: Node, agent_module: ModuleType, request_: dict,
                                                   message: str) -> None:
    # In-process: these are refused before anything is launched (the subprocess path is below).
    with pytest.raises(agent_module.AgentError, match=re.escape(message)):
        agent_module.run_verb("start", str(node.config), request_)
    assert not (node.state / "engines").exists()


def test_disallowed_engine_is_refused_naming_the_allowed_ones(node: Node) -> None:
    _, error = node.fail("start", {"replica_id": "r", "engine": "bash", "args": ["-c", "id"]})
    assert error == "start: engine 'bash' is not allowed on this node; allowed: pyecho, pyhttp, pysleep"
    assert node.ok("status")["engines"] == []




def write_record(node: Node, replica_id: str, **fields: object) -> None:
    (node.state / "engines").mkdir(parents=True, exist_ok=True)
    record = {"replica_id": replica_id, "port": 1, "engine": "pysleep", "weights": None, "started_at": 0.0,
              "log": "", **fields}
    (node.state / "engines" / f"{replica_id}.json").write_text(json.dumps(record))


@pytest.mark.parametrize("fields", [
    {"pid": os.getpid(), "pid_start": -1},  # the pid was recycled: a different process holds it now
    {"pid": os.getpid(), "pid_start": "match", "boot_id": "an-earlier-boot"},  # same numbers, other boot
    {"pid": 1, "pid_start": None},  # would be init (or with 0, our own group): never signalled
    {"pid": 0, "pid_start": None},
])
def test_stop_never_signals_a_process_that_is_not_the_recorded_engine(node: Node, agent_module: ModuleType,
                                                                       fields: dict) -> None:
    if fields["pid_start"] == "match":
        fields = {**fields, "pid_start": own_start_time()}
    write_record(node, "old", **fields)
    answer = agent_module.run_verb("stop", str(node.config), {"replica_id": "old", "grace_seconds": 0})
    assert answer["was_running"] is False  # and this test process is still here to check it
    views = agent_module.run_verb("status", str(node.config), {})["engines"]
    assert all(not view["alive"] for view in views)


def test_dead_engines_are_forgotten_a_day_after_they_ended(node: Node, agent_module: ModuleType) -> None:
    write_record(node, "ancient", pid=os.getpid(), pid_start=-1)
    write_record(node, "recent", pid=os.getpid(), pid_start=-2)
    (node.state / "exits").mkdir()
    for replica_id, age in (("ancient", 2 * 86400), ("recent", 60)):
        exit_info = {"pid": os.getpid(), "pid_start": -1 if replica_id == "ancient" else -2, "exit_code": 3,
                     "ended_at": time.time() - age}
        (node.state / "exits" / f"{replica_id}.json").write_text(json.dumps(exit_info))
    # What each left on the node besides its record: its area (with a link an engine planted) and
    # the short TMPDIR an unsandboxed engine gets.
    outside = node.root / "outside"
    outside.mkdir()
    (outside / "keep").write_text("not the engine's")
    dirs = {}
    for replica_id in ("ancient", "recent"):
        area = node.state / "run" / replica_id
        tmp = node.state / "t" / hashlib.sha256(replica_id.encode()).hexdigest()[:16]
        for d in (area, tmp):
            d.mkdir(parents=True)
            (d / "cache").write_text("x")
        (area / "link").symlink_to(outside)
        dirs[replica_id] = (area, tmp)
    views = agent_module.run_verb("status", str(node.config), {})["engines"]
    assert [(v["replica_id"], v["alive"], v["exit_code"]) for v in views] == [("recent", False, 3)]
    assert not (node.state / "engines" / "ancient.json").exists()
    assert not any(d.exists() for d in dirs["ancient"]) and all(d.exists() for d in dirs["recent"])
    assert (outside / "keep").read_text() == "not the engine's"  # the link was unlinked, not followed
