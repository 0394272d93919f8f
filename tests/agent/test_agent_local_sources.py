"""fetch of a local source (file:// or a plain path): the agent, often root, copies files into a
cache entry every engine may read. Nothing it copies may be something the catalog's author or a
user owning a directory inside `local_sources` could not read themselves: no link out of the
allowed directory, no file or directory other users may not read, no FIFO or device, and no
window between the check and the copy (a file swapped for a link during the fetch)."""

from __future__ import annotations

import os
import select
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

from tests.agent.helpers import Node, cache_name

ROOT = os.geteuid() == 0
SECRET = b"ROOT-ONLY-SECRET-" + os.urandom(8).hex().encode()
NOBODY = 65534


def settle(node: Node, source: str, *, timeout: float = 20.0) -> dict:
    """Ask for the fetch and wait until its worker has finished, whatever the outcome."""
    return node.fetch_settled({"source": source}, timeout=timeout)


def cache_holding_secret(node: Node) -> list[str]:
    """Every file anywhere under the cache dir (entries and partial downloads) holding SECRET."""
    found = []
    for dirpath, _dirs, files in os.walk(node.cache):
        for name in files:
            path = Path(dirpath) / name
            if not path.is_symlink() and SECRET in path.read_bytes():
                found.append(str(path))
    return found


@dataclass
class Layout:
    src: Path  # the directory the catalog names, inside local_sources
    secret_outside: Path  # a 0600 root file outside local_sources
    secret_inside: Path  # a 0600 root file inside local_sources, outside the source


@pytest.fixture
def layout(node: Node) -> Iterator[Layout]:
    src = node.root / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "weights.bin").write_bytes(b"w" * 1000)
    outside = node.root.parent / f"secret-{node.root.name}"
    outside.write_bytes(SECRET)
    outside.chmod(0o600)
    inside = node.root / "secret"
    inside.write_bytes(SECRET)
    inside.chmod(0o600)
    yield Layout(src=src, secret_outside=outside, secret_inside=inside)
    outside.unlink()


def _fifo(lay: Layout, _node: Node) -> tuple[str, str]:
    os.mkfifo(lay.src / "pipe")
    return "pipe", "not a regular file or directory"


