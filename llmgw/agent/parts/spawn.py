"""Detached helper processes (the fetch worker, the engine monitor) that outlive the SSH session."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from typing import List, Optional, Tuple

from llmgw.agent.parts.config import NodeConfig
from llmgw.agent.parts.files import _ensure_dir, _listdir, pid_start_time, stat_fields, write_json_atomic
from llmgw.agent.parts.protocol import AGENT_PATH, AGENT_VERSION, SPAWN_TIMEOUT, AgentError, JsonDict

# ----------------------------------------------------------------------------------------------
# Detached helper processes


def spawn_detached(cfg: NodeConfig, verb: str, payload: JsonDict, *, log_path: str,
                   pass_fds: Tuple[int, ...] = ()) -> JsonDict:
    """Run an internal verb of this file in a process that outlives this one and the SSH session.

    The child starts a new session, reads payload on stdin, forks (its first half exits at once,
    so it is reaped here and no zombie is left behind a long `serve`), and the surviving half
    writes one JSON reply line and lets go of the pipe. Its stderr goes to log_path."""
    _ensure_dir(os.path.dirname(log_path))
    argv = [sys.executable or "python3", AGENT_PATH, "--config", cfg.path, verb]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                start_new_session=True, pass_fds=pass_fds, cwd=cfg.state_dir)
    try:
        out, _ = proc.communicate(json.dumps(payload).encode("utf-8"), timeout=SPAWN_TIMEOUT)
    except subprocess.TimeoutExpired as exc:
        proc.kill()
        proc.communicate()
        raise AgentError(f"{verb} did not report within {SPAWN_TIMEOUT:g}s (see {log_path})") from exc
    try:
        reply = json.loads(out.decode("utf-8").splitlines()[0])
    except (IndexError, ValueError):
        reply = None
    if not isinstance(reply, dict):
        raise AgentError(f"{verb} failed to start (see {log_path})")
    return reply


def _detach() -> None:
    """Fork; the parent exits at once (its spawner reaps it) and the child carries on."""
    if os.fork() > 0:
        os._exit(0)


def _reply_and_release_stdio(reply: JsonDict) -> None:
    """Send the spawner its one reply line, then point stdin/stdout at /dev/null so the spawner
    (and through it the SSH channel) is not held open by this process."""
    os.write(1, (json.dumps(reply) + "\n").encode("utf-8"))
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    os.close(devnull)


PR_SET_CHILD_SUBREAPER = 36


def _become_subreaper() -> None:
    """Descendants that leave the engine's process group (setsid) are reparented to this monitor
    instead of init, so when the engine ends they are found and ended too: without a sandbox's
    pid namespace, an engine's grandchild could otherwise outlive `stop` holding GPU and port."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the process group is all there is


def _kill_orphans() -> None:
    """SIGKILL and reap every remaining child of this monitor (orphans it adopted as subreaper)."""
    me = os.getpid()
    for _ in range(100):
        children = [pid for pid in _pids() if _parent_of(pid) == me]
        if not children:
            return
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in children:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


def _pids() -> List[int]:
    return [int(name) for name in _listdir("/proc") if name.isdigit()]


def _parent_of(pid: int) -> Optional[int]:
    fields = stat_fields(pid)
    return int(fields[1]) if fields is not None and len(fields) > 1 and fields[1].isdigit() else None


def verb_engine_monitor(_cfg: NodeConfig, request: JsonDict) -> JsonDict:
    """Internal: launch the engine and stay its parent, to record its exit code when it ends.

    Without a parent of our own the exit code of an engine started by an earlier (now gone)
    agent process would be lost."""
    _detach()
    _become_subreaper()
    user = request.get("user") or {}
    switch = {"user": user["uid"], "group": user["gid"], "extra_groups": user["groups"]} if user else {}
    try:
        with open(request["log"], "ab") as log:
            log.write(f"=== llmgw-agent {AGENT_VERSION}: starting {request['argv']!r}\n".encode("utf-8"))
            log.flush()
            # The env is exactly the one the agent built (no inheritance): see engine_environment.
            engine = subprocess.Popen(request["argv"], stdin=subprocess.DEVNULL, stdout=log,
                                      stderr=subprocess.STDOUT, env=request["env"], cwd=request["cwd"],
                                      start_new_session=True, **switch)
    except (OSError, ValueError) as exc:
        _reply_and_release_stdio({"error": f"could not start {request['argv'][0]}: {exc}"})
        return {}
    started = pid_start_time(engine.pid)
    _reply_and_release_stdio({"pid": engine.pid, "pid_start": started})
    code = engine.wait()
    _kill_orphans()
    if request.get("sandboxed") and 128 < code <= 128 + 64:
        # bwrap reports its child's death by signal N as exit 128+N, as a shell does; report it
        # as Popen would for an unsandboxed engine (-N), so a stop reads the same either way.
        code = 128 - code
    write_json_atomic(request["exit_file"], {"pid": engine.pid, "pid_start": started, "exit_code": code,
                                             "ended_at": time.time()})
    return {}
