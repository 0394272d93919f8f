"""remove-weights: the deletion guard (DESIGN §4)."""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from llmgw.agent.parts.cache import MISSING, _open_dir_nofollow, read_entry_at, rmtree_at
from llmgw.agent.parts.config import NodeConfig
from llmgw.agent.parts.fetch import _fetch_paths
from llmgw.agent.parts.files import _inside, _locked, _remove_file, read_json
from llmgw.agent.parts.inventory import read_mounts
from llmgw.agent.parts.lease import fenced
from llmgw.agent.parts.protocol import CACHE_NAME_RE, TRASH_PREFIX, AgentError, JsonDict, _field, cache_name
from llmgw.agent.parts.records import _engines_lock, _orphans, all_records, record_alive

# ----------------------------------------------------------------------------------------------
# remove-weights: the deletion guard (DESIGN §4)


def verb_remove_weights(cfg: NodeConfig, request: JsonDict) -> JsonDict:
    """Remove each path that passes every check of the guard; refuse the others with a reason.

    Each path is checked, then renamed (relative to a descriptor of the cache directory opened
    without following any symlink) to a trash name, re-checked, and only then deleted, without
    following symlinks. A refusal is the guard working, not a failure: the exit code is 0."""
    with fenced(cfg, "remove-weights", request, hold=False):
        return _remove_weights(cfg, request)


def _remove_weights(cfg: NodeConfig, request: JsonDict) -> JsonDict:
    paths = _field(request, "paths")
    if not isinstance(paths, list):
        raise AgentError("remove-weights: paths must be a list")
    cache_fd, cache_problem = open_cache_dir(cfg.cache_dir)
    if cache_fd is None:  # nothing can be removed; every path gets its own refusal all the same
        return {"results": [_refusal(raw, cache_problem) for raw in paths]}
    results: List[JsonDict] = []
    trash: List[Tuple[JsonDict, str, str, os.stat_result]] = []
    try:
        with _locked(_engines_lock(cfg)):
            # An engine whose leader died but whose workers live on still has its weights open.
            in_use = {r.get("weights"): r["replica_id"] for r in all_records(cfg) if record_alive(r) or _orphans(r)}
            moved: Set[str] = set()
            mounts = read_mounts(cfg.mounts_file)
            for raw in paths:
                result: JsonDict = {"path": raw, "removed": False}
                results.append(result)
                reason, candidate = check_removable(raw, cfg=cfg, cache_fd=cache_fd, in_use=in_use, already=moved,
                                                    mounts=mounts)
                if candidate is not None:
                    name, checked = candidate
                    trash_name, reason = move_to_trash(cache_fd, name, checked)
                    if trash_name is not None:
                        moved.add(name)
                        trash.append((result, name, trash_name, checked))
                if reason is not None:
                    result["reason"] = reason
        # Deleting may take a while; it happens outside the lock, on names only we know.
        for result, name, trash_name, checked in trash:
            _delete_trash(cfg, cache_fd, name, trash_name, result, checked)
    finally:
        os.close(cache_fd)
    return {"results": results}


def _refusal(raw: Any, cache_problem: Optional[str]) -> JsonDict:
    return {"path": raw, "removed": False, "reason": _path_text_problem(raw) or cache_problem}


def open_cache_dir(cache_dir: str) -> Tuple[Optional[int], Optional[str]]:
    """(fd of the cache dir, None), opened one component at a time with O_NOFOLLOW so that no
    symlink anywhere on the way is followed; or (None, why not)."""
    fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
    walked = ""
    for part in [p for p in cache_dir.split("/") if p]:
        walked += "/" + part
        try:
            next_fd = _open_dir_nofollow(part, fd)
        except OSError as exc:
            os.close(fd)
            if os.path.islink(walked):
                return None, (f"the cache directory {cache_dir} is reached through a symlink ({walked}); "
                              "the node deletes nothing through a symlink: set cache_dir to the real path")
            if exc.errno == errno.ENOENT:
                return None, f"the cache directory {cache_dir} does not exist"
            return None, f"the cache directory {cache_dir} cannot be opened: {exc.strerror}"
        os.close(fd)
        fd = next_fd
    return fd, None


Candidate = Tuple[str, os.stat_result]  # (entry name, lstat of the entry when it was checked)


