"""The agent against a tampered controller (and a hostile local layout): each test is an attack
that once worked, or hung the node, and must now be refused or survived."""

from __future__ import annotations

import http.server
import io
import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.agent.helpers import AGENT, Node, cache_name, make_entry, snapshot

OUTSIDE_SOURCE = "hf://outside/model"


def _outside(root: Path) -> Path:
    outside = root / "outside"
    (outside / "nested").mkdir(parents=True)
    (outside / "data.txt").write_text("precious")
    (outside / "nested" / "deep.bin").write_bytes(os.urandom(256))
    return outside


# ---------------------------------------------------------------------------------------------
# remove-weights


def test_a_fifo_manifest_is_refused_instead_of_hanging_the_node(node: Node) -> None:
    """open() of a FIFO blocks until a writer comes: the guard held the engines lock meanwhile."""
    entry = node.cache / cache_name("hf://org/fifo")
    entry.mkdir()
    os.mkfifo(entry / "llmgw-manifest.json")
    argv = [sys.executable, str(AGENT), "--config", str(node.config), "remove-weights"]
    proc = subprocess.run(argv, input=json.dumps({"paths": [str(entry)]}).encode(), capture_output=True,
                          timeout=10, env=node.env(), check=False)
    assert proc.returncode == 0, proc.stderr
    [result] = json.loads(proc.stdout)["results"]
    assert result["removed"] is False and "manifest" in result["reason"]
    assert entry.is_dir()
    argv[-1] = "inventory"
    proc = subprocess.run(argv, input=b"{}", capture_output=True, timeout=10, env=node.env(), check=False)
    assert proc.returncode == 0, proc.stderr
    assert [i["path"] for i in json.loads(proc.stdout)["invalid_weights"]] == [str(entry)]


def test_a_huge_manifest_is_refused(node: Node, agent_module: ModuleType) -> None:
    source = "hf://org/huge"
    entry = make_entry(node.cache, source)
    manifest = {"source": source, "padding": "x" * (agent_module.MAX_MANIFEST_BYTES + 10)}
    (entry / "llmgw-manifest.json").write_text(json.dumps(manifest))
    [result] = agent_module.run_verb("remove-weights", str(node.config), {"paths": [str(entry)]})["results"]
    assert result["removed"] is False and "manifest" in result["reason"]
    assert entry.is_dir()


def test_an_unencodable_path_is_refused_on_its_own_and_the_rest_still_happens(node: Node) -> None:
    """A lone surrogate once raised in the middle of the list: the whole call failed and the
    entries already renamed aside stayed in the cache as .trash-… forever."""
    first = make_entry(node.cache, "hf://org/first")
    paths = [str(first), f"{node.cache}/llmgw-\ud800", str(make_entry(node.cache, "hf://org/last"))]
    results = node.ok("remove-weights", {"paths": paths})["results"]
    assert [r["removed"] for r in results] == [True, False, True]
    assert "encoded" in results[1]["reason"]
    assert list(node.cache.iterdir()) == []


def test_a_newline_after_a_cache_name_is_not_a_cache_name(agent_module: ModuleType) -> None:
    name = cache_name("hf://org/nl")
    assert agent_module.CACHE_NAME_RE.match(name)
    assert not agent_module.CACHE_NAME_RE.match(name + "\n")
    assert not agent_module.REPLICA_ID_RE.match("replica\n")


def test_a_directory_swapped_in_only_for_the_manifest_read_is_not_what_gets_deleted(
        node: Node, agent_module: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """The attacker shows the guard its own directory (no manifest) for the stat, a valid entry
    for the manifest read, and its own directory again for the rename."""
    source = "hf://org/swap"
    name = cache_name(source)
    victim = node.cache / name
    victim.mkdir()
    (victim / "operator-data.bin").write_text("keep me")  # cache-named, but not a complete entry
    valid = make_entry(node.root / "elsewhere", source)
    parked = node.root / "parked"
    real_open, real_rename = os.open, os.rename
    swaps: list[str] = []

    def racing_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if path == name and kwargs.get("dir_fd") is not None and not swaps:
            swaps.append("valid in")
            real_rename(victim, parked)
            real_rename(valid, victim)
        return real_open(path, flags, *args, **kwargs)

    def racing_rename(src: Any, dst: Any, **kwargs: Any) -> None:
        if swaps == ["valid in"]:
            swaps.append("victim back")
            real_rename(victim, valid)
            real_rename(parked, victim)
        real_rename(src, dst, **kwargs)

    monkeypatch.setattr(os, "open", racing_open)
    monkeypatch.setattr(os, "rename", racing_rename)
    [result] = agent_module.run_verb("remove-weights", str(node.config), {"paths": [str(victim)]})["results"]
    monkeypatch.undo()
    if swaps == ["valid in"]:  # refused before its rename: the attacker puts things back itself
        real_rename(victim, valid)
        real_rename(parked, victim)
    assert swaps and result["removed"] is False, result
    assert (victim / "operator-data.bin").read_text() == "keep me"


def _unshare_mount_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, check=False)
    return probe.returncode == 0


