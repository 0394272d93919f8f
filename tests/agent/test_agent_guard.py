"""remove-weights: the deletion guard (DESIGN §4).

Every test keeps a sentinel tree outside the cache (with a directory that looks exactly like a
valid cache entry, so a fooled guard would find something to delete) and checks that every file
of it, and every byte, is unchanged afterwards."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.agent.helpers import Node, cache_name, make_entry, own_start_time, snapshot

OUTSIDE_SOURCE = "hf://outside/model"


def build_outside(root: Path) -> Path:
    outside = root / "outside"
    (outside / "nested").mkdir(parents=True)
    (outside / "data.txt").write_text("precious")
    (outside / "nested" / "deep.bin").write_bytes(os.urandom(256))
    make_entry(outside, OUTSIDE_SOURCE)  # outside/llmgw-<hash>: a perfect decoy
    return outside



def record_running_engine(state: Path, replica_id: str, weights: Path) -> None:
    """An engine record whose process is alive: this very test process."""
    (state / "engines").mkdir(parents=True, exist_ok=True)
    record = {"replica_id": replica_id, "pid": os.getpid(), "pid_start": own_start_time(), "port": 1,
              "weights": str(weights), "started_at": 0, "log": ""}
    (state / "engines" / f"{replica_id}.json").write_text(json.dumps(record))


# Each case lays out the node and returns (the path to ask for, part of the expected reason).
Case = Callable[[Node], tuple[Any, str]]
H = cache_name(OUTSIDE_SOURCE)


def outside_of(node: Node) -> Path:
    return node.root / "outside"


def traversal(node: Node) -> tuple[Any, str]:
    return f"{node.cache}/../outside/{H}", "'..'"


def absolute_outside(node: Node) -> tuple[Any, str]:
    outside = outside_of(node)
    return str(outside / H), "not a direct child of the cache directory"


def symlink_entry(node: Node) -> tuple[Any, str]:
    outside = outside_of(node)
    (node.cache / H).symlink_to(outside / H)
    return str(node.cache / H), "is a symlink"


def cache_through_symlink(node: Node) -> tuple[Any, str]:
    outside = outside_of(node)
    (node.root / "cache-link").symlink_to(outside)
    node.write_config(cache_dir=str(node.root / "cache-link"))
    return str(node.root / "cache-link" / H), "reached through a symlink"


def path_through_symlink(node: Node) -> tuple[Any, str]:
    entry = make_entry(node.cache, "hf://org/aliased")
    (node.root / "alias").symlink_to(node.cache)
    return str(node.root / "alias" / entry.name), "passes through a symlink"


def not_a_cache_name(node: Node) -> tuple[Any, str]:
    make_entry(node.cache, "hf://org/m", name="my-model")
    return str(node.cache / "my-model"), "not a cache name"


def manifest_mismatch(node: Node) -> tuple[Any, str]:
    entry = make_entry(node.cache, "hf://org/a", manifest_source="hf://org/b")
    return str(entry), "manifest source does not hash to the entry name"


def no_manifest(node: Node) -> tuple[Any, str]:
    entry = node.cache / cache_name("hf://org/c")
    entry.mkdir()
    (entry / "weights.bin").write_bytes(b"w")
    return str(entry), "no readable manifest"


def manifest_is_a_symlink(node: Node) -> tuple[Any, str]:
    outside = outside_of(node)
    entry = node.cache / H
    entry.mkdir()
    (entry / "llmgw-manifest.json").symlink_to(outside / H / "llmgw-manifest.json")
    return str(entry), "no readable manifest"


def a_file(node: Node) -> tuple[Any, str]:
    (node.cache / H).write_text("not a directory")
    return str(node.cache / H), "not a directory"


def inside_an_entry(node: Node) -> tuple[Any, str]:
    entry = make_entry(node.cache, "hf://org/d")
    return str(entry / "weights.bin"), "not a direct child"


def in_use(node: Node) -> tuple[Any, str]:
    entry = make_entry(node.cache, "hf://org/used")
    record_running_engine(node.state, "user-0", entry)
    return str(entry), "in use by running engine user-0"


def relative(node: Node) -> tuple[Any, str]:
    make_entry(node.cache, "hf://org/rel")
    return f"cache/{cache_name('hf://org/rel')}", "not absolute"


def empty(_node: Node) -> tuple[Any, str]:
    return "", "empty"


def nul_byte(node: Node) -> tuple[Any, str]:
    entry = make_entry(node.cache, "hf://org/nul")
    return f"{entry}\0/../../outside", "NUL"


def not_a_string(node: Node) -> tuple[Any, str]:
    return {"path": str(node.cache)}, "not a string"


def missing(node: Node) -> tuple[Any, str]:
    return str(node.cache / cache_name("hf://never/fetched")), "does not exist"


CASES: list[Case] = [traversal, absolute_outside, symlink_entry, cache_through_symlink, path_through_symlink,
                     not_a_cache_name, manifest_mismatch, no_manifest, manifest_is_a_symlink, a_file,
                     inside_an_entry, in_use, relative, empty, nul_byte, not_a_string, missing]


@pytest.mark.parametrize("case", CASES, ids=[c.__name__ for c in CASES])
def test_guard_refuses_and_touches_nothing(node: Node, agent_module: ModuleType, case: Case) -> None:
    build_outside(node.root)
    path, reason = case(node)
    before = snapshot(node.root, skip=(node.state,))
    answer = agent_module.run_verb("remove-weights", str(node.config), {"paths": [path]})
    [result] = answer["results"]
    assert result["path"] == path and result["removed"] is False
    assert reason in result["reason"]
    assert snapshot(node.root, skip=(node.state,)) == before


def test_guard_end_to_end_refuses_each_path_with_its_reason_and_removes_the_valid_one(node: Node) -> None:
    """One real agent call: the hostile paths, a running engine's weights, and one removable entry."""
    outside = build_outside(node.root)
    (node.cache / H).symlink_to(outside / H)
    used = make_entry(node.cache, "hf://org/used")
    node.ok("start", {"replica_id": "user", "engine": "pysleep", "weights": used.name})
    unused = make_entry(node.cache, "hf://org/unused")
    (unused / "sub").mkdir()
    (unused / "sub" / "link-out").symlink_to(outside / "data.txt")  # unlinked, never followed
    (unused / "link-dir").symlink_to(outside)
    paths = [f"{node.cache}/../outside/{H}", str(outside / H), str(node.cache / H), str(used), "cache/x", "",
             "a\0b", 7, str(unused), str(unused) + "/"]
    protected = snapshot(node.root, skip=(node.state, unused))

    results = node.ok("remove-weights", {"paths": paths})["results"]
    inventory = node.ok("inventory")

    assert [r["path"] for r in results] == paths
    assert [r["removed"] for r in results] == [False] * 8 + [True, False]
    assert [r["reason"].split(" (")[0] for r in results if not r["removed"]] == [
        "path contains '..' components", f"not a direct child of the cache directory {node.cache}",
        "path is a symlink", "in use by running engine user", "path is not absolute", "path is empty",
        "path contains a NUL byte", "path is not a string", "already removed"]
    assert not unused.exists()
    assert snapshot(node.root, skip=(node.state,)) == protected
    assert not [p for p in node.cache.iterdir() if p.name.startswith(".trash-")]
    [engine] = inventory["engines"]
    [weights] = [w for w in inventory["weights"] if w["path"] == str(used)]
    assert engine["weights"] == str(used) and weights["last_used"] >= engine["started_at"] - 1
    node.ok("stop", {"replica_id": "user", "grace_seconds": 1})
    # Once its engine is gone the entry may go too.
    assert node.ok("remove-weights", {"paths": [str(used)]})["results"] == [{"path": str(used), "removed": True}]


