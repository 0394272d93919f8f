"""A credential in the repository URL is used (fetch, push) and shown nowhere: not in the sync
status, the events (stored or served), the summary, the dashboard, the banner, the logs, nor any
file of the data dir (the SQLite database, the mirror's and the writer's git config)."""

from __future__ import annotations

import http.cookiejar
import json
import os
import signal
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from llmgw.errors import LlmgwError
from llmgw.gitops.writer import CommitWriter
from llmgw.redact import redact
from tests.catalog.corpus import SMALL, write_catalog
from tests.conftest import git
from tests.e2e.processes import free_port, start, stop, wait_for
from tests.gitops.conftest import Remote
from tests.gitops.git_http import git_http

SECRET = "tok-" + os.urandom(12).hex()
TOKEN = "credential-admin-token"


@pytest.mark.parametrize(("text", "shown"), [
    ("https://user:tok@host/x.git", "https://***@host/x.git"),
    ("https://tok@host/x.git", "https://***@host/x.git"),
    ("git+https://tok@host/x.git", "git+https://***@host/x.git"),
    ("ssh://git:pw@host:22/x.git", "ssh://git:***@host:22/x.git"),
    ("ssh://git@host/x.git", "ssh://git@host/x.git"),  # a login name, not a secret
    ("https://host/x.git?private_token=tok&ref=a", "https://host/x.git?private_token=***&ref=***"),
    ("fatal: unable to access 'https://h/x.git?private_token=tok/': 403", "fatal: unable to access "
     "'https://h/x.git?private_token=***': 403"),
    ("https://user:pa/ss@host/x.git", "https://***@host/x.git"),  # "/" in a password, unencoded
    ("https://user:p@ss@host/x.git", "https://***@host/x.git"),
    ("hf://org/model@rev and file:///srv/a@b and http://10.0.0.1:8000/v1", "hf://org/model@rev and "
     "file:///srv/a@b and http://10.0.0.1:8000/v1"),
    ("git@github.com:org/x.git", "git@github.com:org/x.git"),
])
def test_redact(text: str, shown: str) -> None:
    assert redact(text) == shown


def _catalog_remote(tmp: Path) -> Remote:
    srv = tmp / "srv"
    srv.mkdir()
    bare = srv / "catalog.git"
    git(tmp, "init", "-q", "--bare", "-b", "main", str(bare))
    remote = Remote(bare, tmp / "person")
    remote.clone.mkdir()
    git(remote.clone, "init", "-q", "-b", "main")
    git(remote.clone, "remote", "add", "origin", str(bare))
    return remote


def _files_holding(root: Path, secret: str) -> list[str]:
    found = []
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = Path(dirpath) / name
            if not path.is_symlink() and secret.encode() in path.read_bytes():
                found.append(str(path))
    return found


def test_the_writer_fetches_and_pushes_with_the_credential_and_keeps_it_off_disk(tmp_path: Path) -> None:
    remote = _catalog_remote(tmp_path)
    write_catalog(remote.clone)
    remote.commit({}, "A catalog")
    with git_http(remote.bare.parent, user="ci", password=SECRET) as server:
        writer = CommitWriter(server.url("catalog.git"), "main", tmp_path / "writer")
        sha = writer.add_model(SMALL.replace("name: small", "name: extra").replace("[tiny]", "[extra-tiny]"),
                               "Ada <ada@example.com>")
        assert git(remote.bare, "rev-parse", "main") == sha  # pushed, over HTTP, with the credential
        server.password = "rotated"
        with pytest.raises(LlmgwError) as refused:
            writer.add_model(SMALL.replace("name: small", "name: more").replace("[tiny]", "[more-tiny]"), "Ada")
    assert SECRET not in str(refused.value)
    assert _files_holding(tmp_path / "writer", SECRET) == []


def _get(url: str, opener: urllib.request.OpenerDirector | None = None) -> str:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {TOKEN}"})
    with (opener or urllib.request.build_opener()).open(req, timeout=30) as r:
        return r.read().decode()


