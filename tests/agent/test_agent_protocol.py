"""The agent's wire contract (DESIGN §4): one JSON object in, one out, errors as {"error"} + non-zero,
the locked-node verb selection, and `serve` mode."""

from __future__ import annotations

import ast
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.agent.helpers import AGENT, Node, http_status, wait_for


def test_hello_reports_version_and_hash_of_the_agent_file(node: Node) -> None:
    answer = node.ok("hello")
    assert answer == {
        "agent_version": "0.1.0",
        "agent_sha256": hashlib.sha256(AGENT.read_bytes()).hexdigest(),
        "hostname": answer["hostname"],
        "protocol": 1,
    }


def test_hostname_override_from_node_config(node: Node, agent_module: ModuleType) -> None:
    node.write_config(hostname="gpu-h100-1")
    assert agent_module.run_verb("hello", str(node.config), {})["hostname"] == "gpu-h100-1"


def test_unusable_request_is_an_error(node: Node) -> None:
    _, error = node.fail("status", raw=b"{not json")
    assert "request is not valid JSON" in error


@pytest.mark.parametrize(("raw", "message"), [
    (b"[1, 2]", "must be a JSON object"),
    (b"\xff\xfe", "not valid JSON"),
    (b"null", "must be a JSON object"),
])
def test_request_parsing(agent_module: ModuleType, raw: bytes, message: str) -> None:
    with pytest.raises(agent_module.AgentError, match=message):
        agent_module.parse_request(raw)
    assert agent_module.parse_request(b" \n") == {}  # empty stdin: `hello </dev/null` works by hand


def test_unknown_verb_is_an_error(node: Node) -> None:
    code, error = node.fail("reboot")
    assert code == 2 and "unknown verb" in error


def test_missing_field_is_an_error(node: Node, agent_module: ModuleType) -> None:
    _, error = node.fail("fetch", {})
    assert "missing field 'source'" in error
    cases = [("start", {"engine": "pyhttp"}, "replica_id"), ("start", {"replica_id": "r"}, "engine"),
             ("stop", {}, "replica_id")]
    for verb, request, field in cases:
        with pytest.raises(agent_module.AgentError, match=f"missing field '{field}'"):
            agent_module.run_verb(verb, str(node.config), request)


def test_unreadable_config_is_an_error(node: Node) -> None:
    node.config.unlink()
    _, error = node.fail("hello")
    assert "unreadable" in error


@pytest.mark.parametrize(("setting", "message"), [
    ({"cache_dir": "relative/cache"}, "cache_dir must be an absolute path"),
    ({"port_range": [9000]}, "port_range must be [first, last]"),
    ({"port_range": [9001, 9000]}, "port_range must be [first, last]"),
    ({"engines": {"vllm": ""}}, "engines.vllm must be a path or a list of strings"),
    ({"engines": {"vllm": []}}, "engines.vllm must be a path or a list of strings"),
    ({"gpus": [{"index": 0}]}, "each of gpus needs index, class and memory_gb"),
    ({"advertise_address": "a b"}, "advertise_address must be a non-empty string"),
    ({"model_dirs": "/models"}, "model_dirs must be a list"),
])
def test_invalid_config_is_an_error(node: Node, agent_module: ModuleType, setting: dict, message: str) -> None:
    node.write_config(**setting)
    with pytest.raises(agent_module.AgentError, match=re.escape(message)):
        agent_module.load_config(str(node.config))


def test_config_path_from_environment(node: Node) -> None:
    argv = [sys.executable, str(AGENT), "hello"]
    proc = subprocess.run(argv, input=b"{}", capture_output=True, timeout=20, check=False,
                          env=node.env(LLMGW_AGENT_CONFIG=str(node.config)))
    assert proc.returncode == 0, proc.stdout


def test_no_verb_and_no_ssh_command_is_an_error(node: Node) -> None:
    code, error = node.fail(None)
    assert code == 2 and "no verb" in error


def test_locked_node_takes_only_the_last_word_of_ssh_original_command(node: Node) -> None:
    victim = node.root / "victim"
    victim.mkdir()
    answer = node.ok(None, env=node.env(SSH_ORIGINAL_COMMAND=f"rm -rf {victim} inventory"))
    assert "gpus" in answer and "filesystems" in answer
    assert victim.is_dir()
    # Other words are never a config path either: the pinned --config stays in force.
    answer = node.ok(None, env=node.env(SSH_ORIGINAL_COMMAND="python3 agent.py --config /nonexistent hello"))
    assert answer["protocol"] == 1


def test_locked_node_refuses_anything_but_a_known_verb(node: Node) -> None:
    code, error = node.fail(None, env=node.env(SSH_ORIGINAL_COMMAND="bash"))
    assert code == 2 and "SSH_ORIGINAL_COMMAND" in error


