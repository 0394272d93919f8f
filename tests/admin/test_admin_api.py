"""The admin API itself: auth on every route, the OpenAPI document, errors, the dashboard."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from llmgw.admin.openapi import openapi_document
from tests.admin.conftest import TOKEN, Running

pytestmark = pytest.mark.slow


def http(method: str, url: str, body: bytes | None = None, token: str | None = TOKEN) -> tuple[int, bytes, dict]:
    req = urllib.request.Request(url, data=body, method=method)
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            return r.status, r.read(), dict(r.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), dict(exc.headers)


def app_routes(running: Running) -> set[tuple[str, str]]:
    from llmgw.admin.app import build_admin_app
    from llmgw.control.feed import FeedHub

    app = build_admin_app(running.controller, token=TOKEN, hub=FeedHub())
    return {(r.method, r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"}


def test_every_route_but_the_webhook_needs_the_token(running: Running) -> None:
    for method, path in sorted(app_routes(running)):
        url = running.url + path.replace("{node}", "n1").replace("{name}", "chat")
        for token in (None, "wrong-token"):
            status, body, headers = http(method, url, b"{}" if method != "GET" else None, token)
            if path == "/api/v1/hooks/git":
                assert status == 401 and b"signature" in body  # its own check, not the token
                continue
            assert status == 401, (method, path, token, status)
            assert json.loads(body) == {"error": "missing or invalid admin token (Authorization: Bearer ...)"}


def test_openapi_document_matches_the_routes(running: Running) -> None:
    status, body, _ = http("GET", running.url + "/api/v1/openapi.json")
    assert status == 200
    doc = json.loads(body)
    assert doc == json.loads(json.dumps(openapi_document(feed=True)))
    documented = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
    served = {(m, p) for m, p in app_routes(running) if p != "/"}
    assert documented == served


def test_malformed_bodies_are_400_never_500(running: Running) -> None:
    for path in ("/api/v1/sync", "/api/v1/nodes/n1/state", "/api/v1/models", "/api/v1/weights/collect"):
        for body in (b"{not json", b"[1, 2]", b'"text"', b"\xff\xfe"):
            status, raw, _ = http("POST", running.url + path, body)
            assert status == 400, (path, body, status, raw)
            assert "error" in json.loads(raw)
    status, raw, _ = http("POST", running.url + "/api/v1/nodes/n1/state", b'{"state": "asleep"}')
    assert status == 400 and b"cordon, uncordon, drain" in raw
    status, raw, _ = http("GET", running.url + "/api/v1/events?limit=abc")
    assert status == 400 and json.loads(raw) == {"error": "limit must be an integer"}
    status, raw, _ = http("GET", running.url + "/api/v1/explain-placement?model=ghost")
    assert status == 404 and json.loads(raw) == {"error": 'model "ghost" is not in the catalog'}
    status, raw, _ = http("GET", running.url + "/api/v1/nope")
    assert status == 404 and "error" in json.loads(raw)


def test_fleet_metrics_parse(running: Running) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    status, raw, _ = http("GET", running.url + "/api/v1/metrics")
    assert status == 200
    families = {f.name: f for f in text_string_to_metric_families(raw.decode())}
    nodes = {s.labels["state"]: s.value for s in families["llmgw_nodes"].samples}
    assert nodes["ready"] == 2
    gpus = {(s.labels["node"], s.name): s.value for f in ("llmgw_gpus", "llmgw_gpus_free") for s in families[f].samples}
    assert gpus[("n1", "llmgw_gpus")] == 2 and gpus[("n2", "llmgw_gpus_free")] == 2
    replicas = {(s.labels["model"], s.labels["state"]): s.value for s in families["llmgw_replicas"].samples}
    assert replicas[("chat", "ready")] == 1
    info = families["llmgw_catalog_info"].samples[0].labels
    assert info["applied"] == running.controller.follower.status.applied_sha and info["state"] == "synced"


@pytest.mark.skipif(not shutil.which("chromium"), reason="chromium is not installed (apt-get install chromium)")
def test_dashboard_in_headless_chromium(running: Running, tmp_path: Path) -> None:
    shot = tmp_path / "dashboard.png"
    base = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1400,1000"]
    url = f"{running.url}/?token={TOKEN}"
    subprocess.run([*base, f"--screenshot={shot}", url], capture_output=True, timeout=90, check=False)
    assert shot.exists() and shot.stat().st_size > 10_000
    dom = subprocess.run([*base, "--dump-dom", url], capture_output=True, text=True, timeout=90, check=False).stdout
    c = running.controller
    assert c.follower.status.applied_sha in dom
    assert 'data-node="n1"' in dom and 'data-node="n2"' in dom
    assert 'data-model="chat"' in dom
    # Each model's routing policy and prompt-cache hits (none counted yet: shown as a dash).
    assert "prompt cache hits" in dom and '<td class="routing">least-outstanding</td>' in dom
    assert '<td class="prompt-cache">— / —</td>' in dom
    status, body, _ = http("GET", running.url + "/", token=None)
    assert status == 401


@pytest.mark.skipif(not shutil.which("chromium"), reason="chromium is not installed (apt-get install chromium)")
def test_the_browser_ends_on_a_url_without_the_token(running: Running, tmp_path: Path) -> None:
    """What the address bar shows once the page is up: asked of the browser itself (DevTools)."""
    from tests.fixtures.browser import chromium

    with chromium(tmp_path, f"{running.url}/?token={TOKEN}") as page:
        # The page rendered (its title is the sync state), at the bare URL: the token is in no tab.
        page.wait("document.title.startsWith('llmgw — ')")
        assert page.url() == running.url + "/"


@pytest.mark.skipif(not shutil.which("chromium"), reason="chromium is not installed (apt-get install chromium)")
def test_a_link_cut_short_opens_a_page_that_says_how_to_sign_in(running: Running, tmp_path: Path) -> None:
    """Seen: `up`'s link cut at 80 columns opened as a raw JSON 401 in the browser."""
    cut = f"{running.url}/?token={TOKEN[:len(TOKEN) // 2]}"
    dom = subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                          f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", cut],
                         capture_output=True, text=True, timeout=90, check=False).stdout
    assert "That token is not this controller" in dom and "admin.token" in dom and TOKEN not in dom
    # A program asking for JSON still gets JSON.
    status, body, _ = http("GET", running.url + "/", token=None)
    assert status == 401 and "error" in json.loads(body)
