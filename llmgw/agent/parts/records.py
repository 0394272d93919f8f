"""Engine records: where each engine's record, exit file and log live, reading them, and forgetting
those of engines long ended."""


from __future__ import annotations

import json
import os
import time
from typing import List, Optional

from llmgw.agent.parts.config import NodeConfig, _is_int
from llmgw.agent.parts.files import (
    _ensure_dir,
    _listdir,
    _locked,
    _remove_file,
    boot_id,
    group_members,
    is_alive,
    proc_stat,
    read_json,
)
from llmgw.agent.parts.protocol import (
    ENGINE_RECORD_TTL,
    REPLICA_ID_RE,
    AgentError,
    JsonDict,
    _field,
)
from llmgw.agent.parts.sandbox import remove_engine_dirs


def _replica_id(request: JsonDict) -> str:
    replica_id = _field(request, "replica_id")
    if not isinstance(replica_id, str) or not REPLICA_ID_RE.match(replica_id):
        raise AgentError("replica_id must match ^[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}$")
    return replica_id


def _record_path(cfg: NodeConfig, replica_id: str) -> str:
    return os.path.join(cfg.state_dir, "engines", replica_id + ".json")


def _exit_path(cfg: NodeConfig, replica_id: str) -> str:
    return os.path.join(cfg.state_dir, "exits", replica_id + ".json")


def _log_path(cfg: NodeConfig, replica_id: str) -> str:
    return os.path.join(cfg.state_dir, "logs", "engines", replica_id + ".log")


def _engines_lock(cfg: NodeConfig) -> str:
    # Held while choosing a port and launching, and while the guard checks "in use" and renames:
    # a start cannot pick a port another start is about to take, nor weights being removed.
    return os.path.join(cfg.state_dir, "engines.lock")


def load_record(cfg: NodeConfig, replica_id: str) -> Optional[JsonDict]:
    record = read_json(_record_path(cfg, replica_id))
    # pid 0 or 1 would turn killpg into "signal my own group" or "signal init": never trust it.
    if record is None or not _is_int(record.get("pid")) or record["pid"] <= 1:
        return None
    record["replica_id"] = replica_id
    return record


def all_records(cfg: NodeConfig) -> List[JsonDict]:
    records = []
    for file_name in _listdir(os.path.join(cfg.state_dir, "engines")):
        if file_name.endswith(".json") and not file_name.startswith("."):
            record = load_record(cfg, file_name[: -len(".json")])
            if record is not None:
                records.append(record)
    return records


def same_boot(record: JsonDict) -> bool:
    recorded, current = record.get("boot_id"), boot_id()
    return recorded is None or current is None or recorded == current


def record_alive(record: JsonDict) -> bool:
    return same_boot(record) and is_alive(record["pid"], record.get("pid_start"))


def exit_info(cfg: NodeConfig, record: JsonDict) -> Optional[JsonDict]:
    """The exit file of this very process (not of an earlier run of the same replica id)."""
    info = read_json(_exit_path(cfg, record["replica_id"]))
    if info and info.get("pid") == record["pid"] and info.get("pid_start") == record.get("pid_start"):
        return info
    return None


def _wait_exit_info(cfg: NodeConfig, record: JsonDict, timeout: float) -> Optional[JsonDict]:
    deadline = time.monotonic() + timeout
    while True:
        info = exit_info(cfg, record)
        if info is not None or time.monotonic() >= deadline:
            return info
        time.sleep(0.05)


def _note_unknown_exit(cfg: NodeConfig, record: JsonDict, now: float) -> None:
    """Write an exit file with an unknown code, unless the monitor has just written the real one
    (O_EXCL: the monitor's later os.replace still wins over ours)."""
    path = _exit_path(cfg, record["replica_id"])
    _ensure_dir(os.path.dirname(path))
    info = {"pid": record["pid"], "pid_start": record.get("pid_start"), "exit_code": None, "ended_at": now}
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        json.dump(info, fh)


def _orphans(record: JsonDict) -> bool:
    """Whether the engine's leader is gone but processes of its group (its workers) remain.

    A pid is not reused while it names a live process group, so a group with that id and no
    leader is still ours; a different process holding the pid means our group is gone."""
    found = proc_stat(record["pid"])
    if not same_boot(record) or (found is not None and found[2] != record.get("pid_start")):
        return False
    return bool(group_members(record["pid"]))


def prune_engine_records(cfg: NodeConfig, now: float) -> None:
    """Forget engines that ended more than ENGINE_RECORD_TTL ago (record, exit file, log, area, TMPDIR)."""
    for record in all_records(cfg):
        if record_alive(record):
            continue
        info = exit_info(cfg, record)
        if info is None:  # died without its monitor noticing: start its clock now
            _note_unknown_exit(cfg, record, now)
        elif now - float(info.get("ended_at") or now) > ENGINE_RECORD_TTL:
            with _locked(_engines_lock(cfg)):
                # Checked again under the lock: a start may have replaced the record meanwhile.
                current = load_record(cfg, record["replica_id"])
                if current is not None and current.get("pid") == record["pid"]:
                    for path in (_record_path(cfg, record["replica_id"]), _exit_path(cfg, record["replica_id"]),
                                 _log_path(cfg, record["replica_id"])):
                        _remove_file(path)
                    remove_engine_dirs(cfg, record["replica_id"])
