"""What an engine finds in its environment besides its argv: vLLM's own needs set by the agent
(offline, no usage report, the node's address), the owner's engine_env over them, and a TMPDIR the
engine user can write (vLLM puts its IPC sockets there)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.agent.helpers import Node, wait_for
from tests.agent.test_agent_boundary import BWRAP

# Reports its environment and where a temporary file lands: tempfile falls back to the cwd,
# silently, when TMPDIR is not writable, which would hide the very failure looked for here.
# vLLM also binds its IPC sockets there, named by a uuid: a socket path is at most 107 bytes.
PRINT_ENV = (
    "import json, os, socket, tempfile, uuid\n"
    "try:\n"
    "    fd, made = tempfile.mkstemp(dir=os.environ['TMPDIR']); os.close(fd); os.unlink(made)\n"
    "except OSError as exc:\n"
    "    made = 'error: ' + str(exc)\n"
    "sock_path = os.path.join(os.environ['TMPDIR'], str(uuid.uuid4()))\n"
    "try:\n"
    "    with socket.socket(socket.AF_UNIX) as sock:\n"
    "        sock.bind(sock_path)\n"
    "    os.unlink(sock_path); bound = 'ok'\n"
    "except OSError as exc:\n"
    "    bound = 'error: ' + str(exc)\n"
    "from multiprocessing import shared_memory\n"
    "try:\n"
    "    shm = shared_memory.SharedMemory(create=True, size=4096); shm.close(); shm.unlink(); shared = 'ok'\n"
    "except OSError as exc:\n"
    "    shared = 'error: ' + str(exc)\n"
    "print('ENV ' + json.dumps({'env': dict(os.environ), 'tmpfile': made, 'socket': bound, 'shm': shared}),"
    " flush=True)\n"
)


def _started_env(node: Node, engine: str, replica: str) -> dict[str, Any]:
    node.ok("start", {"replica_id": replica, "engine": engine})
    log = node.state / "logs" / "engines" / f"{replica}.log"
    line = wait_for(lambda: next((x for x in log.read_text().splitlines() if x.startswith("ENV ")), None))
    node.ok("stop", {"replica_id": replica, "grace_seconds": 1})
    return json.loads(line[4:])


def test_a_vllm_engine_runs_offline_without_usage_reports_on_the_nodes_address(node: Node) -> None:
    node.write_config(engines={**node.settings["engines"], "vllm": [sys.executable, "-c", PRINT_ENV]},
                      engine_env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    seen = _started_env(node, "vllm", "v")
    env = seen["env"]
    # The agent fetched the weights: a hub lookup from the engine is a hang on a closed network.
    assert env["HF_HUB_OFFLINE"] == "1" and env["TRANSFORMERS_OFFLINE"] == "1"
    assert env["VLLM_NO_USAGE_STATS"] == "1" and env["DO_NOT_TRACK"] == "1"
    assert env["VLLM_HOST_IP"] == "127.0.0.1"  # the node's fabric address (its advertise address here)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"  # the owner's sizing reaches the engine
    assert seen["tmpfile"].startswith(env["TMPDIR"] + "/"), seen  # writable by the engine user


def test_the_owners_engine_env_wins_over_the_agents_vllm_defaults(node: Node) -> None:
    node.write_config(engines={**node.settings["engines"], "vllm": [sys.executable, "-c", PRINT_ENV]},
                      engine_env={"HF_HUB_OFFLINE": "0", "VLLM_HOST_IP": "10.1.2.3"})
    env = _started_env(node, "vllm", "o")["env"]
    assert env["HF_HUB_OFFLINE"] == "0" and env["VLLM_HOST_IP"] == "10.1.2.3"


def test_another_engine_gets_no_vllm_settings_and_a_writable_tmpdir_too(node: Node) -> None:
    node.write_config(engines={**node.settings["engines"], "printenv": [sys.executable, "-c", PRINT_ENV]})
    seen = _started_env(node, "printenv", "p")
    assert not [k for k in seen["env"] if k.startswith("VLLM_")], seen["env"]
    assert seen["tmpfile"].startswith(seen["env"]["TMPDIR"] + "/"), seen


def test_a_sandboxed_engines_tmp_and_shm_are_its_own_writable_tmpfs(node: Node) -> None:
    """The node's deep state_dir made vLLM's socket paths too long (seen: a pytest tmp dir); in the
    sandbox the engine's /tmp is short, its own, and gone when it ends."""
    if not BWRAP:
        pytest.skip("bubblewrap is not installed")
    node.write_config(engines={**node.settings["engines"], "printenv": [sys.executable, "-c", PRINT_ENV]})
    seen = _started_env(node, "printenv", "t")
    assert seen["env"]["TMPDIR"] == "/tmp" and seen["socket"] == "ok", seen
    # vLLM's engine core and its API server share memory through /dev/shm (Python's
    # shared_memory): the sandbox's own /dev/shm must be the engine user's to write too.
    assert seen["shm"] == "ok", seen
    assert not Path(seen["tmpfile"]).exists()
