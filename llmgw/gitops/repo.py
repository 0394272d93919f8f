"""A local mirror of the one branch the controller follows.

Git is driven as a subprocess with an argv list and a timeout on every call (a hung
remote must not hang the controller), through `llmgw.gitops.gitcli`; the catalog is read
from the commit's tree, never a working tree.
The mirror is a bare repository under the controller's data dir: nothing can edit files
in it by accident, and a force-push upstream is followed by a forced ref update.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from llmgw.catalog.loader import RawFile
from llmgw.errors import BranchMissing, GitError
from llmgw.gitops.gitcli import forget_origin_url, origin_env, read_tree, run_git, run_git_capped
from llmgw.gitops.status import History
from llmgw.redact import redact

GIT_TIMEOUT = 30.0


@dataclass(frozen=True)
class CommitInfo:
    sha: str
    author: str
    email: str
    subject: str
    message: str
    time: float


def normalise_url(url: str) -> str:
    """A local path becomes absolute; URLs (file://, ssh, https, scp-like) pass unchanged."""
    if "://" in url or (":" in url and not url.startswith("/") and not Path(url).exists()):
        return url
    return str(Path(url).resolve())


class GitMirror:
    """Bare mirror of ``branch`` of ``url`` at ``path``; constructing it touches nothing."""

    def __init__(self, url: str, branch: str, path: Path, *, subdir: str = "", env: dict[str, str] | None = None):
        self.url = normalise_url(url)
        self.branch = branch
        self.path = Path(path)
        self.subdir = subdir.strip("/")
        self.env = env or {}
        self.ref = f"refs/remotes/origin/{branch}"

    @property
    def shown_url(self) -> str:
        """The URL as status, events, logs and the dashboard show it: without its credential."""
        return redact(self.url)

    def ensure(self) -> None:
        """Create the bare mirror on first use. Its config names no URL: each fetch is given it
        (`origin_env`), so a credential in it never reaches the disk."""
        if not (self.path / "HEAD").exists():
            self.path.mkdir(parents=True, exist_ok=True)
            run_git(["init", "-q", "--bare", str(self.path)])
        else:
            forget_origin_url(self.path)

    def fetch(self, *, timeout: float = GIT_TIMEOUT) -> str:
        """Fetch the branch (forced: a rewritten history is simply the new desired state); its sha.

        :class:`BranchMissing` when the remote answers but has no such branch (deleted, renamed).
        """
        self.ensure()
        refspec = f"+refs/heads/{self.branch}:{self.ref}"
        try:
            run_git(["fetch", "-q", "--no-tags", "origin", refspec], cwd=self.path, timeout=timeout,
                    env=origin_env(self.url, self.env))
        except GitError:
            # Asked again by exit status, not by the words of the failure (which git may translate
            # or reword): ls-remote --exit-code exits 2 when the remote answered without the ref.
            try:
                run_git(["ls-remote", "--exit-code", "origin", f"refs/heads/{self.branch}"], cwd=self.path,
                        timeout=timeout, env=origin_env(self.url, self.env))
            except GitError as probe:
                if probe.code == 2:
                    raise BranchMissing(f"the remote has no branch {self.branch!r} (deleted or renamed?)") from None
            raise
        return self.head()

    def history(self, old: str, new: str) -> History | None:
        """How ``new`` follows ``old``, or None when ``old`` is not in the mirror (a fresh mirror)."""
        if old == new or not self.has(old):
            return None if old != new else History.FORWARD
        if self._is_ancestor(old, new):
            return History.FORWARD
        return History.REWIND if self._is_ancestor(new, old) else History.FORCE_PUSH

    def _is_ancestor(self, a: str, b: str) -> bool:
        try:
            run_git(["merge-base", "--is-ancestor", a, b], cwd=self.path)
        except GitError:
            return False  # exit 1 is "no"; a real failure (a missing object) is no as well
        return True

    def head(self) -> str:
        return run_git(["rev-parse", "--verify", "-q", self.ref + "^{commit}"], cwd=self.path).strip()

    def has(self, sha: str) -> bool:
        try:
            run_git(["cat-file", "-e", sha + "^{commit}"], cwd=self.path)
        except GitError:
            return False
        return True

    def read(self, sha: str) -> dict[str, RawFile]:
        return read_tree(self.path, sha, subdir=self.subdir)

    def messages(self, old: str, new: str) -> list[str] | None:
        """The messages of the commits in ``old..new``, or None when there are too many to read
        (or ``old`` is not an ancestor): the caller then takes the safe side."""
        if not self._is_ancestor(old, new):
            return None
        raw, complete = run_git_capped(["log", f"--max-count={MAX_RANGE_COMMITS + 1}", "--format=%B%x00",
                                        f"{old}..{new}"], cwd=self.path, cap=MAX_INFO_BYTES * 16)
        found = [m.strip() for m in raw.decode("utf-8", "replace").split("\x00")[:-1]]
        return found if complete and len(found) <= MAX_RANGE_COMMITS else None

    def info(self, sha: str) -> CommitInfo:
        """Who wrote ``sha`` and what they said, bounded: a commit's author sizes its message, and a
        100 MB one would be held (and stored in events) whole. A message cut short loses its
        trailers, so a prune it allowed is held for an operator instead: the safe side."""
        raw, _complete = run_git_capped(["show", "-s", "--format=%H%x00%ct%x00%an%x00%ae%x00%s%x00%B", sha],
                                        cwd=self.path, cap=MAX_INFO_BYTES)
        fields = raw.decode("utf-8", "replace").split("\x00", 5)
        full, ctime, author, email, subject, body = fields + [""] * (6 - len(fields))
        return CommitInfo(full, _short(author), _short(email), _short(subject, MAX_SUBJECT), body.strip(),
                          float(ctime))


MAX_INFO_BYTES = 64 * 1024
MAX_RANGE_COMMITS = 1_000
MAX_SUBJECT = 500


def _short(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"
