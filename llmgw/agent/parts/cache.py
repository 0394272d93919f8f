"""Cache entries: their names, manifests and the descriptor-relative reads and deletes that inspect them."""

from __future__ import annotations

import errno
import json
import os
import stat
from typing import Optional, Tuple

from llmgw.agent.parts.protocol import CACHE_NAME_RE, MANIFEST_NAME, MAX_MANIFEST_BYTES, JsonDict, cache_name

# ----------------------------------------------------------------------------------------------
# Cache entries


def _open_dir_nofollow(name: str, dir_fd: Optional[int] = None) -> int:
    return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)


def read_manifest_at(dir_fd: int, name: str) -> Tuple[Optional[JsonDict], Optional[str]]:
    """(manifest, None) for the entry `name` under dir_fd, or (None, why it has none).

    Neither the entry nor its manifest may be a symlink: a link could make a file outside the
    cache vouch for an entry."""
    manifest, problem, _ = read_entry_at(dir_fd, name)
    return manifest, problem


def read_entry_at(dir_fd: int, name: str) -> Tuple[Optional[JsonDict], Optional[str], Optional[os.stat_result]]:
    """read_manifest_at, plus the stat of the very directory the manifest was read from, so a
    caller can tell whether that is the directory it looked at before (and will act on after).

    The manifest must be a regular file and is opened non-blocking: a FIFO named like a manifest
    would otherwise block the open forever, holding the engines lock of every call on the node."""
    try:
        entry_fd = _open_dir_nofollow(name, dir_fd)
    except OSError as exc:
        return None, "is not a directory or is a symlink" if exc.errno in (errno.ELOOP, errno.ENOTDIR) \
            else f"cannot be opened: {exc.strerror}", None
    try:
        entry_stat = os.fstat(entry_fd)
        fd = os.open(MANIFEST_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=entry_fd)
        with os.fdopen(fd, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                return None, "has no readable manifest (it is not a regular file)", entry_stat
            data = fh.read(MAX_MANIFEST_BYTES + 1)
        if len(data) > MAX_MANIFEST_BYTES:
            return None, f"has no readable manifest (it is larger than {MAX_MANIFEST_BYTES} bytes)", entry_stat
        manifest = json.loads(data.decode("utf-8"))
    except (OSError, ValueError, RecursionError):
        return None, "has no readable manifest", None
    finally:
        os.close(entry_fd)
    if not isinstance(manifest, dict) or not isinstance(manifest.get("source"), str):
        return None, "has no readable manifest", entry_stat
    return manifest, None, entry_stat


MISSING = "does not exist"


def inspect_entry(cache_dir: str, name: str) -> Tuple[Optional[JsonDict], Optional[str]]:
    """(manifest, None) when <cache_dir>/<name> is a complete entry of this system, else (None, why)."""
    if not CACHE_NAME_RE.match(name):
        return None, "name is not a cache name (llmgw-<sha256 hex>)"
    try:
        info = os.lstat(os.path.join(cache_dir, name))
    except FileNotFoundError:
        return None, MISSING
    except OSError as exc:
        return None, f"cannot be read: {exc.strerror}"
    if stat.S_ISLNK(info.st_mode):
        return None, "is a symlink"
    if not stat.S_ISDIR(info.st_mode):
        return None, "is not a directory"
    try:
        # The configured cache_dir may itself be reached through a symlink (an operator's choice);
        # only the entry and its manifest must not be links. The deletion guard is stricter.
        cache_fd = os.open(cache_dir, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        return None, f"cache directory cannot be opened: {exc.strerror}"
    try:
        manifest, problem = read_manifest_at(cache_fd, name)
    finally:
        os.close(cache_fd)
    if manifest is not None and cache_name(manifest["source"]) != name:
        return None, "manifest source does not hash to the entry name"
    return manifest, problem


def rmtree_at(parent_fd: int, name: str, *, expected: Optional[os.stat_result] = None,
              device: Optional[int] = None) -> None:
    """Delete the directory parent_fd/name and everything in it without following a symlink:
    every directory is opened with O_NOFOLLOW relative to its parent's descriptor, so swapping a
    component for a link makes the walk fail instead of leaving the tree. Links are unlinked.

    The walk never leaves the filesystem it started on (a mount inside the tree is no link, so
    O_NOFOLLOW would not stop it), and when `expected` is given the top directory must be that
    very directory (device and inode), or nothing is deleted."""
    fd = _open_dir_nofollow(name, parent_fd)
    try:
        here = os.fstat(fd)
        if expected is not None and (here.st_dev, here.st_ino) != (expected.st_dev, expected.st_ino):
            raise OSError(errno.ESTALE, f"{name} is no longer the directory that was checked")
        if device is not None and here.st_dev != device:
            raise OSError(errno.EXDEV, f"{name} is on another filesystem (a mount); not deleting through it")
        with os.scandir(fd) as it:
            entries = list(it)
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                rmtree_at(fd, entry.name, device=here.st_dev)
            else:
                os.unlink(entry.name, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=parent_fd)
