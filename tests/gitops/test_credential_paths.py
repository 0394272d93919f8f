"""The credential in the repository URL reaches git only through its environment.

Review 3: git starts `git-remote-https origin <URL>`, so a URL with `user:password@` was in that
child's argv (/proc/PID/cmdline, readable by every user) for as long as a fetch ran; and git
hands a URL's user and password to the user's credential helpers after a successful fetch, so
`credential.helper = store` wrote it to ~/.git-credentials in plain text.
"""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

import pytest

from llmgw.errors import GitError
from llmgw.gitops.gitcli import origin_env
from llmgw.gitops.repo import GitMirror
from llmgw.gitops.writer import CommitWriter
from llmgw.redact import redact
from tests.catalog.corpus import SMALL, write_catalog
from tests.conftest import git
from tests.gitops.conftest import Remote
from tests.gitops.git_http import git_http

# Fixed, not random: it names parametrized tests, and xdist's workers must collect the same ids.
SECRET = "tok5f3a9c1e77d04b2a8e61"


def _argvs_holding(secret: str) -> list[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if secret.encode() in cmd:
            found.append(cmd.replace(b"\0", b" ").decode(errors="replace").replace(secret, "<SECRET>"))
    return found


def test_no_process_argv_holds_the_credential_while_a_fetch_hangs(tmp_path: Path) -> None:
    with socket.socket() as server:  # accepts the connection (backlog) and never answers
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        mirror = GitMirror(f"https://ci:{SECRET}@127.0.0.1:{server.getsockname()[1]}/x.git", "main",
                           tmp_path / "mirror.git")
        done = threading.Event()

        def fetch() -> None:
            try:
                mirror.fetch(timeout=20)
            except GitError:
                pass
            done.set()

        threading.Thread(target=fetch, daemon=True).start()
        # Wait for the remote helper's connection: from then on it is running with its argv.
        server.settimeout(30)
        conn, _ = server.accept()
        try:
            helpers: list[str] = []
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
                except OSError:
                    continue
                if b"remote-http" in cmd and str(server.getsockname()[1]).encode() in cmd:
                    helpers.append(cmd.decode(errors="replace"))
            assert helpers, "the remote helper was not found running"
            assert _argvs_holding(SECRET) == []
        finally:
            conn.close()
        done.wait(30)


def test_the_users_credential_helper_never_gets_the_credential(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / ".gitconfig").write_text("[credential]\n\thelper = store\n")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    srv = tmp_path / "srv"
    srv.mkdir()
    remote = Remote(srv / "catalog.git", tmp_path / "person")
    git(tmp_path, "init", "-q", "--bare", "-b", "main", str(remote.bare))
    remote.clone.mkdir()
    git(remote.clone, "init", "-q", "-b", "main")
    git(remote.clone, "remote", "add", "origin", str(remote.bare))
    write_catalog(remote.clone)
    remote.commit({}, "A catalog")
    with git_http(srv, user="ci", password=SECRET) as server:
        GitMirror(server.url("catalog.git"), "main", tmp_path / "mirror.git").fetch()  # it still works
        writer = CommitWriter(server.url("catalog.git"), "main", tmp_path / "writer")
        sha = writer.add_model(SMALL.replace("name: small", "name: extra").replace("[tiny]", "[extra-tiny]"),
                               "Ada <ada@example.com>")
        assert git(remote.bare, "rev-parse", "main") == sha  # pushed with the credential
    stored = home / ".git-credentials"
    assert not stored.exists(), stored.read_text().replace(SECRET, "<SECRET>")


def test_a_query_string_token_stays_in_the_url_and_userinfo_never_does() -> None:
    env = origin_env(f"https://ci:{SECRET}@host/x.git")
    values = [v for k, v in env.items() if k.startswith("GIT_CONFIG_VALUE_")]
    assert "https://host/x.git" in values
    assert not any(SECRET in v for v in values if not v.startswith("Authorization: Basic "))
    assert "" in [env[k.replace("KEY", "VALUE")] for k, v in env.items() if v == "credential.helper"]
    assert "https://host/x.git?private_token=abc" in origin_env("https://host/x.git?private_token=abc").values()
    assert "ssh://git@host/x.git" in origin_env("ssh://git@host/x.git").values()


@pytest.mark.parametrize(("text", "shown"), [
    # GitHub's documented token form puts the token in the user part.
    (f"https://{SECRET}:x-oauth-basic@github.com/org/c.git", "https://***@github.com/org/c.git"),
    (f"https://ci:pa'{SECRET}@host/c.git", "https://***@host/c.git"),
    (f"https://ci:pa\"{SECRET}@host/c.git", "https://***@host/c.git"),
    (f"https://ci:pa`{SECRET}@host/c.git", "https://***@host/c.git"),
    (f"https://ci:<{SECRET}>@host/c.git", "https://***@host/c.git"),
    (f"'https://ci:pa'{SECRET}@host/c.git/': 403", "'https://***@host/c.git/': 403"),
    (f"https://ci:123/{SECRET}@host/c.git", "https://***@host/c.git"),  # "123" looks like a port
    (f"https://{SECRET}'x@host/c.git", "https://***@host/c.git"),
    (f"redis://user:{SECRET}@cache/1", "redis://user:***@cache/1"),  # there the user is a login
    ("hf://org/model@rev and file:///srv/a@b 'https://h/x.git/': 403",
     "hf://org/model@rev and file:///srv/a@b 'https://h/x.git/': 403"),
])
def test_redact_hides_every_userinfo_of_a_token_url(text: str, shown: str) -> None:
    assert redact(text) == shown
