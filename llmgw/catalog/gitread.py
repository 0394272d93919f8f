"""Read catalog files from a commit's tree, never from a working tree.

The controller must judge exactly what was committed: a file edited but not committed
in the clone, or left over from a previous checkout, is not part of the desired state.
"""

from __future__ import annotations

from pathlib import Path

import git

from llmgw.catalog.loader import MAX_FILE_BYTES, RawFile, is_catalog_file
from llmgw.errors import GitError


def resolve_commit(repo: git.Repo, rev: str) -> git.Commit:
    """The commit ``rev`` names; GitError (not gitdb's BadName) when it names none."""
    try:
        return repo.commit(rev)
    except (git.GitError, git.BadName, git.BadObject, ValueError) as exc:
        raise GitError(f"cannot read {rev!r}: {exc}") from exc


def read_git_tree(repo: str | Path | git.Repo, rev: str, *, subdir: str = "") -> dict[str, RawFile]:
    """The catalog files in ``rev``'s tree under ``subdir``, keyed by path relative to it."""
    try:
        r = repo if isinstance(repo, git.Repo) else git.Repo(str(repo))
        commit = r.commit(rev)
        tree = commit.tree
        prefix = subdir.strip("/")
        if prefix:
            tree = tree / prefix
    except (git.GitError, git.BadName, git.BadObject, ValueError, KeyError) as exc:
        raise GitError(f"cannot read {rev!r}{' under ' + subdir if subdir else ''}: {exc}") from exc
    out = {}
    for item in tree.traverse():
        if item.type != "blob":
            continue
        rel = item.path[len(prefix) + 1:] if prefix else item.path
        if not is_catalog_file(rel):
            continue
        size = item.size
        # A huge blob is reported, not read: its size alone is the problem.
        data = b"" if size > MAX_FILE_BYTES else item.data_stream.read()
        out[rel] = RawFile(rel, data, size)
    return out
