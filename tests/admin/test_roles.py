"""Operators by name (issue 41): people signed in at a real OpenID provider (oidc-provider-mock),
their groups mapped to roles, each role against every route of the admin API.

The table is generated from the admin app's own routes, so a route added without a role, or
with a weaker one than its kind of action, fails here.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from llmgw.access.oidc import OidcConfig, OidcVerifier
from llmgw.access.roles import Need, Role
from llmgw.admin.app import POLICY, WEBHOOK, build_admin_app
from llmgw.control.feed import FeedHub
from llmgw.serving import listen
from tests.admin.conftest import TOKEN, Running
from tests.fixtures.browser import chromium
from tests.fixtures.oidc import Provider, oidc_provider
from tests.fixtures.oidc import _NoRedirect as NoRedirect

pytestmark = pytest.mark.slow

ROLES = {"fleet-viewers": Role.VIEWER, "gpu-ops": Role.OPERATOR, "fleet-admins": Role.ADMIN}
USERS = {
    "vera": {"email": "vera@example.com", "groups": ["fleet-viewers"]},
    "otto": {"email": "otto@example.com", "groups": ["fleet-viewers", "gpu-ops"]},
    "ada": {"email": "ada@example.com", "groups": ["fleet-admins"]},
    "nemo": {"email": "nemo@example.com", "groups": ["marketing"]},
}
ROLE_OF = {"vera": Role.VIEWER, "otto": Role.OPERATOR, "ada": Role.ADMIN, "nemo": None}
# What each kind of action must at least need (issue 41): reading is for viewers; the fleet's
# day-to-day actions for operators; the catalog, keys and takeover for admins.
AT_LEAST = {
    ("POST", "/api/v1/sync"): Role.OPERATOR,
    ("POST", "/api/v1/nodes/{node}/state"): Role.OPERATOR,
    ("POST", "/api/v1/rollouts/{model}/promote"): Role.OPERATOR,
    ("POST", "/api/v1/rollouts/{model}/abort"): Role.OPERATOR,
    ("POST", "/api/v1/weights/collect"): Role.OPERATOR,
    ("POST", "/api/v1/nodes/{node}/takeover"): Role.ADMIN,
    ("POST", "/api/v1/models"): Role.ADMIN,
    ("DELETE", "/api/v1/models/{name}"): Role.ADMIN,
    ("POST", "/api/v1/keys"): Role.ADMIN,
    ("DELETE", "/api/v1/keys/{name}"): Role.ADMIN,
    ("POST", "/api/v1/routers"): Role.ADMIN,
    ("DELETE", "/api/v1/routers/{name}"): Role.ADMIN,
    ("POST", "/auth/logout"): Role.VIEWER,  # anyone signed in may sign out (its form carries the CSRF token)
}


@dataclass
class SignedIn:
    url: str
    provider: Provider
    policy: dict[tuple[str, str], Need]
    tokens: dict[str, str]


def http(method: str, url: str, token: str | None, body: bytes | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            raw = r.read() if r.headers.get("Content-Type", "").startswith("application/json") else b"{}"
            return r.status, json.loads(raw or b"{}")
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            return exc.code, json.loads(raw)
        except ValueError:
            return exc.code, {"text": raw.decode(errors="replace")}


@pytest.fixture(scope="module")
def signed(running: Running) -> Iterator[SignedIn]:
    with oidc_provider(USERS) as provider:
        # A confidential client, as a controller would be registered (the provider wants a secret).
        verifier = OidcVerifier(OidcConfig(issuer=provider.issuer, client_id="llmgw", roles=ROLES,
                                           client_secret="test-client-secret"))

        async def start():  # noqa: ANN202
            app = build_admin_app(running.controller, token=TOKEN, hub=FeedHub(), oidc=verifier)
            runner = await listen(app, "127.0.0.1", 0, drain_timeout=1.0, max_connections=64, openai_errors=False)
            return app, runner

        app, runner = running.call(start())
        tokens = {sub: provider.id_token(sub) for sub in USERS}
        yield SignedIn(f"http://127.0.0.1:{runner.addresses[0][1]}", provider, dict(app[POLICY]), tokens)
        running.call(runner.cleanup())


def test_every_route_has_a_role_and_every_action_at_least_the_role_its_kind_needs(signed: SignedIn) -> None:
    routes = set(signed.policy)
    assert ("GET", "/api/v1/summary") in routes and WEBHOOK not in {p for _, p in routes}
    for (method, path), need in signed.policy.items():
        if method != "GET":
            assert need.role >= AT_LEAST.get((method, path), Role.OPERATOR), (method, path, need)
        if path.startswith("/api/v1/router/"):
            assert need.routers and need.role == Role.ADMIN, (method, path, need)
    assert set(AT_LEAST) <= routes  # the table above names routes that exist


def test_each_person_against_every_route(signed: SignedIn) -> None:
    # Names that match nothing: an allowed call reaches its handler and is answered there (a 404,
    # a 400 for the empty body), and nothing in the fleet is changed by the table.
    fill = {"{node}": "nope", "{name}": "nope", "{model}": "nope"}
    seen_refusals = 0
    for (method, path), need in sorted(signed.policy.items()):
        url = signed.url + path
        for k, v in fill.items():
            url = url.replace(k, v)
        for sub, role in ROLE_OF.items():
            allowed = role is not None and role >= need.role
            if allowed and path.startswith("/auth/"):
                continue  # a browser's sign-out, with its session and CSRF token: the browser test
            if allowed and need.routers:
                continue  # the watch stream runs until closed; a router's own tests cover it
            status, body = http(method, url, signed.tokens[sub], None if method == "GET" else b"{}")
            if allowed:
                assert status not in (401, 403), (method, path, sub, status, body)
            else:
                seen_refusals += 1
                assert status == 403, (method, path, sub, status, body)
                assert body["needs"] == need.describe() and need.describe() in body["error"]
                said = (f"{USERS[sub]['email']} has the {role.label} role" if role is not None
                        else f"{USERS[sub]['email']} has no role here")
                assert said in body["error"], body
    assert seen_refusals > 20


def test_the_admin_token_stays_the_break_glass_admin(signed: SignedIn) -> None:
    status, _ = http("POST", signed.url + "/api/v1/nodes/nope/takeover", TOKEN, b"{}")
    assert status == 404  # past the role check, into the handler


def test_a_token_from_another_issuer_for_another_audience_expired_or_forged_is_refused(signed: SignedIn) -> None:
    summary = signed.url + "/api/v1/summary"
    assert http("GET", summary, signed.tokens["vera"])[0] == 200
    with oidc_provider(USERS) as other:
        status, body = http("GET", summary, other.id_token("ada"))
    assert status == 401 and "another issuer" in body["error"], body
    status, body = http("GET", summary, signed.provider.id_token("ada", client_id="someone-else"))
    assert status == 401 and "another audience" in body["error"], body
    forged = signed.tokens["vera"].rsplit(".", 1)[0] + "." + signed.tokens["ada"].rsplit(".", 1)[1]
    status, body = http("GET", summary, forged)
    assert status == 401 and "not valid" in body["error"], body
    # A token whose payload claims the admin group, with vera's signature: the signature fails.
    head, _, sig = signed.tokens["vera"].split(".")
    ada_payload = signed.tokens["ada"].split(".")[1]
    status, body = http("POST", signed.url + "/api/v1/nodes/nope/takeover", f"{head}.{ada_payload}.{sig}", b"{}")
    assert status == 401, body
    for alg_none in ("eyJhbGciOiJub25lIiwidHlwIjoiSldUIn0." + ada_payload + ".",):
        status, body = http("GET", summary, alg_none)
        assert status == 401 and "algorithm" in body["error"], body
    # An EC algorithm on the provider's RSA key: refused, not a 500 (PyJWT raised a TypeError).
    es = base64.urlsafe_b64encode(b'{"alg":"ES256","typ":"JWT"}').rstrip(b"=").decode()
    status, body = http("GET", summary, f"{es}.{ada_payload}.{sig}")
    assert status == 401 and "does not match its key" in body["error"], body


def test_an_expired_token_is_refused_and_says_to_sign_in_again() -> None:
    with oidc_provider(USERS, token_age=timedelta(seconds=-120)) as provider:
        verifier = OidcVerifier(OidcConfig(issuer=provider.issuer, client_id="llmgw", roles=ROLES))
        token = provider.id_token("ada")
        refused = asyncio.run(_refusal(verifier, token))
    assert "expired" in refused


async def _refusal(verifier: OidcVerifier, token: str) -> str:
    from llmgw.access.oidc import Refused

    try:
        await verifier.principal(token)
    except Refused as exc:
        return str(exc)
    return "accepted"


def test_a_provider_that_is_down_refuses_with_a_reason_and_is_not_asked_at_every_request() -> None:
    # A listener that answers nothing an HTTP client accepts (it closes each connection), and counts.
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    port = server.getsockname()[1]
    accepted = [0]

    def accept() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            accepted[0] += 1
            conn.close()

    import threading

    threading.Thread(target=accept, daemon=True).start()
    verifier = OidcVerifier(OidcConfig(issuer=f"http://127.0.0.1:{port}", client_id="llmgw", roles=ROLES))

    def part(obj: dict) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj).encode()).rstrip(b"=").decode()

    token = f"{part({'alg': 'RS256', 'kid': 'k1'})}.{part({'iss': f'http://127.0.0.1:{port}', 'sub': 'x'})}.c2ln"

    async def twice() -> tuple[str, int, str]:
        first = await _refusal(verifier, token)
        return first, accepted[0], await _refusal(verifier, token)

    try:
        first, after_first, second = asyncio.run(twice())
    finally:
        server.close()
    assert "could not be reached" in first and second == first
    assert after_first >= 1 and accepted[0] == after_first  # the second was refused on the first one's word


@pytest.mark.skipif(not shutil.which("chromium"), reason="chromium is not installed (apt-get install chromium)")
def test_a_person_signs_in_to_the_dashboard_in_a_browser_and_out_again(signed: SignedIn, tmp_path: Path) -> None:
    with chromium(tmp_path, signed.url + "/") as page:
        # Not signed in: the page offers the provider.
        page.wait("document.querySelector('a[href=\"/auth/login\"]') !== null")
        page.evaluate("document.querySelector('a[href=\"/auth/login\"]').click()")
        # The provider's own page: otto is one of its users; the browser is sent back signed in.
        page.wait("document.querySelector('button[name=sub][value=otto]') !== null")
        assert page.url().startswith(signed.provider.issuer + "/oauth2/authorize?")
        assert "code_challenge_method=S256" in page.url() and "nonce=" in page.url()
        page.evaluate("document.querySelector('button[name=sub][value=otto]').click()")
        shown = page.wait("document.getElementById('signed-in') && document.getElementById('signed-in').textContent")
        assert "otto@example.com" in shown and "(operator" in shown
        assert page.url() == signed.url + "/"  # no code, no state left in the address
        (cookie,) = [c for c in page.cookies() if c["name"] == "llmgw_session"]
        assert cookie["httpOnly"] and cookie["sameSite"] == "Lax" and len(cookie["value"]) >= 40
        csrf = page.evaluate("document.querySelector('input[name=csrf]').value")

        session = {"Cookie": f"llmgw_session={cookie['value']}", "Content-Type": "application/json"}
        sync = signed.url + "/api/v1/sync"
        # The cookie alone does not make a POST (what another site's page could make this browser send).
        status, body = raw("POST", sync, b"{}", session)
        assert status == 403 and "CSRF" in body["error"], body
        assert raw("POST", sync, b"{}", {**session, "X-CSRF-Token": "guess"})[0] == 403
        status, _ = raw("POST", sync, b"{}", {**session, "X-CSRF-Token": csrf})
        assert status == 200  # an operator may sync
        status, body = raw("POST", signed.url + "/api/v1/nodes/nope/takeover", b"{}", {**session, "X-CSRF-Token": csrf})
        assert status == 403 and "the admin role" in body["error"]  # and may not take a node over

        # Signing out closes the session on the server: the cookie opens nothing any more.
        page.evaluate("document.querySelector('form[action=\"/auth/logout\"] button').click()")
        page.wait("document.querySelector('a[href=\"/auth/login\"]') !== null")
        assert raw("GET", signed.url + "/api/v1/summary", None, session)[0] == 401


def test_a_sign_in_answer_is_taken_once_and_only_with_its_state(signed: SignedIn) -> None:
    status, body = raw("GET", signed.url + "/auth/callback?code=x&state=made-up", None, {})
    assert status == 400 and "not started in this browser" in body["text"]
    # A callback link opened in another browser (sent by an attacker, read from a log): refused.
    req = urllib.request.Request(signed.url + "/auth/login")
    try:
        urllib.request.build_opener(NoRedirect).open(req, timeout=10)
    except urllib.error.HTTPError as exc:
        location, cookie = exc.headers["Location"], exc.headers["Set-Cookie"]
    state = urllib.parse.parse_qs(urllib.parse.urlsplit(location).query)["state"][0]
    assert f"llmgw_signin={state}" in cookie and "HttpOnly" in cookie and "Path=/auth/callback" in cookie
    status, body = raw("GET", f"{signed.url}/auth/callback?code=x&state={state}", None, {})
    assert status == 400 and "not started in this browser" in body["text"]
    status, body = raw("GET", f"{signed.url}/auth/callback?code=x&state={state}", None,
                       {"Cookie": f"llmgw_signin={state}"})
    assert status == 401 and "Not signed in" in body["text"]  # its own browser: on to the (bad) code
    status, body = raw("GET", signed.url + "/auth/callback?error=access_denied", None, {})
    assert status == 401 and "access_denied" in body["text"]
    status, body = raw("GET", signed.url + "/auth/callback?error=Call+%2B1-555-0100+now", None, {})
    assert status == 401 and "555" not in body["text"]  # the parameter is anyone's to write


def raw(method: str, url: str, body: bytes | None, headers: dict[str, str]) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            data = r.read()
            return r.status, json.loads(data) if r.headers.get_content_type() == "application/json" else {}
    except urllib.error.HTTPError as exc:
        data = exc.read()
        if exc.headers.get_content_type() == "application/json":
            return exc.code, json.loads(data)
        return exc.code, {"text": data.decode(errors="replace")}


def test_llmgw_login_keeps_a_persons_token_for_that_controller_only(signed: SignedIn, tmp_path: Path) -> None:
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "config"), "COLUMNS": "200"}
    env.pop("LLMGW_ADMIN_TOKEN", None)
    env.pop("LLMGW_ADMIN_URL", None)

    def llmgw(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "llmgw.cli.main", *args], input=stdin, capture_output=True,
                              text=True, timeout=60, env=env, check=False)

    bad = llmgw("login", "--url", signed.url, stdin="eyJhbGciOiJub25lIn0.e30.\n")
    assert bad.returncode == 1 and "nothing saved" in bad.stdout + bad.stderr
    assert not (tmp_path / "config" / "llmgw" / "logins.json").exists()
    done = llmgw("login", "--url", signed.url, stdin=signed.tokens["otto"] + "\n")
    assert done.returncode == 0 and "as otto@example.com (operator)" in done.stdout, done.stdout + done.stderr
    saved = tmp_path / "config" / "llmgw" / "logins.json"
    assert stat.S_IMODE(saved.stat().st_mode) == 0o600
    status = llmgw("status", "--url", signed.url)
    assert status.returncode == 0 and "sync" in status.stdout, status.stdout + status.stderr
    takeover = llmgw("status", "--url", signed.url.replace("127.0.0.1", "localhost"))
    assert takeover.returncode != 0 and "without a token" in takeover.stdout + takeover.stderr  # another address
    assert llmgw("logout", "--url", signed.url).returncode == 0
    assert llmgw("status", "--url", signed.url).returncode != 0


def test_every_change_and_refused_attempt_is_on_the_audit_chain_and_an_edit_is_found(
        signed: SignedIn, running: Running, tmp_path: Path) -> None:
    import sqlite3

    before = raw("GET", signed.url + "/api/v1/audit?limit=0", None, {"Authorization": f"Bearer {TOKEN}"})[1]
    last = before[-1]["id"] if before else 0
    otto, vera = signed.tokens["otto"], signed.tokens["vera"]
    assert http("POST", signed.url + "/api/v1/sync", otto, b"{}")[0] == 200
    assert http("POST", signed.url + "/api/v1/nodes/nope/takeover", vera, b"{}")[0] == 403
    assert http("POST", signed.url + "/api/v1/sync", "not-a-token", b"{}")[0] == 401
    status, rows = raw("GET", f"{signed.url}/api/v1/audit?after={last}", None, {"Authorization": f"Bearer {vera}"})
    assert status == 200
    rows = [r for r in rows if r["who"] != "controller"]  # its own acts meanwhile, if any
    mine = [(r["who"], r["role"], r["action"], r["result"].split(" ")[0]) for r in rows]
    assert mine == [("otto@example.com", "operator", "POST /api/v1/sync", "200"),
                    ("vera@example.com", "viewer", "POST /api/v1/nodes/nope/takeover", "403"),
                    ("unauthenticated", "none", "POST /api/v1/sync", "401")], mine
    applied = running.controller.follower.status.applied_sha
    assert all(r["revision"] == applied and r["source"] == "127.0.0.1" for r in rows)
    assert "needs the admin role" in rows[1]["result"]

    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "config")}

    def llmgw(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "llmgw.cli.main", *args, "--url", signed.url, "--token", TOKEN],
                              capture_output=True, text=True, timeout=60, env=env, check=False)

    shown = llmgw("audit", "--since", "1h")
    assert shown.returncode == 0 and "otto@example.com" in shown.stdout and "takeover" in shown.stdout
    assert llmgw("audit", "verify").returncode == 0

    # An edit behind the controller's back (its SQLite file) is found, at the row edited.
    target = rows[0]["id"]
    db = sqlite3.connect(running.controller.store.where)
    try:
        db.execute("UPDATE audit SET who = 'mallory' WHERE id = ?", (target,))
        db.commit()
        broken = llmgw("audit", "verify")
        assert broken.returncode == 1 and f"broken at row {target}" in broken.stdout, broken.stdout + broken.stderr
    finally:
        db.execute("UPDATE audit SET who = 'otto@example.com' WHERE id = ?", (target,))
        db.commit()
        db.close()
    assert llmgw("audit", "verify").returncode == 0


def test_behind_tls_the_cookies_carry_the_browsers_prefixes_and_sign_ins_are_rate_limited(running: Running) -> None:
    """A controller behind a TLS proxy (its redirect_url is https): the sign-in's cookie is
    __Secure-, the session's __Host- (Secure, the whole host, no Domain: a sibling subdomain or a
    plain-http page cannot plant one), and the whole flow works under those names. One address
    may start LOGINS_PER_MINUTE sign-ins a minute; the next is told to wait."""
    from llmgw.admin.signin import LOGINS_PER_MINUTE

    redirect = "https://llmgw.example/auth/callback"
    with oidc_provider(USERS) as provider:
        verifier = OidcVerifier(OidcConfig(issuer=provider.issuer, client_id="llmgw", roles=ROLES,
                                           client_secret="test-client-secret", redirect_url=redirect))

        async def start():  # noqa: ANN202
            app = build_admin_app(running.controller, token=TOKEN, hub=FeedHub(), oidc=verifier)
            return await listen(app, "127.0.0.1", 0, drain_timeout=1.0, max_connections=64, openai_errors=False)

        runner = running.call(start())
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        try:
            opener = urllib.request.build_opener(NoRedirect)

            def redirected(req: urllib.request.Request) -> Any:
                """The redirect's headers (the answer read and closed)."""
                try:
                    opener.open(req, timeout=20)
                except urllib.error.HTTPError as exc:
                    with exc:
                        exc.read()
                        return exc
                raise AssertionError("no redirect")

            started = redirected(urllib.request.Request(url + "/auth/login"))
            cookie = started.headers["Set-Cookie"]
            authorize = started.headers["Location"]
            state = urllib.parse.parse_qs(urllib.parse.urlsplit(authorize).query)["state"][0]
            assert cookie.startswith(f"__Secure-llmgw_signin={state};") and "Secure" in cookie
            assert "HttpOnly" in cookie and "Path=/auth/callback" in cookie
            assert urllib.parse.parse_qs(urllib.parse.urlsplit(authorize).query)["redirect_uri"] == [redirect]
            # The person signs in at the provider, which sends the browser to the configured callback.
            form = urllib.parse.urlencode({"sub": "otto", "action": "authorize"}).encode()
            back = redirected(urllib.request.Request(authorize, data=form)).headers["Location"]
            assert back.startswith(redirect + "?")
            # The proxy hands the callback on; the browser sends the prefixed cookie (a plain one is not it).
            callback = url + "/auth/callback?" + urllib.parse.urlsplit(back).query
            status, body = raw("GET", callback, None, {"Cookie": f"llmgw_signin={state}"})
            assert status == 400 and "not started in this browser" in body["text"]
            done = redirected(urllib.request.Request(callback, headers={"Cookie": f"__Secure-llmgw_signin={state}"}))
            session = [c for c in done.headers.get_all("Set-Cookie") if c.startswith("__Host-llmgw_session=")]
            assert len(session) == 1 and "Secure" in session[0] and "Path=/;" in session[0] + ";"
            assert "Domain" not in session[0] and "HttpOnly" in session[0]
            sid = session[0].split(";")[0].split("=", 1)[1]
            assert raw("GET", url + "/api/v1/whoami", None, {"Cookie": f"__Host-llmgw_session={sid}"})[0] == 200
            assert raw("GET", url + "/api/v1/whoami", None, {"Cookie": f"llmgw_session={sid}"})[0] == 401

            # One address, many sign-ins started (each holds a pending state): the limit says wait.
            answers = [raw("GET", url + "/auth/login", None, {})[0] for _ in range(LOGINS_PER_MINUTE + 1)]
            assert 429 in answers and answers.count(429) >= 1
            status, body = raw("GET", url + "/auth/login", None, {})
            assert status == 429 and "too many sign-ins" in body["text"]
        finally:
            running.call(runner.cleanup())