def _device(lay: Layout, _node: Node) -> tuple[str, str]:
    if not ROOT:
        pytest.skip("making a device node needs root")
    os.mknod(lay.src / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    return "null", "not a regular file or directory"


def _link_out(lay: Layout, _node: Node) -> tuple[str, str]:
    (lay.src / "model.bin").symlink_to(lay.secret_outside)
    return "model.bin", "leads out of"


def _relative_link_out(lay: Layout, _node: Node) -> tuple[str, str]:
    rel = os.path.relpath(lay.secret_outside, lay.src)
    assert rel.startswith("../../")
    (lay.src / "model.bin").symlink_to(rel)
    return "model.bin", "leads out of"


def _link_to_root_only(lay: Layout, _node: Node) -> tuple[str, str]:
    (lay.src / "model.bin").symlink_to(lay.secret_inside)
    return "model.bin", "not readable by every user"


def _hardlink_to_root_only(lay: Layout, _node: Node) -> tuple[str, str]:
    # A hard link is the root file itself (owner root, mode 0600): the read rule refuses it.
    os.link(lay.secret_outside, lay.src / "model.bin")
    return "model.bin", "not readable by every user"


def _directory_link(lay: Layout, node: Node) -> tuple[str, str]:
    other = node.root / "other"
    other.mkdir()
    (other / "x.bin").write_bytes(b"x")
    (lay.src / "sub").symlink_to(other)
    return "sub", "symlink to a directory"


def _private_directory(lay: Layout, _node: Node) -> tuple[str, str]:
    private = lay.src / "private"
    private.mkdir()
    (private / "notes.txt").write_text("world-readable file in a 0700 directory")
    private.chmod(0o700)
    return "private", "not readable by every user"


def _link_through_private_directory(lay: Layout, node: Node) -> tuple[str, str]:
    private = node.root / "private"
    private.mkdir()
    (private / "notes.txt").write_text("world-readable file in a 0700 directory")
    private.chmod(0o700)
    (lay.src / "model.bin").symlink_to(private / "notes.txt")
    return "model.bin", "not searchable by every user"


CASES = [_fifo, _device, _link_out, _relative_link_out, _link_to_root_only, _hardlink_to_root_only,
         _directory_link, _private_directory, _link_through_private_directory]


@pytest.mark.parametrize("case", CASES, ids=[c.__name__.strip("_") for c in CASES])
def test_a_local_source_holding_what_others_may_not_read_is_refused(node: Node, layout: Layout, case) -> None:
    """Each is refused as a whole, naming the path: a silently skipped file would have been an
    entry that looks complete and is not."""
    name, reason = case(layout, node)
    source = f"file://{layout.src}"
    state = settle(node, source)
    assert state["state"] == "failed", state
    assert reason in state["error"] and str(layout.src / name) in state["error"], state["error"]
    assert not (node.cache / cache_name(source)).exists()
    assert cache_holding_secret(node) == []


def test_a_single_file_source_that_is_a_link_out_is_refused(node: Node, agent_module: ModuleType,
                                                            layout: Layout) -> None:
    """`fetch` refuses it at once; the worker, which copies later, refuses it again itself."""
    (layout.src / "alias.bin").symlink_to(layout.secret_outside)
    source = f"file://{layout.src / 'alias.bin'}"
    code, answer = node.run("fetch", {"source": source})
    assert code != 0 and answer["refused"] == {"setting": "local_sources"}, answer
    with pytest.raises(agent_module.FetchFailed, match="is a symlink that leads out of"):
        list(agent_module.local_files(str(layout.src / "alias.bin"), (str(node.root),)))
    assert cache_holding_secret(node) == []


def test_links_inside_the_allowed_directory_are_copied_as_their_content(node: Node) -> None:
    """A Hugging Face cache snapshot is all links into ../../blobs: those stay inside and are copied."""
    blobs = node.root / "hub" / "blobs"
    snap = node.root / "hub" / "snapshots" / "rev"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    (blobs / "aaa").write_bytes(b"A" * 300)
    (blobs / "bbb").write_bytes(b"B" * 200)
    (snap / "model.safetensors").symlink_to("../../blobs/aaa")
    (snap / "config.json").symlink_to(blobs / "bbb")  # absolute, still inside
    (snap / "hop").symlink_to("model.safetensors")  # a link to a link
    source = f"file://{snap}"
    state = settle(node, source)
    assert state["state"] == "done", state
    entry = node.cache / cache_name(source)
    assert (entry / "model.safetensors").read_bytes() == b"A" * 300
    assert (entry / "hop").read_bytes() == b"A" * 300
    assert (entry / "config.json").read_bytes() == b"B" * 200
    assert not any(p.is_symlink() for p in entry.iterdir())
    assert state["bytes_total"] == 800


def test_a_link_loop_is_refused_not_followed_forever(node: Node, layout: Layout) -> None:
    (layout.src / "a").symlink_to("b")
    (layout.src / "b").symlink_to("a")
    state = settle(node, f"file://{layout.src}")
    assert state["state"] == "failed" and "too many symlinks" in state["error"], state


def test_the_copy_reads_the_size_it_checked(agent_module: ModuleType, node: Node, layout: Layout) -> None:
    """local_files hands out the descriptor it checked; the roots are checked by the copy itself."""
    with pytest.raises(agent_module.FetchFailed, match="outside the directories"):
        list(agent_module.local_files(str(layout.secret_outside), (str(node.root),)))
    files = [(rel, info.st_size) for rel, _fd, info in agent_module.local_files(str(layout.src), (str(node.root),))]
    assert files == [("config.json", 2), ("weights.bin", 1000)]


# ---------------------------------------------------------------------------------------------
# The race: a user owning a directory inside local_sources swaps a file for a link to a root-only
# file while a root agent fetches it. The old agent checked the path, then opened it again.


def _swapper(home: Path, names: list[str], target: str) -> tuple[int, int, int]:
    """Fork a process that becomes `nobody` and, in its own directory home, swaps each
    model/<name> between a regular file and a link to target until told to stop (the new names
    are made in home/staging, so the fetch sees only the swapped names): (pid, stop pipe, count pipe)."""
    stop_r, stop_w = os.pipe()
    count_r, count_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child; only syscalls until os._exit
        code = 1
        try:
            os.close(stop_w)
            os.close(count_r)
            os.chdir(home)  # as root: the user cannot search the pytest tree above its directory
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            swaps = 0
            while True:
                for name in names:  # each state held a moment: a rename alone is over in microseconds
                    os.symlink(target, "staging/l")
                    os.link("staging/keep", "staging/f")
                    os.rename("staging/l", "model/" + name)
                    time.sleep(0.0002)
                    os.rename("staging/f", "model/" + name)
                    time.sleep(0.0002)
                    swaps += 1
                if select.select([stop_r], [], [], 0)[0]:
                    break
            os.write(count_w, str(swaps).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(stop_r)
    os.close(count_w)
    return pid, stop_w, count_r


@pytest.mark.slow
@pytest.mark.skipif(not ROOT, reason="the race needs a root agent and a second, unprivileged user")
def test_a_file_swapped_for_a_link_during_the_fetch_never_copies_the_link_target(node: Node, layout: Layout) -> None:
    home = node.root / "alice"
    owned = home / "model"
    (home / "staging").mkdir(parents=True)
    owned.mkdir()
    # Two swapped names copied after a larger file: the old agent checked every file, then
    # copied them in order, so the copy of the first one is the window.
    (owned / "a-large.bin").write_bytes(b"l" * (4 << 20))
    names = ["z-shard-1.bin", "z-shard-2.bin"]
    (home / "staging" / "keep").write_bytes(b"public weights\n" * 100)
    (home / "staging" / "keep").chmod(0o644)
    for name in names:
        os.link(home / "staging" / "keep", owned / name)
    for path in (home, home / "staging", owned, home / "staging" / "keep"):
        os.chown(path, NOBODY, NOBODY)
    source = f"file://{owned}"
    pid, stop_w, count_r = _swapper(home, names, str(layout.secret_outside))
    outcomes: list[str] = []
    try:
        for _ in range(25):
            state = settle(node, source)
            outcomes.append(state["state"] if state["state"] == "done" else state["error"])
            assert cache_holding_secret(node) == [], (len(outcomes), state)
            entry = node.cache / cache_name(source)
            if entry.exists():
                for path in entry.iterdir():
                    path.unlink()
                entry.rmdir()
    finally:
        os.close(stop_w)
        _, status = os.waitpid(pid, 0)
        swaps = int(os.read(count_r, 32) or b"0")
        os.close(count_r)
    assert os.waitstatus_to_exitcode(status) == 0 and swaps > 100, swaps
    # Every failure names a file of the source (a swap seen as a link or as a change), none is a crash.
    assert all(o == "done" or str(owned) in o for o in outcomes), outcomes
    assert cache_holding_secret(node) == []
