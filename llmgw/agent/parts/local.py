"""file:// sources: copying a local tree by descriptor, beneath an allowed root, never through a link."""

from __future__ import annotations

import contextlib
import os
import stat
from dataclasses import dataclass
from typing import Generator, Iterator, List, Optional, Sequence, Tuple

from llmgw.agent.parts.cache import _open_dir_nofollow, rmtree_at
from llmgw.agent.parts.config import NodeConfig
from llmgw.agent.parts.files import _inside
from llmgw.agent.parts.protocol import CHUNK, FetchFailed, Refused
from llmgw.agent.parts.sources import FetchProgress


def local_source_roots(cfg: NodeConfig) -> Tuple[str, ...]:
    return tuple(os.path.realpath(d) for d in cfg.local_sources + cfg.model_dirs)


def check_local_source(cfg: NodeConfig, location: str) -> None:
    """A file:// source is copied by root into a cache entry the engine reads: only from the
    directories the node's owner lists (local_sources, model_dirs), or a catalog line like
    file:///root/.ssh/id_ed25519 hands any file on the node to the engine."""
    real = os.path.realpath(location)
    if not any(_inside(real, root) for root in local_source_roots(cfg)):
        raise Refused(f"fetch: {location} is outside the directories this node copies local sources from "
                      f"(local_sources and model_dirs in {cfg.path})", setting="local_sources")


def copy_local(src: str, tmp: str, progress: FetchProgress, roots: Sequence[str]) -> None:
    """Copy a local source into tmp. Two walks: the first checks every file and sums the sizes
    (nothing is written unless all of it may be copied), the second copies; each file is read
    from the descriptor its own checks looked at."""
    try:
        with contextlib.closing(local_files(src, roots)) as files:
            total = sum(info.st_size for _rel, _fd, info in files)
        # A partial copy of a local file is cheaper to redo than to trust.
        _remove_any(tmp)
        os.makedirs(tmp)
        progress.update(0, total, force=True)
        done = 0
        with contextlib.closing(local_files(src, roots)) as files:
            for rel, fd, info in files:
                done = _copy_descriptor(fd, os.path.join(tmp, rel), info.st_size, shown=os.path.join(src, rel),
                                        progress=progress, done=done, total=total)
    except OSError as exc:
        raise FetchFailed(f"copying {src} failed: {exc}") from exc


def _copy_descriptor(fd: int, dest: str, size: int, *, shown: str, progress: FetchProgress, done: int,
                     total: int) -> int:
    """Copy the size bytes the checks saw, no more: a file its owner keeps appending to cannot
    make a fetch endless."""
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    out = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    with os.fdopen(out, "wb") as fout:
        left = size
        while left > 0:
            chunk = os.read(fd, min(CHUNK, left))
            if not chunk:
                raise FetchFailed(f"{shown} became shorter while it was copied; fetch again")
            fout.write(chunk)
            left -= len(chunk)
            done += len(chunk)
            progress.update(done, total)
    return done


# --- what a local source may hand out ---------------------------------------------------------
# The agent (root, usually) copies into an entry every engine may read, from directories where
# other users may own subdirectories. The check and the copy must see the same file: the agent
# had checked a path and then opened it again, and a user swapping a file for a link to a 0600
# root file in between got the secret copied, world-readable. So every component is opened
# without following links (O_NOFOLLOW, from the allowed directory's descriptor down: Python has
# no openat2 RESOLVE_BENEATH), the rules are checked on the opened file (fstat), and the copy
# reads that descriptor.
#
# Whose privileges: the copy runs as the agent, and the rules stand for "the unprivileged user
# could read it": the entry is world-readable, so the bar is every user, on the file (o+r) and
# on every directory copied (o+rx) or searched on a link's way (o+x). A link is read here and
# followed only while it stays inside the allowed directory, to a file. Dropping to the engine
# user for the opens would also require that user to search the directories above the one the
# owner listed, which a node never had to grant. The allowed directories themselves (and the
# path the catalog names inside them) are the owner's and the reviewed catalog's choice.
MAX_LINK_HOPS = 40  # the kernel's own bound for one path
MAX_TREE_DEPTH = 64  # a model is a few levels deep; each level holds one descriptor
_OPEN_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_OPEN_DIR = os.O_RDONLY | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC
_NOT_READABLE = "is not readable by every user; a fetch copies only what any user may read"


