"""The commit writer: model changes through the API become commits, pushed to the remote."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from llmgw.errors import CatalogError, PushRejected
from llmgw.gitops import CommitWriter
from tests.catalog.corpus import SMALL
from tests.conftest import git
from tests.gitops.conftest import Remote


def model(name: str) -> str:
    return SMALL.replace("name: small", f"name: {name}").replace("[tiny]", f"[{name}-alias]")


def remote_files(remote: Remote) -> list[str]:
    return git(remote.bare, "ls-tree", "-r", "--name-only", "main").split()


def test_add_commits_with_the_actor_as_author_and_pushes(remote: Remote, tmp_path: Path) -> None:
    writer = CommitWriter(str(remote.bare), "main", tmp_path / "writer")
    sha = writer.add_model(model("qwen"), "Alice <alice@example.com>")
    assert git(remote.bare, "rev-parse", "main") == sha
    assert git(remote.bare, "log", "-1", "--format=%an <%ae>|%s", "main") == "Alice <alice@example.com>|Add model qwen"
    assert "models/qwen.yaml" in remote_files(remote)

    sha = writer.remove_model("qwen", "bob")
    assert git(remote.bare, "log", "-1", "--format=%an|%s", "main") == "bob|Remove model qwen"
    assert "models/qwen.yaml" not in remote_files(remote)


def test_an_invalid_model_is_refused_and_nothing_is_committed(remote: Remote, tmp_path: Path) -> None:
    before = git(remote.bare, "rev-parse", "main")
    writer = CommitWriter(str(remote.bare), "main", tmp_path / "writer")
    with pytest.raises(CatalogError) as err:
        writer.add_model(model("qwen").replace("engine: vllm", "engine: vlm"), "alice")
    # Line 12: the schema comment the writer puts on line 1 moves the text down one.
    assert [str(p) for p in err.value.problems] == [
        'models/qwen.yaml:12:5: profiles[0].engine: string "vlm" is not one of: vllm, sglang, llama.cpp, sim'
    ]
    with pytest.raises(CatalogError, match='model "small" is already in the catalog'):
        writer.add_model(model("small"), "alice")
    with pytest.raises(CatalogError, match='model "nope" is not in the catalog'):
        writer.remove_model("nope", "alice")
    assert git(remote.bare, "rev-parse", "main") == before


def test_two_actors_at_the_same_time_both_land(remote: Remote, tmp_path: Path) -> None:
    # Two writers with their own clones (two controllers, or a controller and a person):
    # whichever pushes second finds the branch moved, rebases, and pushes again.
    writers = [CommitWriter(str(remote.bare), "main", tmp_path / f"writer-{i}") for i in range(2)]
    for w in writers:
        w._sync_clone()  # both start from the same base
    barrier = threading.Barrier(len(writers) * 2)
    errors: list[BaseException] = []

    def add(writer: CommitWriter, name: str) -> None:
        try:
            barrier.wait(timeout=10)
            writer.add_model(model(name), name)
        except BaseException as exc:  # noqa: BLE001 - surfaced by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=add, args=(w, f"{n}-{i}"))
               for i, w in enumerate(writers) for n in ("alpha", "beta")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == []
    files = remote_files(remote)
    for name in ("alpha-0", "beta-0", "alpha-1", "beta-1"):
        assert f"models/{name}.yaml" in files
    subjects = git(remote.bare, "log", "--format=%s", "main").splitlines()
    assert sorted(subjects[:4]) == ["Add model alpha-0", "Add model alpha-1", "Add model beta-0", "Add model beta-1"]


def test_a_remote_that_refuses_pushes_says_to_push_to_git_instead(remote: Remote, tmp_path: Path) -> None:
    hook = remote.bare / "hooks" / "pre-receive"
    hook.write_text("#!/bin/sh\necho 'this mirror is read-only' >&2\nexit 1\n")
    hook.chmod(0o755)
    before = git(remote.bare, "rev-parse", "main")
    writer = CommitWriter(str(remote.bare), "main", tmp_path / "writer")
    with pytest.raises(PushRejected, match="push the change to git instead") as err:
        writer.add_model(model("qwen"), "alice")
    assert "read-only" in str(err.value)
    assert git(remote.bare, "rev-parse", "main") == before
