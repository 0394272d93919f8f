"""Adding or removing a model through the API writes a commit, so git stays the truth.

The change is made in the controller's own working clone, validated as a whole catalog
before anything is committed, committed with the caller as author, and pushed. When
someone pushed first, the commit is rebased onto theirs, validated again, and pushed
again. When the remote cannot be pushed to at all, the caller is told to push the change
to git instead: the controller never keeps a change git does not have.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any

import yaml

from llmgw.catalog import read_directory, validate_files
from llmgw.errors import CatalogError, GitError, PushRejected
from llmgw.gitops.gitcli import GIT_TIMEOUT, forget_origin_url, origin_env, run_git
from llmgw.gitops.repo import normalise_url
from llmgw.redact import redact

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")
_ACTOR = re.compile(r"^\s*(?P<name>[^<>]+?)\s*<(?P<email>[^<>\s]+)>\s*$")
HEADER = "# yaml-language-server: $schema=../schemas/model.schema.json\n"
COMMITTER = {"GIT_COMMITTER_NAME": "llmgw controller", "GIT_COMMITTER_EMAIL": "controller@llmgw.invalid"}


def _author(actor: str) -> tuple[str, str]:
    actor = (actor or "").strip() or "anonymous"
    m = _ACTOR.match(actor)
    if m:
        return m.group("name"), m.group("email")
    safe = re.sub(r"[^A-Za-z0-9._-]", "-", actor)[:64] or "anonymous"
    return actor[:128], f"{safe}@llmgw.invalid"


def model_file_name(name: str) -> str:
    """``models/<name>.yaml``; a name with ``/`` or ``:`` (an HF-style id) is flattened."""
    return "models/" + re.sub(r"[/:]", "_", name) + ".yaml"


class CommitWriter:
    """Writes model changes as commits to ``branch`` of ``url`` from a clone at ``path``."""

    def __init__(
        self, url: str, branch: str, path: Path, *, subdir: str = "", attempts: int = 5,
        env: dict[str, str] | None = None,
    ) -> None:
        self.url = normalise_url(url)
        self.branch = branch
        self.path = Path(path)
        self.subdir = subdir.strip("/")
        self.attempts = attempts
        self.env = env or {}
        self._lock = threading.Lock()

    @property
    def catalog_dir(self) -> Path:
        return self.path / self.subdir if self.subdir else self.path

    def add_model(self, definition: dict[str, Any] | str, actor: str) -> str:
        """Commit a new model file and push it; the new commit's sha."""
        try:
            data = yaml.safe_load(definition) if isinstance(definition, str) else definition
        except yaml.YAMLError as exc:
            raise CatalogError(f"the model definition is not valid YAML: {exc}") from exc
        if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not _NAME.match(data["name"]):
            raise CatalogError("a model definition must be a mapping with a valid \"name\"")
        name = data["name"]
        text = definition if isinstance(definition, str) else HEADER + yaml.safe_dump(data, sort_keys=False)
        if not text.startswith("# yaml-language-server"):
            text = HEADER + text

        def change() -> str:
            current = validate_files(read_directory(self.catalog_dir))
            if current.catalog is not None and current.catalog.resolve(name) is not None:
                raise CatalogError(f'model "{name}" is already in the catalog')
            target = self.catalog_dir / model_file_name(name)
            if target.exists():
                raise CatalogError(f"{model_file_name(name)} already exists")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text, encoding="utf-8")
            return f"Add model {name}"

        return self._commit(change, actor)

    def remove_model(self, name: str, actor: str) -> str:
        """Commit the removal of the file defining ``name`` and push it; the new commit's sha."""

        def change() -> str:
            current = validate_files(read_directory(self.catalog_dir))
            if current.catalog is None:
                raise CatalogError("the catalog on the branch is invalid; fix it in git first", current.problems)
            model = current.catalog.model(name)
            if model is None:
                raise CatalogError(f'model "{name}" is not in the catalog')
            (self.catalog_dir / model.file).unlink()
            return f"Remove model {name}"

        return self._commit(change, actor)

    # --- mechanics --------------------------------------------------------------------
    def _git(self, *args: str, env: dict[str, str] | None = None, timeout: float = GIT_TIMEOUT) -> str:
        # The remote's URL is given to each command, never stored in the clone (see origin_env).
        return run_git(list(args), cwd=self.path, env=origin_env(self.url, {**self.env, **(env or {})}),
                       timeout=timeout)

    def _sync_clone(self) -> str:
        """Fresh state of the branch in the private clone; the remote head sha."""
        if not (self.path / ".git").exists():
            self.path.mkdir(parents=True, exist_ok=True)
            run_git(["init", "-q", str(self.path)])
        else:
            forget_origin_url(self.path)
        self._git("fetch", "-q", "origin", f"+refs/heads/{self.branch}:refs/remotes/origin/{self.branch}",
                  timeout=GIT_TIMEOUT * 2)
        self._git("checkout", "-q", "-B", self.branch, f"origin/{self.branch}")
        self._git("reset", "-q", "--hard", f"origin/{self.branch}")
        self._git("clean", "-qfdx")
        return self._git("rev-parse", "HEAD").strip()

    def _validate_worktree(self) -> None:
        result = validate_files(read_directory(self.catalog_dir))
        if result.catalog is None:
            raise CatalogError(
                f"the change would make the catalog invalid ({len(result.problems)} problem(s)); nothing committed",
                result.problems,
            )

    def _commit(self, change: Any, actor: str) -> str:
        name, email = _author(actor)
        with self._lock:
            base = self._sync_clone()
            subject = change()
            self._validate_worktree()
            self._git("add", "-A")
            self._git("commit", "-q", "--author", f"{name} <{email}>", "-m", subject,
                      "-m", f"Written by the llmgw controller for {name}.", env=COMMITTER)
            for _ in range(self.attempts):
                try:
                    self._git("push", "-q", "origin", f"HEAD:refs/heads/{self.branch}")
                    return self._git("rev-parse", "HEAD").strip()
                except GitError as exc:
                    push_error = exc
                # Decide by what the remote now holds, not by git's wording: if the branch
                # moved, someone pushed first and we rebase; if not, the push is refused.
                try:
                    self._git("fetch", "-q", "origin",
                              f"+refs/heads/{self.branch}:refs/remotes/origin/{self.branch}")
                    remote = self._git("rev-parse", f"origin/{self.branch}").strip()
                except GitError as exc:
                    raise PushRejected(self._cannot_push(exc)) from exc
                if remote == base:
                    raise PushRejected(self._cannot_push(push_error)) from push_error
                try:
                    self._git("rebase", "-q", f"origin/{self.branch}", env=COMMITTER)
                except GitError as exc:
                    self._git_quiet("rebase", "--abort")
                    raise PushRejected(
                        f"someone changed the same file first ({exc}); reload and try again") from exc
                self._validate_worktree()
                base = remote
            raise PushRejected(f"the branch kept moving; gave up after {self.attempts} attempts, try again")

    def _git_quiet(self, *args: str) -> None:
        try:
            self._git(*args)
        except GitError:
            pass

    def _cannot_push(self, exc: Exception) -> str:
        return f"the controller cannot push to {redact(self.url)} ({exc}); push the change to git instead"