def test_remove_weights_needs_a_list_of_paths(node: Node, agent_module: ModuleType) -> None:
    _, error = node.fail("remove-weights", {"paths": "/var/cache/llmgw-x"})
    assert "paths must be a list" in error
    with pytest.raises(agent_module.AgentError, match="missing field 'paths'"):
        agent_module.run_verb("remove-weights", str(node.config), {})


@pytest.mark.parametrize("swap", ["symlink", "other-directory", "cache-dir"])
def test_swap_between_check_and_rename_deletes_nothing_it_did_not_check(
        node: Node, agent_module: ModuleType, monkeypatch: pytest.MonkeyPatch, swap: str) -> None:
    outside = build_outside(node.root)
    entry = make_entry(node.cache, OUTSIDE_SOURCE)  # same name as the decoy outside
    other = make_entry(node.cache, "hf://org/other", name="operator-dir")
    real_rename = os.rename
    swapped = []

    def racing_rename(src: Any, dst: Any, **kwargs: Any) -> None:
        if not swapped:  # the attacker strikes after the checks, before the guard's rename
            swapped.append(swap)
            if swap == "symlink":
                real_rename(entry, node.root / "moved-away")
                os.symlink(outside / H, entry)
            elif swap == "other-directory":
                real_rename(entry, node.root / "moved-away")
                real_rename(other, entry)
            else:
                real_rename(node.cache, node.root / "moved-cache")
                os.symlink(outside, node.cache)
        real_rename(src, dst, **kwargs)

    monkeypatch.setattr(os, "rename", racing_rename)
    outside_before = snapshot(outside)
    [result] = agent_module.run_verb("remove-weights", str(node.config), {"paths": [str(entry)]})["results"]
    monkeypatch.undo()

    assert swapped == [swap]
    assert snapshot(outside) == outside_before
    if swap == "cache-dir":
        # The rename and the delete go through the descriptor of the directory that was checked:
        # the checked entry goes, in the real cache dir, and nothing is done through the link.
        assert result["removed"] is True
        assert not (node.root / "moved-cache" / H).exists()
    else:
        assert result["removed"] is False and "swapped" in result["reason"]
        assert os.path.lexists(entry)  # put back where it was found
        assert (node.root / "moved-away" / "weights.bin").exists()
        if swap == "other-directory":
            assert (entry / "weights.bin").exists()
        assert not [p for p in node.cache.iterdir() if p.name.startswith(".trash-")]


