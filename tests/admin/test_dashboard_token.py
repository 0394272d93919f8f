"""The dashboard's `?token=`: traded for a cookie once, then gone from every URL the browser keeps."""

from __future__ import annotations

import html
import http.client
import json
import re
import shutil
import ssl
import subprocess
import urllib.parse
from http.cookies import SimpleCookie
from pathlib import Path

import pytest

from llmgw.admin import views
from llmgw.admin.app import COOKIE
from llmgw.admin.labels import confinement_label
from tests.admin.conftest import TOKEN, Running

pytestmark = pytest.mark.slow


def get(base: str, target: str, *, method: str = "GET", headers: dict[str, str] | None = None,
        context: ssl.SSLContext | None = None) -> tuple[int, http.client.HTTPMessage, str]:
    """One request, redirects not followed: the tests look at the 303 itself."""
    u = urllib.parse.urlsplit(base)
    conn = (http.client.HTTPSConnection(u.hostname, u.port, timeout=20, context=context) if u.scheme == "https"
            else http.client.HTTPConnection(u.hostname, u.port, timeout=20))
    try:
        conn.request(method, target, headers=headers or {})
        r = conn.getresponse()
        return r.status, r.headers, r.read().decode()
    finally:
        conn.close()


def sign_in(running: Running, target: str = f"/?token={TOKEN}") -> tuple[str, SimpleCookie, str]:
    status, headers, _ = get(running.url, target)
    assert status == 303
    (raw,) = headers.get_all("Set-Cookie")
    return headers["Location"], SimpleCookie(raw), raw


def test_the_token_is_traded_for_a_cookie_and_dropped_from_the_url(running: Running) -> None:
    location, cookie, raw = sign_in(running)
    assert location == "/"
    morsel = cookie[COOKIE]
    attrs = {a.strip().split("=")[0].lower(): a.strip() for a in raw.split(";")[1:]}
    assert attrs["httponly"] and attrs["samesite"] == "SameSite=Strict" and attrs["path"] == "Path=/"
    assert "secure" not in attrs  # plain http: a Secure cookie would never come back
    assert TOKEN not in raw  # the cookie opens the page; it is not the API's bearer token

    status, headers, page = get(running.url, location, headers={"Cookie": f"{COOKIE}={morsel.value}"})
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert 'data-node="n1"' in page and TOKEN not in page
    assert headers["Cache-Control"] == "no-store" and headers["Referrer-Policy"] == "no-referrer"
    (refresh,) = re.findall(r'<meta http-equiv="refresh" content="([^"]*)">', page)
    assert refresh == "5; url=/"

    # Other query parameters survive the trade; only the token goes.
    location, _, _ = sign_in(running, f"/?a=1&token={TOKEN}&b=2")
    assert location == "/?a=1&b=2"


def test_a_wrong_token_is_401_and_sets_no_cookie(running: Running) -> None:
    _, cookie, _ = sign_in(running)
    for headers in ({}, {"Cookie": f"{COOKIE}={cookie[COOKIE].value}"}):
        status, got, body = get(running.url, "/?token=wrong", headers=headers)
        assert status == 401 and got.get_all("Set-Cookie") is None and "wrong" not in body
    status, got, _ = get(running.url, "/?token=", headers={})
    assert status == 401 and got.get_all("Set-Cookie") is None
    status, _, _ = get(running.url, "/", headers={"Cookie": f"{COOKIE}=forged"})
    assert status == 401


def test_the_cookie_opens_the_dashboard_and_nothing_else(running: Running) -> None:
    _, cookie, _ = sign_in(running)
    jar = {"Cookie": f"{COOKIE}={cookie[COOKIE].value}"}
    assert get(running.url, "/api/v1/summary", headers=jar)[0] == 401
    # What another site could make a signed-in browser send: a state change riding on the cookie.
    for method, path in (("POST", "/api/v1/sync"), ("POST", "/api/v1/nodes/n1/state"), ("POST", "/")):
        assert get(running.url, path, method=method, headers={**jar, "Origin": "http://evil.invalid"})[0] == 401
    assert get(running.url, "/api/v1/summary",
               headers={"Authorization": f"Bearer {cookie[COOKIE].value}"})[0] == 401
    # A bearer token still opens the page, for scripts and the CLI's tests.
    assert get(running.url, "/", headers={"Authorization": f"Bearer {TOKEN}"})[0] == 200


def test_the_cookie_is_secure_over_https(running: Running, tmp_path: Path) -> None:
    if not shutil.which("openssl"):
        pytest.skip("openssl is not installed")
    from aiohttp import web

    from llmgw.admin.app import build_admin_app

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)

    async def serve() -> web.AppRunner:
        runner = web.AppRunner(build_admin_app(running.controller, token=TOKEN), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=server_ctx).start()
        return runner

    runner = running.call(serve())
    try:
        base = f"https://127.0.0.1:{runner.addresses[0][1]}"
        status, headers, _ = get(base, f"/?token={TOKEN}", context=ssl.create_default_context(cafile=str(cert)))
        assert status == 303
        (raw,) = headers.get_all("Set-Cookie")
        assert "secure" in [a.strip().lower() for a in raw.split(";")]
    finally:
        running.call(runner.cleanup())


def test_dashboard_shows_confinement(running: Running, monkeypatch: pytest.MonkeyPatch) -> None:
    _, cookie, _ = sign_in(running)
    jar = {"Cookie": f"{COOKIE}={cookie[COOKIE].value}"}

    def cells(page: str) -> dict[str, tuple[str, str]]:
        rows = re.findall(r'<tr data-node="(\w+)">.*?<td class="(confinement[^"]*)" title="([^"]*)">([^<]*)</td>',
                          page, re.S)
        return {node: (cls, f"{label} | {title}") for node, cls, title, label in rows}

    # What the fleet's agents report, in the words `llmgw nodes` uses.
    _, _, page = get(running.url, "/", headers=jar)
    _, _, raw = get(running.url, "/api/v1/nodes", headers={"Authorization": f"Bearer {TOKEN}"})
    api = {n["id"]: n.get("confinement") for n in json.loads(raw)}
    assert "<th>confinement</th>" in page
    assert {k: v[1] for k, v in cells(page).items()} == {
        k: f"{confinement_label(c)} | {html.escape((c or {}).get('detail') or '')}" for k, c in api.items()}

    reported = {"n1": {"user": "nobody", "sandbox": "bwrap", "detail": "bwrap <0.8>"},
                "n2": {"user": "root", "sandbox": "none", "detail": "no bwrap", "problem": "root without bwrap"},
                "n3": None}
    original = views.nodes_view

    def with_confinement(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - wraps the real view
        n1, n2 = original(*args, **kwargs)
        return [{**n, "confinement": reported[n["id"]]} for n in (n1, n2, {**n2, "id": "n3"})]

    monkeypatch.setattr(views, "nodes_view", with_confinement)
    _, _, page = get(running.url, "/", headers=jar)
    assert cells(page) == {"n1": ("confinement", "bwrap as nobody | bwrap &lt;0.8&gt;"),
                           "n2": ("confinement err", "root! | no bwrap"), "n3": ("confinement", "unknown | ")}
    assert re.search(r'<tr data-node="n2">.*?<td class="err">refuses starts: root without bwrap</td></tr>', page, re.S)
