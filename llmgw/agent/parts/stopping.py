"""Stopping an engine: SIGTERM to its main process, SIGKILL to its group after the grace."""


from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import List

from llmgw.agent.parts.config import NodeConfig
from llmgw.agent.parts.files import (
    group_members,
    proc_stat,
)
from llmgw.agent.parts.lease import fenced
from llmgw.agent.parts.protocol import (
    EXIT_RECORD_WAIT,
    KILL_WAIT,
    MAX_GRACE,
    AgentError,
    JsonDict,
    _optional,
)
from llmgw.agent.parts.records import (
    _note_unknown_exit,
    _orphans,
    _replica_id,
    _wait_exit_info,
    load_record,
    record_alive,
)
from llmgw.agent.parts.spawn import _parent_of


def verb_stop(cfg: NodeConfig, request: JsonDict) -> JsonDict:
    """SIGTERM the engine's process group, SIGKILL it after the grace period; idempotent."""
    with fenced(cfg, "stop", request, hold=False):
        return _stop(cfg, request)


def _stop(cfg: NodeConfig, request: JsonDict) -> JsonDict:
    replica_id = _replica_id(request)
    grace = _optional(request, "grace_seconds", 10)
    if not isinstance(grace, (int, float)) or isinstance(grace, bool) or not 0 <= grace <= MAX_GRACE:
        raise AgentError(f"stop: grace_seconds must be a number from 0 to {MAX_GRACE:g}")
    answer = {"replica_id": replica_id, "stopped": True, "was_running": False, "exit_code": None}
    record = load_record(cfg, replica_id)
    if record is None:
        return answer
    was_running = record_alive(record)
    if was_running or _orphans(record):
        terminate_group(record["pid"], float(grace), spare_leader=record.get("sandbox") == "bwrap" and was_running)
    info = _wait_exit_info(cfg, record, EXIT_RECORD_WAIT if was_running else 0.0)
    if info is None:  # the monitor is gone too: note the end ourselves so the record ages out
        _note_unknown_exit(cfg, record, time.time())
    answer.update(was_running=was_running, exit_code=info.get("exit_code") if info else None)
    return answer


def terminate_group(pgid: int, grace: float, *, spare_leader: bool = False) -> None:
    """SIGTERM to the engine's main process alone, then SIGKILL to its whole group after grace
    (systemd's KillMode=mixed). The main process ends its own workers in its own order: real
    vLLM's API server, sent TERM alone, ends the streams in flight with an abort or an error event
    and then exits, while TERM to every process at once killed its engine core first and the API
    server closed those streams mid-answer. A sandboxed engine's leader is bwrap,
    which SIGTERM would kill at once, losing the engine's exit code while the engine still runs:
    then TERM goes to the engine under bwrap (under the namespace's init), and the leader follows
    its child out. ``spare_leader`` false with a live leader: the leader is the engine itself."""
    if spare_leader:
        members = group_members(pgid)
        for pid in _engine_main(pgid, members) or [p for p in members if p != pgid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
    elif (proc_stat(pgid) or ("Z",))[0] != "Z":
        with contextlib.suppress(ProcessLookupError):
            os.kill(pgid, signal.SIGTERM)
    else:  # the engine is gone and its workers remain (orphans): they are all there is to ask
        _signal_group(pgid, signal.SIGTERM)
    if _wait_group_gone(pgid, grace):
        return
    _signal_group(pgid, signal.SIGKILL)
    _wait_group_gone(pgid, KILL_WAIT)


def _engine_main(bwrap: int, members: List[int]) -> List[int]:
    """The engine's own process under a bwrap leader: the child of bwrap's pid-namespace init (a
    second bwrap) when there is one, else bwrap's child."""
    parents = {pid: _parent_of(pid) for pid in members}
    inits = [pid for pid, parent in parents.items() if parent == bwrap and _comm(pid) == "bwrap"]
    tops = set(inits) or {bwrap}
    return [pid for pid, parent in parents.items() if parent in tops and pid not in inits]


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def _wait_group_gone(pgid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while group_members(pgid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True