@pytest.mark.parametrize("command", ["", "   ", "inventory; bash", "hello --config=/x", "_fetch-worker",
                                     "_engine-monitor", "inventory bash", "serve\x00"])
def test_locked_node_verb_selection(agent_module: ModuleType, command: str) -> None:
    with pytest.raises(agent_module.UsageError, match="SSH_ORIGINAL_COMMAND"):
        agent_module.select_verb(None, {"SSH_ORIGINAL_COMMAND": command})
    assert agent_module.select_verb(None, {"SSH_ORIGINAL_COMMAND": "x y  serve "}) == "serve"
    assert agent_module.select_verb("status", {"SSH_ORIGINAL_COMMAND": "bash"}) == "status"


def test_agent_parses_as_python_3_9() -> None:
    """Nodes on Debian 11, Ubuntu 22.04 or RHEL 9 have python3 3.9/3.10: no match statements, no
    3.10+ syntax. (A static check: the tests run the agent on 3.11 only, as the agent says.)"""
    ast.parse(AGENT.read_text(), feature_version=(3, 9))


def test_agent_uses_no_standard_library_newer_than_python_3_9() -> None:
    """vermin knows when each standard-library module, function and argument arrived: a call that
    3.9 lacks (say ``zip(strict=True)`` or ``datetime.UTC``) fails here, though 3.11 runs it."""
    proc = subprocess.run([str(Path(sys.executable).with_name("vermin")), "--no-tips", "--violations", "-t=3.9-",
                           "--eval-annotations", str(AGENT)], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_serve_answers_one_line_per_request_on_one_process(node: Node) -> None:
    weights = node.root / "w.bin"
    weights.write_bytes(b"x" * 1000)
    lines = [
        {"id": 1, "verb": "hello", "request": {}},
        "this is not json",
        {"id": 2, "verb": "reboot", "request": {}},
        {"id": 3, "verb": "serve", "request": {}},
        {"id": 4, "verb": "fetch", "request": {}},
        {"id": 5, "verb": "_fetch-worker", "request": {"source": "/etc/passwd", "lock_fd": 0}},
        {"id": 6, "verb": "start", "request": {"replica_id": "served", "engine": "pyhttp",
                                               "args": ["{port}", "--bind", "127.0.0.1"]}},
        {"id": 7, "verb": "fetch", "request": {"source": f"file://{weights}"}},
        {"id": "eight", "verb": "status"},
    ]
    text = "\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n\n"
    argv = [sys.executable, str(AGENT), "--config", str(node.config), "serve"]
    with subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          env=node.env()) as proc:
        # communicate() returns only once stdout closes: the engine and the fetch worker started
        # from this process must not hold the channel open.
        out, err = proc.communicate(text.encode(), timeout=15)
    assert proc.returncode == 0, err
    replies = [json.loads(line) for line in out.decode().splitlines()]
    # Requests run concurrently, so answers come in the order they finish; ids tell them apart.
    assert sorted(str(r["id"]) for r in replies) == sorted(str(i) for i in [1, None, 2, 3, 4, 5, 6, 7, "eight"])
    by_id = {r["id"]: r for r in replies}
    assert by_id[1]["answer"]["protocol"] == 1
    assert "error" in by_id[None] and "error" in by_id[2] and "error" in by_id[3]
    assert "missing field" in by_id[4]["error"]
    assert "unknown verb" in by_id[5]["error"]  # internal verbs are not reachable from serve
    started = by_id[6]["answer"]
    assert by_id[7]["answer"]["state"] in ("running", "done")
    assert "engines" in by_id["eight"]["answer"]
    # The engine outlived the serve process.
    wait_for(lambda: http_status(started["endpoint"]) == 200)
    assert node.ok("stop", {"replica_id": "served"})["was_running"] is True


def test_serve_keeps_answering_while_a_stop_waits_out_its_grace(node: Node) -> None:
    """Also: an engine that ignores SIGTERM is killed once the grace period is over."""
    node.write_config(engines={**node.settings["engines"], "stubborn": [
        sys.executable, "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"]})
    node.ok("start", {"replica_id": "slow-stop", "engine": "stubborn"})
    wait_for(lambda: "up" in node.ok("status")["engines"][0]["log_tail"])
    argv = [sys.executable, str(AGENT), "--config", str(node.config), "serve"]
    with subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=node.env()) as proc:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps({"id": "stop", "verb": "stop",
                                     "request": {"replica_id": "slow-stop", "grace_seconds": 1}}).encode() + b"\n")
        proc.stdin.write(json.dumps({"id": "hello", "verb": "hello"}).encode() + b"\n")
        proc.stdin.flush()
        first = json.loads(proc.stdout.readline())
        assert first["id"] == "hello"  # answered while the stop was still waiting
        proc.stdin.close()
        second = json.loads(proc.stdout.readline())
        assert second["id"] == "stop" and second["answer"]["exit_code"] == -9
        assert proc.wait(timeout=10) == 0