needs_mounts = pytest.mark.skipif(not _unshare_mount_works(), reason="needs unshare -m (mount namespaces)")


@needs_mounts
def test_a_bind_mount_inside_an_entry_is_not_emptied(node: Node) -> None:
    """O_NOFOLLOW stops at links, not at mounts: the walk once deleted whatever was mounted inside."""
    outside = _outside(node.root)
    entry = make_entry(node.cache, "hf://org/mounted")
    (entry / "sub").mkdir()
    before = snapshot(outside)
    script = ('mount --bind "$1" "$2" && exec "$3" "$4" --config "$5" remove-weights')
    argv = ["unshare", "-m", "sh", "-c", script, "sh", str(outside), str(entry / "sub"), sys.executable, str(AGENT),
            str(node.config)]
    proc = subprocess.run(argv, input=json.dumps({"paths": [str(entry)]}).encode(), capture_output=True,
                          timeout=20, env=node.env(PATH=os.environ["PATH"]), check=False)
    assert proc.returncode == 0, proc.stderr
    [result] = json.loads(proc.stdout)["results"]
    assert result["removed"] is False and "mount point" in result["reason"]
    assert snapshot(outside) == before


@needs_mounts
def test_the_deletion_walk_does_not_cross_into_another_filesystem(tmp_path: Path) -> None:
    """A mount appearing after the check (the table said none) still stops the walk."""
    root = tmp_path.resolve()
    tree = root / "tree"
    (tree / "mnt").mkdir(parents=True)
    code = (
        "import importlib.util, os, pathlib, sys\n"
        f"spec = importlib.util.spec_from_file_location('agent', {str(AGENT)!r})\n"
        "agent = importlib.util.module_from_spec(spec); sys.modules['agent'] = agent; spec.loader.exec_module(agent)\n"
        f"pathlib.Path({str(tree / 'mnt' / 'precious')!r}).write_text('keep')\n"
        f"fd = os.open({str(root)!r}, os.O_RDONLY | os.O_DIRECTORY)\n"
        "try:\n"
        "    agent.rmtree_at(fd, 'tree')\n"
        "except OSError as exc:\n"
        "    print('refused', exc)\n"
        f"print(pathlib.Path({str(tree / 'mnt' / 'precious')!r}).read_text())\n"
    )
    script = 'mount -t tmpfs none "$1" && exec "$2" -c "$3"'
    argv = ["unshare", "-m", "sh", "-c", script, "sh", str(tree / "mnt"), sys.executable, code]
    proc = subprocess.run(argv, capture_output=True, timeout=20, check=False, text=True)
    if "mount" in proc.stderr and proc.returncode != 0:
        pytest.skip(f"tmpfs cannot be mounted here: {proc.stderr}")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("refused") and proc.stdout.rstrip().endswith("keep"), proc.stdout


# ---------------------------------------------------------------------------------------------
# start


@pytest.mark.parametrize("name", [
    "HOME", "SHELLOPTS", "BASHOPTS", "PS4", "OPENSSL_CONF", "CUDA_INJECTION64_PATH", "NVTX_INJECTION64_PATH",
    "JAVA_TOOL_OPTIONS", "PYTHONPYCACHEPREFIX", "PYTHONBREAKPOINT", "ZDOTDIR", "GIT_SSH_COMMAND", "LUA_INIT",
])
def test_start_refuses_env_that_loads_code_of_the_callers_choosing(node: Node, name: str) -> None:
    _, error = node.fail("start", {"replica_id": "r", "engine": "pyecho", "env": {name: "/x"}})
    assert f"env {name} is not allowed on this node" in error and "env_allow" in error
    assert not (node.state / "engines" / "r.json").exists()


