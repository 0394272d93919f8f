"""One controller process per data dir: an exclusive lock held for the process's whole life.

The data dir holds the controller's identity on the nodes (its lease holder id) and its state.
Two processes on one data dir are one controller twice: each would renew the same leases and
stop the other's engines as stale. ``llmgw controller`` and ``llmgw up`` take this lock before
anything else, so the second exits at once saying which process holds it. (A *copy* of a data
dir is another matter: a lock cannot see it; the nodes fence it by the instance nonce each
process sends with its lease, see llmgw.dispatch.fence.)

``flock`` on the directory itself rather than a pid file: the kernel drops the lock when the
process dies however it dies (kill -9 included), so a crash never leaves a stale lock for an
operator to clean up, and no file in the dir can be removed or replaced to let a second one in.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path

from llmgw.errors import ConfigError
from llmgw.paths import lock_held

LOCK_FILE = "llmgw.lock"
INSTANCE_FILE = "instance.json"
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


class DataDirInUse(ConfigError):
    """Another process holds the data dir's lock."""


# Data dir (device, inode) → the descriptor holding its lock, for this process. Per process
# because the lock is: the command line takes it first thing and the controller it starts asks
# again, and a second open() of the directory in the same process would conflict with the first.
_HELD: dict[tuple[int, int], int] = {}

# A probe (held_by_a_process) holds the lock for an instant; a process taking it at that very
# instant tries again this many times before saying the data dir is in use.
_TRIES = 5
_TRY_GAP_S = 0.02


def _open_dir(root: Path) -> int:
    return os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


def hold_data_dir(data_dir: Path | str) -> int:
    """Lock ``data_dir`` (made when missing) for as long as this process runs; the descriptor.

    The lock is on the directory itself, not on a file in it: a file can be unlinked or renamed
    over (an operator "cleaning a stale lock", an rsync restore into the live dir), and a second
    process would then lock a new file and run on the same data dir as the first. The pid file
    (``llmgw.lock``) is only for the next one's message.

    The descriptor is deliberately never closed: the lock lives as long as the process (the
    kernel drops it at exit). Asked again in the same process, the same descriptor. Raises
    :class:`DataDirInUse` naming the data dir and the pid that holds it, and
    :class:`~llmgw.errors.ConfigError` when the data dir or its pid file cannot be made.
    """
    root = Path(data_dir)
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd = _open_dir(root)
        st = os.fstat(fd)
    except OSError as exc:
        raise ConfigError(f"data dir {root}: cannot open it: {exc.strerror or exc}") from exc
    key = (st.st_dev, st.st_ino)
    if key in _HELD:
        os.close(fd)
        return _HELD[key]
    for attempt in range(_TRIES):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except OSError as exc:
            if attempt + 1 < _TRIES:
                time.sleep(_TRY_GAP_S)
                continue
            os.close(fd)
            # The kernel's word first: the pid file may be gone, or restored with an old pid.
            pid = _flock_holder(st)
            if pid is None:
                pid = _holder_pid(root)
            who = f"pid {pid}" if pid is not None else "a process whose pid is not recorded"
            raise DataDirInUse(
                f"data dir {root} is in use by another llmgw process ({who}): one controller per data dir. "
                "Stop that one first; a second controller needs a data dir of its own (a copy of this one is "
                "another instance of the same controller, which the nodes fence)") from exc
    try:
        _write_pid(root)
    except OSError as exc:
        os.close(fd)
        raise ConfigError(
            f"data dir {root}: cannot create its lock file {root / LOCK_FILE}: {exc.strerror or exc}") from exc
    _HELD[key] = fd
    return fd


def _write_pid(root: Path) -> None:
    """Who holds the lock, for the next one's message; written after the lock, so never someone
    else's. Never through a symlink (it would write wherever the link points)."""
    pid_fd = os.open(root / LOCK_FILE, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        os.ftruncate(pid_fd, 0)
        os.pwrite(pid_fd, f"{os.getpid()}\n".encode(), 0)
    finally:
        os.close(pid_fd)


def release_data_dir(data_dir: Path | str) -> None:
    """Give the lock up before the process ends (an embedding that runs controllers one after
    another in one process; tests). Nothing when this process does not hold it."""
    try:
        st = os.stat(Path(data_dir))
    except OSError:
        return
    fd = _HELD.pop((st.st_dev, st.st_ino), None)
    if fd is not None:
        os.close(fd)


def held_by_a_process(path: Path) -> bool:
    """Whether a live process (this one included) holds the lock of the data dir ``path`` (or of
    the data dir whose pid file ``path`` is). False when there is no such data dir.

    For readers that must not trust what a data dir says unless its controller runs (the admin
    address it wrote, say). A non-blocking probe: a shared lock taken and dropped at once, never
    waited for; a controller starting at that instant tries again (hold_data_dir).
    """
    root = Path(path)
    if root.name == LOCK_FILE and not root.is_dir():
        root = root.parent
    try:
        st = os.stat(root)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) in _HELD or lock_held(root)


def _flock_holder(st: os.stat_result) -> int | None:
    """The pid holding a flock on the file ``st`` describes, from /proc/locks (Linux): the pid
    file may have been removed, and the refusal should still say whom to stop."""
    wanted = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF" (a blocked waiter's line has "->").
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == wanted and fields[4].isdigit():
            return int(fields[4])
    return None


def _holder_pid(root: Path) -> int | None:
    try:
        with open(root / LOCK_FILE, "rb") as f:
            text = f.read(32).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def succeed(data_dir: Path | str, instance: str) -> str | None:
    """Record ``instance`` as the one running on ``data_dir``; the instance it succeeds, if known.

    Called with the lock held, so the instance recorded before ours has ended. It is returned only
    when it provably ran on this very directory (same device and inode) during this boot of this
    machine: then the nodes may hand its leases over at once instead of after the silence a
    restart must otherwise wait out. A copy of the data dir (another directory, another machine,
    a cloned disk booted elsewhere) never matches, so a copy never claims a live instance's nodes.
    """
    root = Path(data_dir)
    # The lock is the directory's own (hold_data_dir), so holding it proves no other process runs
    # on this directory: no file in it can be removed or replaced to fake that (seen with a lock
    # file: a second controller named the live one as its predecessor and took its nodes at once).
    if not held_here(root):
        raise RuntimeError(f"succeed({root}) without the data dir's lock")
    here = _where(root)
    path = root / INSTANCE_FILE
    before: str | None = None
    try:
        recorded = json.loads(path.read_text())
        if (here is not None and isinstance(recorded, dict) and recorded.get("where") == here
                and isinstance(recorded.get("instance"), str)):
            before = recorded["instance"]
    except (OSError, ValueError):
        pass  # none recorded, or unreadable: the nodes wait the silence out instead
    tmp = path.with_name(f".{INSTANCE_FILE}.{os.getpid()}")
    tmp.write_text(json.dumps({"instance": instance, "where": here}))
    os.replace(tmp, path)
    return before


def _where(root: Path) -> list[object] | None:
    """This boot of this machine and this directory; None where the boot cannot be told."""
    try:
        boot = BOOT_ID.read_text().strip()
        st = os.stat(root)
    except OSError:
        return None
    return [boot, st.st_dev, st.st_ino] if boot else None


def held_here(data_dir: Path | str) -> bool:
    """Whether this process holds ``data_dir``'s lock."""
    try:
        st = os.stat(Path(data_dir))
    except OSError:
        return False
    return (st.st_dev, st.st_ino) in _HELD
