"""The one way llmgw talks to git: the `git` command, with a timeout on every call.

Used by the controller's mirror and writer and by the review tools (`llmgw validate --rev`,
`llmgw diff`) alike. There were two drivers, this one and GitPython without timeouts (a `Repo`
opened per read and never closed, its exceptions reaching the CLI); a hung fetch or a huge
repository could then stall a tick or print a traceback. Every failure here is a
:class:`~llmgw.errors.GitError` in git's own words.

Reading a commit's tree, never a working tree: the controller must judge exactly what was
committed. A symlink is a blob (mode 120000) whose content is its target's path; it is refused by
its mode and its blob never read, so neither the target nor its path reaches an error message.
"""

from __future__ import annotations

import base64
import functools
import os
import re
import stat
import subprocess
import threading
import urllib.parse
from collections.abc import Mapping
from pathlib import Path

from llmgw.catalog.loader import (
    MAX_FILE_BYTES,
    MAX_MODELS_ENTRIES,
    MODELS_DIR,
    MODELS_DIR_OVERFLOW,
    MODELS_DIR_SYMLINK,
    NODES_FILE,
    SETTINGS_FILE,
    RawFile,
    is_catalog_file,
    limit_problem,
    refusal,
)
from llmgw.errors import GitError
from llmgw.redact import redact

GIT_TIMEOUT = 30.0
_ENV = {"GIT_TERMINAL_PROMPT": "0", "LC_ALL": "C", "GIT_OPTIONAL_LOCKS": "0"}


