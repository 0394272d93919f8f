"""A real git remote (bare repository) and a person's clone that pushes to it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from llmgw.gitops import DesiredState, GitMirror, GitOpsFollower, Store
from tests.catalog.corpus import write_catalog
from tests.conftest import commit_files, git


@dataclass
class Remote:
    bare: Path
    clone: Path

    def commit(self, files: dict[str, str | None], message: str, *, author: str | None = None) -> str:
        """Write (None: delete) files in the clone, commit, push; the new sha."""
        commit_files(self.clone, files, message, author=author)
        git(self.clone, "push", "-q", "origin", "HEAD:main")
        return git(self.clone, "rev-parse", "HEAD")

    def force_push(self, sha: str) -> None:
        git(self.clone, "reset", "-q", "--hard", sha)
        git(self.clone, "push", "-q", "--force", "origin", "HEAD:main")


@pytest.fixture
def remote(tmp_path: Path) -> Remote:
    bare = tmp_path / "remote.git"
    git(tmp_path, "init", "-q", "--bare", "-b", "main", str(bare))
    clone = tmp_path / "person"
    clone.mkdir()
    git(clone, "init", "-q", "-b", "main")
    git(clone, "remote", "add", "origin", str(bare))
    write_catalog(clone)
    git(clone, "add", "-A")
    git(clone, "commit", "-q", "-m", "Initial catalog")
    git(clone, "push", "-q", "origin", "HEAD:main")
    return Remote(bare, clone)


def make_follower(remote: Remote, data: Path, desired: DesiredState | None = None, **kw) -> GitOpsFollower:
    store = Store(data / "state.db").open()
    mirror = GitMirror(str(remote.bare), "main", data / "mirror.git")
    return GitOpsFollower(mirror, desired or DesiredState(), store, **{"interval": 60.0, **kw})