def _dashboard(admin: str) -> str:
    """As a browser: sign in with the token once, then the page with the cookie alone."""
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar()))
    with opener.open(f"{admin}/?token={TOKEN}", timeout=30) as r:
        r.read()
    with opener.open(f"{admin}/", timeout=30) as r:
        return r.read().decode()


def _post_sync(admin: str) -> None:
    req = urllib.request.Request(admin + "/api/v1/sync", data=b"{}", method="POST",
                                 headers={"Authorization": f"Bearer {TOKEN}"})
    try:
        urllib.request.urlopen(req, timeout=60).read()
    except urllib.error.HTTPError as exc:  # a failed fetch may be answered as an error: what it says is checked
        exc.read()


def _surfaces(admin: str) -> dict[str, str]:
    return {path: _get(admin + path) for path in ("/api/v1/sync", "/api/v1/events?limit=1000", "/api/v1/summary",
                                                  "/api/v1/metrics")} | {"dashboard": _dashboard(admin)}


@pytest.mark.slow
@pytest.mark.parametrize("where", ["userinfo", "query"])
def test_a_credential_in_the_repository_url_is_on_no_surface(tmp_path: Path, where: str) -> None:
    """userinfo: fetched with it (synced twice), then the server refuses it (fetch-failed).
    query: git echoes a URL's query in its errors, so the fetch fails from the start with the
    credential in git's own stderr (and the userinfo beside it)."""
    remote = _catalog_remote(tmp_path)
    initial = remote.commit({"nodes.yaml": "nodes: []\n", "llmgw.yaml": "pools:\n  - name: default\n"}, "Empty")
    data = tmp_path / "data"
    log = tmp_path / "controller.log"
    with git_http(remote.bare.parent, user="ci", password=SECRET) as server:
        url = server.url("catalog.git", query=f"private_token={SECRET}" if where == "query" else "")
        admin_port = free_port()
        config = tmp_path / "controller.yaml"
        config.write_text(json.dumps({
            "repo": url, "data_dir": str(data), "fetch_interval": 3600, "watch": False,
            "listen": {"router": f"127.0.0.1:{free_port()}", "admin": f"127.0.0.1:{admin_port}"},
            "admin_token": TOKEN,
        }))
        admin = f"http://127.0.0.1:{admin_port}"
        proc = start(["controller", "--config", str(config), "--log-level", "debug"], log)
        try:
            sync = lambda: json.loads(_get(admin + "/api/v1/sync"))  # noqa: E731
            if where == "userinfo":
                wait_for(lambda: sync()["applied_sha"] == initial, 60, "the catalog fetched with the credential", proc)
                second = remote.commit({"llmgw.yaml": "pools:\n  - name: default\n  - name: batch\n"}, "Second")
                _post_sync(admin)
                assert sync()["applied_sha"] == second
                server.password = "rotated"  # the credential is refused from now on
                _post_sync(admin)
            status = wait_for(lambda: (s := sync())["state"] == "fetch-failed" and s, 60, "a failed fetch", proc)
            assert status["last_error"] and status["url"].startswith(f"http://***@127.0.0.1:{server.port}/")
            surfaces = _surfaces(admin)
            assert any("fetch-failed" in e["kind"] for e in json.loads(surfaces["/api/v1/events?limit=1000"]))
            if where == "query":
                assert "private_token=***" in status["last_error"], status  # git's own words, redacted
        finally:
            stop(proc, signal.SIGTERM)
    leaks = {name: SECRET in text for name, text in surfaces.items()}
    assert not any(leaks.values()), leaks
    shown = f"http://***@127.0.0.1:{server.port}/catalog.git"  # what they show instead
    assert shown in surfaces["dashboard"] and shown in surfaces["/api/v1/events?limit=1000"]
    output = log.read_text()
    assert "following http://***@127.0.0.1" in output  # the banner, redacted
    assert SECRET not in output
    assert _files_holding(data, SECRET) == []  # the SQLite database (and its WAL), the mirror's config