def _run(args: list[str], *, cwd: Path | str | None, timeout: float, env: dict[str, str] | None,
         data: bytes | None = None) -> bytes:
    full_env = {**os.environ, **_ENV, **(env or {})}
    try:
        proc = subprocess.run(["git", *args], cwd=cwd, env=full_env, input=data, capture_output=True,
                              timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        raise GitError(f"git {args[0]} timed out after {timeout:g}s") from exc
    except OSError as exc:
        raise GitError(f"cannot run git: {exc}") from exc
    if proc.returncode != 0:
        raise _failed(args, proc.returncode, proc.stderr or proc.stdout)
    return proc.stdout


def _failed(args: list[str], code: int, output: bytes) -> GitError:
    # git drops a URL's password from its messages but echoes its query (?private_token=...).
    text = redact(output.decode("utf-8", "replace").strip())
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    # git's reason is on its fatal:/error: lines; the rest is advice.
    remote = [ln for ln in lines if ln.startswith("remote:")][:2]  # the host's own words, not its advice
    reason = [ln for ln in lines if ln.startswith(("fatal:", "error:", "! [")) or ln in remote] or lines[-3:]
    return GitError(f"git {args[0]} failed: {' '.join(reason) or f'exit {code}'}", code=code)


def run_git_capped(args: list[str], *, cwd: Path | str | None, cap: int,
                   timeout: float = GIT_TIMEOUT) -> tuple[bytes, bool]:
    """(git's stdout, whether that is all of it): at most ``cap`` bytes are ever held, and git is
    stopped there. For what a commit's author sizes (a listing, a message): a whole one of a
    million names or a 100 MB message cost the controller its memory before anything judged it."""
    try:
        proc = subprocess.Popen(["git", *args], cwd=cwd, env={**os.environ, **_ENV}, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except OSError as exc:
        raise GitError(f"cannot run git: {exc}") from exc
    expired = threading.Event()

    def expire() -> None:
        expired.set()
        proc.kill()

    timer = threading.Timer(timeout, expire)
    timer.start()
    try:
        assert proc.stdout is not None and proc.stderr is not None
        out = proc.stdout.read(cap + 1)
        if len(out) > cap:
            proc.kill()
            proc.wait()
            return out[:cap], False
        err = proc.stderr.read(64 * 1024)  # git's own words are short; a flood of them is not kept
        code = proc.wait()
    finally:
        timer.cancel()
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if expired.is_set():
        raise GitError(f"git {args[0]} timed out after {timeout:g}s")
    if code != 0:
        raise _failed(args, code, err or out)
    return out, True


def origin_env(url: str, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` plus the URL of the remote ``origin``, for one git command (GIT_CONFIG_COUNT,
    git >= 2.31). Given this way the URL is never written to the repository's config on disk (a
    copied data dir, a backup) and the repository holds no URL at all.

    An http(s) URL's ``user:password@`` is taken out of it and given as an Authorization header
    in the same environment (/proc/PID/environ is readable by its owner only): git starts its
    remote helper as ``git remote-https origin <URL>``, and that argv is readable by every user
    of the machine. ``credential.helper`` is reset to none, so no helper of the user running
    llmgw (``store`` writes ~/.git-credentials) is handed a credential. A query-string token
    (``?private_token=``) has no other way to git and stays in the URL."""
    if _git_version() < (2, 31):  # an older git ignores these and reports "'origin' is not a repository"
        raise GitError(f"git 2.31 or newer is needed (this is {'.'.join(map(str, _git_version()))}): the "
                       "repository URL is given to git in its environment (GIT_CONFIG_COUNT)")
    base = {**os.environ, **(env or {})}
    try:
        count = int(base.get("GIT_CONFIG_COUNT", "0"))
    except ValueError:
        count = 0
    bare, header = _split_credential(url)
    config = [("remote.origin.url", bare), ("credential.helper", "")]
    if header:
        config.append(("http.extraHeader", header))
    out = {**(env or {}), "GIT_CONFIG_COUNT": str(count + len(config))}
    for i, (key, value) in enumerate(config, start=count):
        out[f"GIT_CONFIG_KEY_{i}"] = key
        out[f"GIT_CONFIG_VALUE_{i}"] = value
    return out


def _split_credential(url: str) -> tuple[str, str | None]:
    """An http(s) URL without its userinfo, and that userinfo as a Basic Authorization header.

    The userinfo runs to the LAST "@" of the authority (as curl reads it): a password may hold
    an unencoded "@".
    Other schemes (ssh://git@host) keep theirs: there it is a login name, and not a password.
    """
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower().removeprefix("git+") not in ("http", "https"):
        return url, None
    # The authority as git and curl read it: up to the first "/", "?" or "#".
    end = min((i for i in (rest.find("/"), rest.find("?"), rest.find("#")) if i >= 0), default=len(rest))
    at = rest.rfind("@", 0, end)
    if at < 0:
        return url, None
    userinfo, host_and_path = rest[:at], rest[at + 1:]
    user, _, password = userinfo.partition(":")
    pair = f"{urllib.parse.unquote(user)}:{urllib.parse.unquote(password)}"
    token = base64.b64encode(pair.encode()).decode()
    return f"{scheme}://{host_and_path}", f"Authorization: Basic {token}"


@functools.cache
def _git_version() -> tuple[int, ...]:
    numbers = re.findall(r"\d+", run_git(["version"]).partition("version")[2])
    return tuple(int(n) for n in numbers[:3])


def forget_origin_url(cwd: Path | str) -> None:
    """Remove a URL an earlier version wrote into the repository's config (with its credential)."""
    try:
        run_git(["config", "--unset-all", "remote.origin.url"], cwd=cwd)
    except GitError:
        pass  # exit 5: there was none


def run_git(args: list[str], *, cwd: Path | str | None = None, timeout: float = GIT_TIMEOUT,
            env: dict[str, str] | None = None) -> str:
    """Run git; its stdout as text on success, GitError carrying git's own words otherwise."""
    return _run(args, cwd=cwd, timeout=timeout, env=env).decode("utf-8", "replace")


def work_tree_root(path: Path | str) -> Path:
    """The top of the working tree ``path`` is in, found by walking up ``path`` as written (a
    symlink in it is not resolved first: the caller then sees that it leads out); GitError when
    it is in none."""
    p = Path(os.path.abspath(path))
    for candidate in (p, *p.parents):
        if (candidate / ".git").exists():
            try:
                out = _run(["rev-parse", "--show-toplevel"], cwd=candidate, timeout=GIT_TIMEOUT, env=None)
                # Only the newline goes: a path may end in a space or hold bytes that are not UTF-8.
                return Path(os.fsdecode(out.removesuffix(b"\n"))).resolve()
            except GitError as exc:
                raise GitError(f"{path}: not inside a usable git repository: {exc}") from None
    raise GitError(f"{path}: not inside a git repository")


def resolve_commit(repo: Path | str, rev: str) -> str:
    """The sha of the commit ``rev`` names; GitError when it names none."""
    if not rev or rev.startswith("-"):
        raise GitError(f"cannot read {rev!r}: not a revision")
    try:
        return run_git(["rev-parse", "--verify", "-q", "--end-of-options", rev + "^{commit}"], cwd=repo).strip()
    except GitError as exc:
        raise GitError(f"cannot read {rev!r}: no such commit") from exc


def has_commit(repo: Path | str, rev: str) -> bool:
    try:
        resolve_commit(repo, rev)
    except GitError:
        return False
    return True


# A line of `ls-tree --long`: mode, type, a sha-256 object id, a size and the name; an honest
# listing of MAX_MODELS_ENTRIES names stays well under this many bytes.
_LISTING_BYTES = MAX_MODELS_ENTRIES * 512
_TOP_FILES = (SETTINGS_FILE, "llmgw.yml", NODES_FILE, "nodes.yml", MODELS_DIR)

Entry = tuple[int, str, str, int, str]  # (mode, type, object, size, path)


def _entries(repo: Path | str, sha: str, *paths: str, recursive: bool) -> list[Entry]:
    """``git ls-tree`` of ``sha``: (mode, type, object, size, path) per entry."""
    entries, _ = _listing(repo, sha, *paths, recursive=recursive, cap=None)
    return entries


def _listing(repo: Path | str, sha: str, *paths: str, recursive: bool, cap: int | None) -> tuple[list[Entry], bool]:
    """(entries, whether that is all of them): with ``cap``, no more than cap bytes of listing."""
    args = ["ls-tree", "-z", "--long", "--full-tree"] + (["-r"] if recursive else []) + [sha, "--", *paths]
    if cap is None:
        raw, complete = _run(args, cwd=repo, timeout=GIT_TIMEOUT, env=None), True
    else:
        raw, complete = run_git_capped(args, cwd=repo, cap=cap)
    records = raw.split(b"\0")
    if not complete:
        records = records[:-1]  # the last one was cut
    out = []
    for record in records:
        if not record:
            continue
        meta, _, name = record.partition(b"\t")
        mode, kind, obj, size = meta.split(None, 3)
        out.append((int(mode, 8), kind.decode(), obj.decode(), int(size) if size.strip() != b"-" else 0,
                    os.fsdecode(name)))
    return out, complete


def read_tree(repo: Path | str, rev: str, *, subdir: str = "") -> dict[str, RawFile]:
    """The catalog files in ``rev``'s tree under ``subdir``, keyed by path relative to it.

    A catalog file that is not a regular blob (a symlink, a submodule) comes back refused with its
    content unread; so does a symlinked ``models`` directory. A file over the size limit comes
    back empty with its real size (its size alone is the problem), and so does every file when
    the catalog is over a bound (`limit_problem`): judged from the listing, before any blob is
    read. Only the catalog's own two directories are listed, the models one no further than
    MAX_MODELS_ENTRIES.
    """
    sha = resolve_commit(repo, rev)
    prefix = subdir.strip("/")
    parts = [p for p in prefix.split("/") if p]
    # Walked one component at a time, so a symlink on the way is named, not followed.
    for i in range(len(parts)):
        where = "/".join(parts[: i + 1])
        found = _entries(repo, sha, where, recursive=False)
        if not found:
            raise GitError(f"cannot read {rev!r} under {prefix}: {where} is not in that commit")
        mode, kind = found[0][0], found[0][1]
        if kind != "tree":
            what = "a symbolic link (symlinks are not followed)" if stat.S_ISLNK(mode) else "not a directory"
            raise GitError(f"cannot read {rev!r} under {prefix}: {where} is {what}")
    base = f"{prefix}/" if prefix else ""
    out: dict[str, RawFile] = {}
    top = _entries(repo, sha, *(base + name for name in _TOP_FILES), recursive=False)
    models: list[Entry] = []
    for mode, kind, _obj, _size, path in top:
        if path == base + MODELS_DIR and stat.S_ISLNK(mode):
            out[MODELS_DIR] = RawFile(MODELS_DIR, b"", 0, refused=MODELS_DIR_SYMLINK)
        elif path == base + MODELS_DIR and kind == "tree":
            models, complete = _listing(repo, sha, f"{base}{MODELS_DIR}/", recursive=False, cap=_LISTING_BYTES)
            if not complete or len(models) > MAX_MODELS_ENTRIES:
                out[MODELS_DIR] = RawFile(MODELS_DIR, b"", 0, refused=MODELS_DIR_OVERFLOW)
                return out
    wanted: list[tuple[str, str, int]] = []
    for mode, kind, obj, size, path in top + models:
        rel = path[len(base):]
        if kind == "tree" or not is_catalog_file(rel):
            continue  # a directory named like a catalog file is not one
        reason = refusal(mode) if kind == "blob" else refusal(mode) or "not a regular file"
        if reason:
            out[rel] = RawFile(rel, b"", 0, refused=reason)
        elif size > MAX_FILE_BYTES:
            out[rel] = RawFile(rel, b"", size)
        else:
            wanted.append((rel, obj, size))
    if limit_problem({**out, **{rel: RawFile(rel, b"", size) for rel, _, size in wanted}}) is not None:
        return {**out, **{rel: RawFile(rel, b"", size) for rel, _, size in wanted}}
    for (rel, _, size), data in zip(wanted, _blobs(repo, [obj for _, obj, _ in wanted]), strict=True):
        out[rel] = RawFile(rel, data, size)
    return out


def _blobs(repo: Path | str, objects: list[str]) -> list[bytes]:
    """The contents of ``objects`` through one ``git cat-file --batch``."""
    if not objects:
        return []
    raw = _run(["cat-file", "--batch"], cwd=repo, timeout=GIT_TIMEOUT, env=None,
               data="".join(o + "\n" for o in objects).encode())
    out, pos = [], 0
    for obj in objects:
        end = raw.index(b"\n", pos)
        header = raw[pos:end].split()
        if len(header) != 3 or header[0].decode() != obj:
            raise GitError(f"git cat-file: unexpected answer for {obj}: {raw[pos:end][:80]!r}")
        size = int(header[2])
        out.append(raw[end + 1:end + 1 + size])
        pos = end + 1 + size + 1
    return out