def test_move_to_trash_rechecks_what_it_renamed(node: Node, agent_module: ModuleType) -> None:
    entry = make_entry(node.cache, "hf://org/a")
    checked_other = os.lstat(make_entry(node.cache, "hf://org/b"))
    fd = os.open(node.cache, os.O_RDONLY | os.O_DIRECTORY)
    try:
        trash, reason = agent_module.move_to_trash(fd, entry.name, checked_other)
    finally:
        os.close(fd)
    assert trash is None and "swapped" in reason
    assert (entry / "weights.bin").exists()


def test_rmtree_at_unlinks_links_and_never_follows_them(tmp_path: Path, agent_module: ModuleType) -> None:
    root = tmp_path.resolve()
    outside = build_outside(root)
    doomed = root / "doomed"
    (doomed / "a" / "b").mkdir(parents=True)
    (doomed / "a" / "b" / "f").write_text("x")
    (doomed / "a" / "to-outside").symlink_to(outside)
    (doomed / "to-file").symlink_to(outside / "data.txt")
    before = snapshot(outside)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        agent_module.rmtree_at(fd, "doomed")
    finally:
        os.close(fd)
    assert not doomed.exists()
    assert snapshot(outside) == before


# ----------------------------------------------------------------------------------------------
# Property: whatever the tree and whatever the paths, only owned, valid, unused entries go.

KINDS = ["valid", "in_use", "bad_hash", "no_manifest", "manifest_link", "foreign_dir", "foreign_file",
         "link_out", "link_in", "file_like_entry"]
VARIANTS = ["exact", "slash", "dot", "double", "dotdot", "relative", "alias", "child", "nul", "outside"]
ACCEPTED_VARIANTS = {"exact", "slash", "dot", "double"}  # spellings of the same absolute path
ODD_PATHS: list[Any] = ["", "/", None, 42, ["x"], "/etc/passwd", "cache", "//", "/.."]