@dataclass(frozen=True)
class _Beneath:
    """An allowed directory opened once; what is under it is opened from this descriptor."""

    fd: int
    names: Tuple[str, ...]  # as the node config names it and its real path: a link may use either
    shown: str


def local_files(src: str, roots: Sequence[str]) -> Generator[Tuple[str, int, os.stat_result], None, None]:
    """(path inside the entry, open descriptor, its fstat) for every file of the local source
    src, each checked as it was opened (see above); FetchFailed names the first path refused.
    A descriptor is closed when the next one is asked for (or the generator is closed)."""
    configured, real, parts = _allowed_root(src, roots)
    root = _Beneath(_open_root(real), (os.path.normpath(configured), real), configured)
    try:
        fd, info, resolved = _open_beneath(root, parts, shown=src, followed=False)
        try:
            if stat.S_ISREG(info.st_mode):
                _require(info, src, stat.S_IROTH, _NOT_READABLE)
                yield os.path.basename(src), fd, info
            else:
                _require(info, src, stat.S_IROTH | stat.S_IXOTH, _NOT_READABLE)
                yield from _tree_files(root, fd, resolved, rel="", shown=src, depth=0)
        finally:
            os.close(fd)
    finally:
        os.close(root.fd)


def _allowed_root(src: str, roots: Sequence[str]) -> Tuple[str, str, List[str]]:
    """(root as configured, its real path, src's components under it) for the innermost allowed
    directory holding src, named either way; the worker checks this itself (the source may have
    changed since `fetch` looked)."""
    best: Optional[Tuple[str, str, List[str]]] = None
    for configured in roots:
        real = os.path.realpath(configured)
        for form in (os.path.normpath(configured), real):
            if _inside(src, form):
                parts = [p for p in src[len(form):].split("/") if p]
                if best is None or len(parts) < len(best[2]):
                    best = (configured, real, parts)
    if best is None:
        raise FetchFailed(f"{src} is outside the directories this node copies local sources from")
    return best


def _open_root(real: str) -> int:
    """The allowed directory, opened from / one component at a time: realpath made its name
    link-free, so a link met now is a change since, refused like any other."""
    fd = os.open("/", _OPEN_DIR)
    try:
        for part in [p for p in real.split("/") if p]:
            child = os.open(part, _OPEN_DIR, dir_fd=fd)
            os.close(fd)
            fd = child
    except OSError as exc:
        os.close(fd)
        raise FetchFailed(f"the allowed directory {real} cannot be opened without following a link: "
                          f"{exc.strerror}") from exc
    return fd


def _open_beneath(root: _Beneath, parts: List[str], *, shown: str,
                  followed: bool) -> Tuple[int, os.stat_result, List[str]]:
    """(descriptor, fstat, resolved components) of root/parts, a regular file or a directory,
    never leaving root: a link is read and its text resolved here against the components
    before it, then the walk starts again from root. Once a link was followed, every directory
    on the way must be searchable by every user (a link names no more than its author could)."""
    for _hop in range(MAX_LINK_HOPS + 1):
        fd, info, link = _walk_beneath(root, parts, shown=shown, searchable=followed)
        if link is None:
            return fd, info, parts
        index, target = link
        parts = _link_parts(root, parts[:index], target, shown=shown) + parts[index + 1:]
        followed = True
    raise FetchFailed(f"{shown}: too many symlinks (more than {MAX_LINK_HOPS}, or a loop)")


def _walk_beneath(root: _Beneath, parts: List[str], *, shown: str,
                  searchable: bool) -> Tuple[int, os.stat_result, Optional[Tuple[int, str]]]:
    """Open parts one by one from root: (fd, fstat, None), or (-1, fstat of root, (index of
    the link met, its text))."""
    fd = os.dup(root.fd)
    try:
        info = os.fstat(fd)
        for index, name in enumerate(parts):
            if not stat.S_ISDIR(info.st_mode):
                raise FetchFailed(f"{shown}: {'/'.join(parts[:index])} is not a directory")
            if searchable and index > 0 and not info.st_mode & stat.S_IXOTH:
                raise FetchFailed(f"{shown} leads through {'/'.join(parts[:index])} under {root.shown}, "
                                  "which is not searchable by every user")
            child, target, child_info = _open_entry(fd, name, shown=shown)
            if target is not None:
                return -1, info, (index, target)
            os.close(fd)
            fd, info = child, child_info
        result, fd = fd, -1
        return result, info, None
    finally:
        if fd >= 0:
            os.close(fd)


