"""A stop asks the engine's main process to end, and lets it end its own workers.

Real vLLM is an API server with an engine core and a worker under it. SIGTERM to every process
of the group at once killed the engine core first, and the API server then closed the streams in
flight mid-answer; SIGTERM to the API server alone aborts them properly (finish_reason "abort",
then [DONE]) and stops the engine core itself. What remains after the grace is SIGKILLed, as
systemd's KillMode=mixed does."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.agent.helpers import Node, wait_for

# The main process starts a worker, and on SIGTERM tells it to go (SIGUSR1) before going itself;
# the worker says which signal reached it.
# The main process is ready for SIGTERM before its worker exists: the test stops the engine once
# the worker says it is up (seen in CI: the worker spoke first and TERM found the main process
# still on the default action).
PARENT = """
import os, signal, subprocess, sys, time
child = None
def stop(*_):
    print("main got TERM", flush=True)
    time.sleep(0.5)  # a real server finishes its answers first
    child.send_signal(signal.SIGUSR1)
    child.wait()
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
child = subprocess.Popen([sys.executable, "-c", '''
import signal, sys, time
def said(name):
    def handler(*_):
        print("worker got " + name, flush=True)
        sys.exit(0)
    return handler
signal.signal(signal.SIGTERM, said("TERM"))
signal.signal(signal.SIGUSR1, said("USR1"))
print("worker up", flush=True)
while True:
    time.sleep(1)
'''])
while True:
    time.sleep(1)
"""


@pytest.mark.parametrize("sandbox", ["auto", "none"])
def test_stop_signals_the_engines_main_process_which_ends_its_workers(node: Node, sandbox: str) -> None:
    unsandboxed = {}
    if sandbox == "none" and os.geteuid() == 0:
        # This interpreter lives under /root, which nobody cannot reach without the sandbox's binds.
        unsandboxed = {"engine_user": "root", "engines_as_root": True}
    node.write_config(engines={**node.settings["engines"], "parent": [sys.executable, "-c", PARENT]},
                      sandbox=sandbox, **unsandboxed)
    node.ok("start", {"replica_id": "m", "engine": "parent"})
    log: Path = node.state / "logs" / "engines" / "m.log"
    wait_for(lambda: "worker up" in log.read_text(), timeout=20)
    answer = node.ok("stop", {"replica_id": "m", "grace_seconds": 20})
    text = log.read_text()
    assert "main got TERM" in text and "worker got USR1" in text, text
    assert "worker got TERM" not in text, text
    assert answer["exit_code"] == 0, answer  # its own exit, before the grace ran out