def check_removable(raw: Any, *, cfg: NodeConfig, cache_fd: int, in_use: Dict[Any, str],
                    already: Set[str], mounts: Sequence[Tuple[str, str]] = ()
                    ) -> Tuple[Optional[str], Optional[Candidate]]:
    """(None, (name, stat of the entry)) when raw may be removed, else (reason, None)."""
    reason = _path_text_problem(raw)
    if reason is not None:
        return reason, None
    path = "/" + os.path.normpath(raw).lstrip("/")  # normpath keeps a leading "//"
    link = _first_symlink(path)
    if link is not None:
        return ("path is a symlink" if link == path else f"path passes through a symlink ({link})"), None
    parent, name = os.path.split(path)
    if parent != cfg.cache_dir:
        return f"not a direct child of the cache directory {cfg.cache_dir}", None
    if not CACHE_NAME_RE.match(name):
        return "name is not a cache name (llmgw-<sha256 hex>): not this system's to delete", None
    if name in already:
        return "already removed (listed twice)", None
    try:
        info = os.stat(name, dir_fd=cache_fd, follow_symlinks=False)
    except FileNotFoundError:
        return MISSING, None
    except OSError as exc:
        return f"cannot be read: {exc.strerror}", None
    if stat.S_ISLNK(info.st_mode):
        return "path is a symlink", None
    if not stat.S_ISDIR(info.st_mode):
        return "not a directory", None
    manifest, problem, read_from = read_entry_at(cache_fd, name)
    if manifest is None:
        return str(problem), None
    if read_from is None or (read_from.st_dev, read_from.st_ino) != (info.st_dev, info.st_ino):
        # Another directory was swapped in for the manifest read: what vouched is not what was
        # looked at, and the rename's identity check would only compare against the latter.
        return "changed while being checked (swapped for something else); left alone", None
    if cache_name(manifest["source"]) != name:
        return "manifest source does not hash to the entry name", None
    entry_path = os.path.join(cfg.cache_dir, name)
    mount = next((point for point, _ in mounts if _inside(point, entry_path)), None)
    if mount is not None:
        # The deletion walk does not follow links, but a mount is no link: deleting would empty
        # whatever is mounted there.
        return f"is or holds a mount point ({mount}); left alone", None
    user = in_use.get(entry_path)
    if user is not None:
        return f"in use by running engine {user}", None
    return None, (name, info)


def _path_text_problem(raw: Any) -> Optional[str]:
    if not isinstance(raw, str):
        return "path is not a string"
    if raw == "":
        return "path is empty"
    if "\0" in raw:
        return "path contains a NUL byte"
    if not raw.startswith("/"):
        return "path is not absolute"
    if ".." in raw.split("/"):
        return "path contains '..' components"
    try:
        os.fsencode(raw)
    except UnicodeError:  # a lone surrogate from JSON: no file can have this name
        return "path cannot be encoded as a file name"
    return None


def _first_symlink(path: str) -> Optional[str]:
    """The first component of path (from the root) that is a symlink, per lstat; None if none."""
    walked = ""
    for part in [p for p in path.split("/") if p]:
        walked += "/" + part
        try:
            if stat.S_ISLNK(os.lstat(walked).st_mode):
                return walked
        except OSError:
            return None  # the rest does not exist (or cannot be seen): nothing more to follow
    return None


def move_to_trash(cache_fd: int, name: str, checked: os.stat_result) -> Tuple[Optional[str], Optional[str]]:
    """(trash name, None) once the checked entry is renamed aside, else (None, reason).

    The rename is atomic and relative to the cache dir's descriptor, so a swap after the check
    cannot redirect it elsewhere; whatever it moved must still be the very directory (device and
    inode) that was checked, or it is put back and left alone."""
    trash_name = f"{TRASH_PREFIX}{name}-{secrets.token_hex(6)}"
    try:
        os.rename(name, trash_name, src_dir_fd=cache_fd, dst_dir_fd=cache_fd)
    except FileNotFoundError:
        return None, "disappeared before it could be removed"
    except OSError as exc:
        return None, f"could not be moved aside: {exc.strerror}"
    moved = os.stat(trash_name, dir_fd=cache_fd, follow_symlinks=False)
    if stat.S_ISDIR(moved.st_mode) and (moved.st_dev, moved.st_ino) == (checked.st_dev, checked.st_ino):
        return trash_name, None
    _put_back(cache_fd, trash_name, name)
    return None, "changed between the check and the removal (swapped for something else); left alone"


def _put_back(cache_fd: int, trash_name: str, name: str) -> None:
    try:
        os.stat(name, dir_fd=cache_fd, follow_symlinks=False)
        return  # something new took the name: leave the swapped-in thing under its trash name
    except FileNotFoundError:
        pass
    with contextlib.suppress(OSError):
        os.rename(trash_name, name, src_dir_fd=cache_fd, dst_dir_fd=cache_fd)


def _delete_trash(cfg: NodeConfig, cache_fd: int, name: str, trash_name: str, result: JsonDict,
                  checked: os.stat_result) -> None:
    try:
        # Outside the lock, so the trash name is opened again: it must still be what was checked.
        rmtree_at(cache_fd, trash_name, expected=checked)
    except OSError as exc:
        result["reason"] = f"moved aside to {trash_name} but deleting it failed: {exc}"
        return
    result["removed"] = True
    state_path = _fetch_paths(cfg, name)[0]
    state = read_json(state_path)
    if state is not None and state.get("state") == "done":
        _remove_file(state_path)  # a "done" fetch of an entry that is gone would mislead