def test_home_pointing_at_a_fetched_entry_cannot_run_its_pth_file(node: Node) -> None:
    """Python's user site is ~/.local/lib/pythonX.Y/site-packages and runs its .pth files: a
    fetched entry laid out that way turned any Python engine into the caller's program."""
    entry = make_entry(node.cache, "hf://attacker/home")
    marker = node.root / "pwned"
    site = entry / ".local" / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    site.mkdir(parents=True)
    (site / "evil.pth").write_text(f"import pathlib; pathlib.Path({str(marker)!r}).write_text('x')\n")
    # Outside a venv (a venv turns the user site off), as a node's own Python would run.
    python = Path(sys.base_prefix) / "bin" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    if not python.exists():
        pytest.skip(f"no base interpreter at {python}")
    node.write_config(engines={**node.settings["engines"], "syspy": [str(python), "-c", "print('up')"]})
    node.run("start", {"replica_id": "home", "engine": "syspy", "env": {"HOME": str(entry)}})
    node.ok("stop", {"replica_id": "home", "grace_seconds": 1})
    assert not marker.exists()


# ---------------------------------------------------------------------------------------------
# fetch


@pytest.fixture
def one_file_server() -> Iterator[str]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the name http.server calls
            body = b"weights" * 100
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002, ARG002 - silence
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("planted", ["tmp-dir-link", "file-link"])
def test_an_http_fetch_never_writes_through_a_link_planted_in_its_temporary_dir(
        node: Node, one_file_server: str, planted: str) -> None:
    outside = _outside(node.root)
    before = snapshot(outside)
    source = f"{one_file_server}/data.txt"
    tmp = node.cache / (".tmp-" + cache_name(source))
    if planted == "tmp-dir-link":
        tmp.symlink_to(outside)
    else:
        tmp.mkdir()
        (tmp / "data.txt").symlink_to(outside / "data.txt")
    answer = node.fetch_until_done(source)
    assert snapshot(outside) == before
    assert (Path(answer["path"]) / "data.txt").read_bytes() == b"weights" * 100
    assert not (Path(answer["path"]) / "data.txt").is_symlink()


def test_a_source_that_is_not_valid_unicode_is_refused(node: Node) -> None:
    _, error = node.fail("fetch", {"source": "/models/\ud800"})
    assert error == "fetch: source is not valid Unicode text"


# ---------------------------------------------------------------------------------------------
# serve


def _serve(agent_module: ModuleType, node: Node, data: bytes) -> list[dict[str, Any]]:
    out = io.BytesIO()
    assert agent_module.serve(str(node.config), io.BytesIO(data), out) == 0
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_serve_answers_a_line_nested_too_deep_and_carries_on(node: Node, agent_module: ModuleType) -> None:
    """A RecursionError once killed the worker thread silently: the line got no answer at all."""
    data = b"[" * 200_000 + b"\n" + json.dumps({"id": 2, "verb": "hello"}).encode() + b"\n"
    replies = _serve(agent_module, node, data)
    assert sorted(str(r["id"]) for r in replies) == ["2", "None"]
    assert "bad request line" in next(r for r in replies if r["id"] is None)["error"]


def test_serve_refuses_an_overlong_line_without_reading_it_whole(
        node: Node, agent_module: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agent_module, "SERVE_MAX_LINE", 1000)
    monkeypatch.setattr(agent_module, "CHUNK", 100)
    long_line = json.dumps({"id": 1, "verb": "hello", "request": {"pad": "x" * 5000}}).encode()
    data = long_line + b"\n" + json.dumps({"id": 2, "verb": "hello"}).encode() + b"\n" + b"y" * 3000
    replies = _serve(agent_module, node, data)
    # Answers come in the order they finish; the refusals are written by the reader itself.
    assert sorted(str(r["id"]) for r in replies) == ["2", "None", "None"]
    assert all("longer than 1000 bytes" in r["error"] for r in replies if r["id"] is None)
    assert next(r for r in replies if r["id"] == 2)["answer"]["protocol"] == 1