def _open_entry(dir_fd: int, name: str, *, shown: str) -> Tuple[int, Optional[str], os.stat_result]:
    """(fd, None, fstat) of the regular file or directory `name`, or (-1, its text, lstat) of a
    symlink; anything else (FIFO, socket, device) is refused before it is opened. An entry
    that changes type between the look and the open is refused too."""
    try:
        seen = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if stat.S_ISLNK(seen.st_mode):
            return -1, os.readlink(name, dir_fd=dir_fd), seen
        if not (stat.S_ISREG(seen.st_mode) or stat.S_ISDIR(seen.st_mode)):
            raise FetchFailed(f"{shown} is not a regular file or directory (a FIFO, socket or device is never copied)")
        fd = os.open(name, _OPEN_DIR if stat.S_ISDIR(seen.st_mode) else _OPEN_FILE, dir_fd=dir_fd)
    except FileNotFoundError as exc:
        raise FetchFailed(f"{shown} does not exist on this node (or changed during the fetch)") from exc
    except OSError as exc:  # ELOOP, ENOTDIR, EINVAL: swapped between the look and the open
        raise FetchFailed(f"{shown} changed during the fetch or cannot be opened: {exc.strerror}") from exc
    info = os.fstat(fd)
    if stat.S_IFMT(info.st_mode) != stat.S_IFMT(seen.st_mode):
        os.close(fd)
        raise FetchFailed(f"{shown} changed during the fetch; fetch again")
    return fd, None, info


def _link_parts(root: _Beneath, base: List[str], target: str, *, shown: str) -> List[str]:
    """The components under root that a link in root/base names; a link out of root is refused."""
    outside = f"{shown} is a symlink that leads out of {root.shown}; only links inside it are copied"
    parts = list(base)
    if target.startswith("/"):
        norm = os.path.normpath(target)
        form = next((f for f in root.names if _inside(norm, f)), None)
        if form is None:
            raise FetchFailed(outside)
        parts, target = [], norm[len(form):]
    for part in target.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if not parts:
                raise FetchFailed(outside)
            parts.pop()
        else:
            parts.append(part)
    return parts


def _tree_files(root: _Beneath, dir_fd: int, parts: List[str], *, rel: str, shown: str,
                depth: int) -> Iterator[Tuple[str, int, os.stat_result]]:
    if depth > MAX_TREE_DEPTH:
        raise FetchFailed(f"{shown} is nested more than {MAX_TREE_DEPTH} directories deep")
    for name in sorted(os.listdir(dir_fd)):
        child_rel, child_shown = os.path.join(rel, name), os.path.join(shown, name)
        fd, target, info = _open_entry(dir_fd, name, shown=child_shown)
        child_parts = parts + [name]
        if target is not None:  # a link to a file inside root is copied as its content
            fd, info, child_parts = _open_beneath(root, _link_parts(root, parts, target, shown=child_shown),
                                                  shown=child_shown, followed=True)
            if stat.S_ISDIR(info.st_mode):
                os.close(fd)
                raise FetchFailed(f"{child_shown} is a symlink to a directory; only file links are copied")
        try:
            if stat.S_ISDIR(info.st_mode):
                _require(info, child_shown, stat.S_IROTH | stat.S_IXOTH, _NOT_READABLE)
                yield from _tree_files(root, fd, child_parts, rel=child_rel, shown=child_shown, depth=depth + 1)
            else:
                _require(info, child_shown, stat.S_IROTH, _NOT_READABLE)
                yield child_rel, fd, info
        finally:
            os.close(fd)


def _require(info: os.stat_result, shown: str, bits: int, why: str) -> None:
    if info.st_mode & bits != bits:
        raise FetchFailed(f"{shown} {why}")


def _remove_any(path: str) -> None:
    """Remove path whatever it is, never following a symlink."""
    parent, name = os.path.split(path)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(info.st_mode):
        parent_fd = _open_dir_nofollow(parent)
        try:
            rmtree_at(parent_fd, name)
        finally:
            os.close(parent_fd)
    else:
        os.unlink(path)