def lay_out(root: Path, kinds: list[str]) -> tuple[Path, dict[int, str]]:
    """The cache under root per kinds; returns the cache dir and the name of each entry."""
    cache, outside, state = root / "cache", root / "outside", root / "state"
    cache.mkdir()
    (outside / "nested").mkdir(parents=True)
    (outside / "data.txt").write_text("precious")
    (root / "alias").symlink_to(cache)
    names: dict[int, str] = {}
    for i, kind in enumerate(kinds):
        source = f"hf://org/m{i}"
        name = names[i] = cache_name(source) if kind not in ("foreign_dir", "foreign_file") else f"model-{i}"
        if kind in ("valid", "in_use", "bad_hash"):
            entry = make_entry(cache, source, manifest_source=source + "x" if kind == "bad_hash" else None)
            if kind == "in_use":
                record_running_engine(state, f"r{i}", entry)
        elif kind in ("no_manifest", "manifest_link", "foreign_dir"):
            (cache / name).mkdir()
            (cache / name / "weights.bin").write_text("w")
            if kind == "manifest_link":
                decoy = make_entry(outside, source, name=f"decoy-{i}")
                (cache / name / "llmgw-manifest.json").symlink_to(decoy / "llmgw-manifest.json")
        elif kind == "foreign_file":
            (cache / name).write_text("notes")
        elif kind == "link_out":
            (cache / name).symlink_to(make_entry(outside, source))
        elif kind == "link_in":
            (cache / name).symlink_to(make_entry(cache, source, name=f"target-{i}"))
        else:
            (cache / name).write_text("a file with an entry's name")
    return cache, names


def spell(root: Path, name: str, variant: str) -> str:
    exact = f"{root}/cache/{name}"
    return {
        "exact": exact, "slash": exact + "/", "dot": f"{root}/cache/./{name}", "double": f"{root}/cache//{name}",
        "dotdot": f"{root}/cache/../cache/{name}", "relative": exact.lstrip("/"), "alias": f"{root}/alias/{name}",
        "child": exact + "/weights.bin", "nul": exact + "\0", "outside": f"{root}/outside/{name}",
    }[variant]


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    # Weighted towards valid entries asked for by a good spelling, so removals happen often and
    # the property is not won by a guard that refuses everything (the liveness check below).
    kinds=st.lists(st.sampled_from(KINDS + ["valid"] * 4), min_size=1, max_size=6),
    picks=st.lists(st.tuples(st.integers(0, 5), st.sampled_from(VARIANTS + ["exact"] * 4 + ["slash", "dot"])),
                   max_size=10),
    odd=st.lists(st.sampled_from(ODD_PATHS), max_size=2),
)
def test_property_only_owned_valid_unused_entries_ever_disappear(
        agent_module: ModuleType, kinds: list[str], picks: list[tuple[int, str]], odd: list[Any]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(os.path.realpath(tmp))
        cache, names = lay_out(root, kinds)
        config = root / "agent.json"
        config.write_text(json.dumps({"cache_dir": str(cache), "state_dir": str(root / "state"),
                                      "port_range": [1, 2], "advertise_address": "127.0.0.1", "engines": {}}))
        paths: list[Any] = [spell(root, names[i % len(kinds)], v) for i, v in picks] + odd
        removable = {names[i] for i, kind in enumerate(kinds) if kind == "valid"}
        before = snapshot(root, skip=(root / "state",))

        results = agent_module.run_verb("remove-weights", str(config), {"paths": paths})["results"]

        after = snapshot(root, skip=(root / "state",))
        assert [r["path"] for r in results] == paths
        assert set(after) <= set(before), "nothing new (no trash) is left behind"
        for rel, fingerprint in before.items():
            if rel in after:
                assert after[rel] == fingerprint, f"{rel} changed"
            else:
                parts = rel.split("/")
                assert parts[0] == "cache" and parts[1] in removable, f"{rel} disappeared"
        event("removed some" if any(r["removed"] for r in results) else "removed none")  # --hypothesis-show-statistics
        for (i, variant), result in zip(picks, results[: len(picks)], strict=True):
            name = names[i % len(kinds)]
            if result["removed"]:
                assert name in removable and variant in ACCEPTED_VARIANTS
            if name in removable and variant in ACCEPTED_VARIANTS:
                assert not (cache / name).exists(), f"{name} was valid, unused and asked for"
