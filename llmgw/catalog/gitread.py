"""Read catalog files from a commit's tree, never from a working tree.

The controller must judge exactly what was committed: a file edited but not committed
in the clone, or left over from a previous checkout, is not part of the desired state.
A symlink is a blob (mode 120000) whose content is its target's path; it is refused by
mode and its blob never read, so neither the target nor its path reaches an error message.
"""

from __future__ import annotations

import stat
from pathlib import Path

import git

from llmgw.catalog.loader import MAX_FILE_BYTES, MODELS_DIR, MODELS_DIR_SYMLINK, RawFile, is_catalog_file, refusal
from llmgw.errors import GitError


def resolve_commit(repo: git.Repo, rev: str) -> git.Commit:
    """The commit ``rev`` names; GitError (not gitdb's BadName) when it names none."""
    try:
        return repo.commit(rev)
    except (git.GitError, git.BadName, git.BadObject, ValueError) as exc:
        raise GitError(f"cannot read {rev!r}: {exc}") from exc


def read_git_tree(repo: str | Path | git.Repo, rev: str, *, subdir: str = "") -> dict[str, RawFile]:
    """The catalog files in ``rev``'s tree under ``subdir``, keyed by path relative to it.

    A catalog file that is not a regular blob (a symlink, a submodule) comes back refused
    with its content unread; so does a symlinked ``models`` directory.
    """
    prefix = subdir.strip("/")
    try:
        r = repo if isinstance(repo, git.Repo) else git.Repo(str(repo))
        tree = _subtree(r.commit(rev).tree, prefix, rev)
    except (git.GitError, git.BadName, git.BadObject, ValueError, KeyError) as exc:
        raise GitError(f"cannot read {rev!r}{' under ' + subdir if subdir else ''}: {exc}") from exc
    out = {}
    for item in tree.traverse():
        rel = item.path[len(prefix) + 1:] if prefix else item.path
        if rel == MODELS_DIR and stat.S_ISLNK(item.mode):
            out[rel] = RawFile(rel, b"", 0, refused=MODELS_DIR_SYMLINK)
            continue
        if item.type == "tree" or not is_catalog_file(rel):
            continue
        if reason := refusal(item.mode):
            out[rel] = RawFile(rel, b"", 0, refused=reason)
            continue
        size = item.size
        # A huge blob is reported, not read: its size alone is the problem.
        data = b"" if size > MAX_FILE_BYTES else item.data_stream.read()
        out[rel] = RawFile(rel, data, size)
    return out


def _subtree(tree: git.Tree, prefix: str, rev: str) -> git.Tree:
    """The tree at ``prefix``, walked one component at a time so a symlink on the way is named."""
    parts = [p for p in prefix.split("/") if p]
    for i, part in enumerate(parts):
        entry = tree / part
        if entry.type != "tree":
            where = "/".join(parts[: i + 1])
            what = "a symbolic link (symlinks are not followed)" if stat.S_ISLNK(entry.mode) else "not a directory"
            raise GitError(f"cannot read {rev!r} under {prefix}: {where} is {what}")
        tree = entry
    return tree
