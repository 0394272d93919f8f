"""Small file and process helpers: atomic JSON, locks, /proc reads, bounded tails."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import stat
from typing import Any, Iterator, List, Optional, Tuple

from llmgw.agent.parts.protocol import LOG_TAIL_LINES, JsonDict

# ----------------------------------------------------------------------------------------------
# Small file and process helpers


def _ensure_dir(path: str) -> None:
    os.makedirs(path, mode=0o700, exist_ok=True)


def write_json_atomic(path: str, data: Any, *, durable: bool = False) -> None:
    """Readers see the old or the new content, never half a file; ``durable`` also survives a
    power loss (the file and its directory entry are synced)."""
    directory, base = os.path.split(path)
    _ensure_dir(directory)
    tmp = os.path.join(directory, f".{base}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh)
        if durable:
            fh.flush()
            os.fsync(fh.fileno())
    os.replace(tmp, path)
    if durable:
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def read_json(path: str) -> Optional[JsonDict]:
    """The JSON object in path, or None when it is missing or damaged."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def fetch_paths(state_dir: str, name: str) -> Tuple[str, str, str]:
    """(state file, lock file, log file) of the fetch of cache entry `name`."""
    base = os.path.join(state_dir, "fetches", name)
    return base + ".json", base + ".lock", os.path.join(state_dir, "logs", "fetches", name + ".log")


def lock_is_held(path: str) -> bool:
    """Whether a process holds an flock on path (a fetch worker holds its lock while it runs)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing also drops the shared lock if we got it
    return False


def _remove_file(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    """An exclusive flock on path for the duration (it is released if the process dies)."""
    _ensure_dir(os.path.dirname(path))
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def stat_fields(pid: int) -> Optional[List[str]]:
    """The fields of /proc/<pid>/stat from field 3 (state) on, None if the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read().decode("ascii", "replace")
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    return data[data.rfind(")") + 2:].split()


def proc_stat(pid: int) -> Optional[Tuple[str, int, int]]:
    """(state, process group, start time in clock ticks) from /proc/<pid>/stat, None if gone."""
    fields = stat_fields(pid)
    if fields is None:
        return None
    try:
        return fields[0], int(fields[2]), int(fields[19])  # fields 3, 5 and 22
    except (IndexError, ValueError):
        return None


def boot_id() -> Optional[str]:
    """This boot's id: after a reboot, pids and start times begin again and may repeat."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as fh:
            return fh.read().strip() or None
    except OSError:
        return None


def pid_start_time(pid: int) -> Optional[int]:
    found = proc_stat(pid)
    return found[2] if found else None


def is_alive(pid: int, start: Optional[int]) -> bool:
    """True while pid runs and is the process started at `start` (a recycled pid is not ours)."""
    found = proc_stat(pid)
    if found is None:
        if os.path.isdir("/proc/self"):
            return False
        try:  # no /proc (not Linux): the best we can do is ask the kernel whether pid exists
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    state, _, started = found
    return state not in ("Z", "X") and (start is None or started == start)


def group_members(pgid: int) -> List[int]:
    """Live (non-zombie) processes of process group pgid."""
    try:
        names = os.listdir("/proc")
    except OSError:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return []
        return [pgid]
    members = []
    for name in names:
        if name.isdigit():
            found = proc_stat(int(name))
            if found and found[1] == pgid and found[0] not in ("Z", "X"):
                members.append(int(name))
    return members


def tail_lines(path: str, count: int = LOG_TAIL_LINES) -> List[str]:
    """The last `count` lines of a log, read from its end so a huge log costs nothing."""
    window = 64 << 10
    try:
        with open(path, "rb") as fh:
            size = fh.seek(0, os.SEEK_END)
            fh.seek(max(0, size - window))
            data = fh.read()
    except OSError:
        return []
    lines = data.decode("utf-8", "replace").splitlines()
    if size > window:
        lines = lines[1:]  # the first line of the window is probably cut
    return lines[-count:]


def tree_bytes(path: str) -> int:
    """Bytes of the regular files under path (symlinks are not followed)."""
    try:
        if stat.S_ISREG(os.lstat(path).st_mode):
            return os.lstat(path).st_size
    except OSError:
        return 0
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                info = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            if stat.S_ISREG(info.st_mode):
                total += info.st_size
    return total


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _listdir(path: str) -> List[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []
