"""The dashboard's sign-in at the organisation's OpenID provider (issue 41): the authorization
code flow with PKCE, a server-side session behind an HttpOnly cookie, CSRF on every POST.

- ``GET /auth/login`` sends the browser to the provider with a fresh state, nonce and PKCE
  challenge (kept here, llmgw.access.sessions);
- ``GET /auth/callback`` takes the provider's answer once: the code is exchanged with the
  verifier, the ID token verified like any bearer token (issuer, audience, expiry, signature)
  and its nonce checked, then a session is opened for as long as the token allows (8 h at most);
- ``POST /auth/logout`` (its form carries the session's CSRF token) closes it.

The cookie is ``SameSite=Lax``: the browser arrives from the provider's page by a cross-site
redirect, on which a Strict cookie would not be sent. Lax still keeps it off cross-site POSTs,
and every POST a session makes must also carry its CSRF token.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import html
import logging
import time
import urllib.parse
from collections.abc import Callable

from aiohttp import web

from llmgw.access.oidc import OidcVerifier, Refused
from llmgw.access.sessions import SIGN_IN_WINDOW, Session, Sessions, csrf_ok

log = logging.getLogger(__name__)

LOGIN, CALLBACK, LOGOUT = "/auth/login", "/auth/callback", "/auth/logout"
SESSION_COOKIE = "llmgw_session"
SIGN_IN_COOKIE = "llmgw_signin"  # the state of the sign-in this browser started
# Behind TLS the names carry the browser's prefixes: a __Host- cookie is taken only if Secure, for
# the whole host and set by it (no Domain), so a sibling subdomain or a plain-http page cannot
# plant a session of its choosing (session fixation); the sign-in's, on one path, is __Secure-.
SECURE_PREFIX = {SESSION_COOKIE: "__Host-", SIGN_IN_COOKIE: "__Secure-"}
LOGINS_PER_MINUTE = 30  # sign-ins one address may start: each holds a pending state until it expires
OAUTH_ERRORS = frozenset({"access_denied", "invalid_request", "unauthorized_client", "unsupported_response_type",
                          "invalid_scope", "server_error", "temporarily_unavailable", "login_required",
                          "consent_required", "interaction_required", "account_selection_required"})
VERIFIER: web.AppKey[OidcVerifier] = web.AppKey("oidc", OidcVerifier)
SESSIONS: web.AppKey[Sessions] = web.AppKey("sessions", Sessions)
LOGIN_LIMIT: web.AppKey[LoginLimit] = web.AppKey("login_limit")
NO_STORE = {"Cache-Control": "no-store", "Referrer-Policy": "no-referrer"}


def page(status: int, title: str, text: str) -> web.Response:
    body = (f'<!doctype html><html><head><meta charset="utf-8"><title>llmgw: {html.escape(title)}</title></head>'
            f'<body style="font-family: sans-serif; max-width: 40em; margin: 3em auto"><h1>{html.escape(title)}</h1>'
            f'<p>{html.escape(text)}</p><p><a href="{LOGIN}">Sign in again</a></p></body></html>')
    return web.Response(status=status, text=body, content_type="text/html", headers=NO_STORE)


def session_of(request: web.Request) -> tuple[str, Session] | None:
    sessions = request.app.get(SESSIONS)
    sid = request.cookies.get(cookie_name(request, SESSION_COOKIE), "")
    if sessions is None or not sid:
        return None
    session = sessions.get(sid)
    return (sid, session) if session is not None else None


def post_allowed(request: web.Request, session: Session) -> bool:
    """A POST on a session carries its CSRF token: a header from a page's script, or a form field."""
    return csrf_ok(session, request.headers.get("X-CSRF-Token", ""))


async def login(request: web.Request) -> web.Response:
    verifier = request.app[VERIFIER]
    if not request.app[LOGIN_LIMIT].take(request.remote or ""):
        return page(429, "Too many sign-ins", "too many sign-ins were started from this address; wait a minute")
    try:
        meta = await verifier.metadata()
    except Refused as exc:
        log.warning("sign-in: %s", exc)
        return page(502, "The identity provider cannot be reached", str(exc))
    redirect_uri = verifier.config.redirect_url or f"{request.scheme}://{request.host}{CALLBACK}"
    state, pending = request.app[SESSIONS].begin(redirect_uri)
    challenge = base64.urlsafe_b64encode(hashlib.sha256(pending.verifier.encode()).digest()).rstrip(b"=").decode()
    query = urllib.parse.urlencode({
        "response_type": "code", "client_id": verifier.config.client_id, "redirect_uri": redirect_uri,
        "scope": verifier.config.scopes, "state": state, "nonce": pending.nonce,
        "code_challenge": challenge, "code_challenge_method": "S256"})
    sep = "&" if "?" in meta["authorization_endpoint"] else "?"
    response = web.Response(status=302, headers={"Location": f"{meta['authorization_endpoint']}{sep}{query}",
                                                  **NO_STORE})
    # The browser that starts a sign-in is the one that may finish it: a callback link opened
    # elsewhere (sent by an attacker, or read from a log) finds no such cookie there.
    response.set_cookie(cookie_name(request, SIGN_IN_COOKIE), state, path=CALLBACK, httponly=True, samesite="Lax",
                        secure=_secure(request), max_age=int(SIGN_IN_WINDOW))
    return response


async def callback(request: web.Request) -> web.Response:
    if "error" in request.query:
        # Only the protocol's own codes are shown: the parameter is anyone's to write in a link.
        code = request.query.get("error", "")
        said = code if code in OAUTH_ERRORS else "an error"
        return page(401, "Not signed in", f"the identity provider answered with {said}")
    state = request.query.get("state", "")
    if not hmac.compare_digest(state.encode("utf-8", "surrogateescape"),
                               request.cookies.get(cookie_name(request, SIGN_IN_COOKIE), "").encode(
                                   "utf-8", "surrogateescape")):
        return page(400, "Not signed in", "this sign-in was not started in this browser; start again here")
    pending = request.app[SESSIONS].finish(state)
    if pending is None:
        return page(400, "Not signed in", "this sign-in expired or was already used; start again")
    verifier = request.app[VERIFIER]
    try:
        token = await verifier.exchange(request.query.get("code", ""), pending.verifier, pending.redirect_uri)
        principal, claims = await verifier.verify(token)
    except Refused as exc:
        return page(401, "Not signed in", str(exc))
    if claims.get("nonce") != pending.nonce:
        return page(401, "Not signed in", "the provider's token was not made for this sign-in (its nonce differs)")
    if principal.role is None:
        return page(403, "No role here", f"signed in as {principal.name}, but none of your groups has a role "
                                         "on this controller; ask its admin")
    sid, _ = request.app[SESSIONS].open(principal, float(claims["exp"]))
    response = web.Response(status=303, headers={"Location": "/", **NO_STORE})
    response.set_cookie(cookie_name(request, SESSION_COOKIE), sid, path="/", httponly=True, samesite="Lax",
                        secure=_secure(request))
    response.del_cookie(cookie_name(request, SIGN_IN_COOKIE), path=CALLBACK)
    log.info("sign-in: %s (%s)", principal.name, principal.role_label)
    return response


async def logout(request: web.Request) -> web.Response:
    found = session_of(request)
    form = await request.post()
    if found is None or not csrf_ok(found[1], str(form.get("csrf", ""))):
        return page(403, "Not signed out", "this form is not this session's (its CSRF token differs)")
    request.app[SESSIONS].close(found[0])
    response = web.Response(status=303, headers={"Location": "/", **NO_STORE})
    response.del_cookie(cookie_name(request, SESSION_COOKIE), path="/")
    return response


def cookie_name(request: web.Request, name: str) -> str:
    """``name``, with its browser prefix when the cookies are Secure."""
    return SECURE_PREFIX[name] + name if _secure(request) else name


class LoginLimit:
    """Sign-ins started per address in the last minute (a bounded table: a flood of addresses
    clears it rather than grow it)."""

    def __init__(self, per_minute: int = LOGINS_PER_MINUTE, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_minute, self.clock = per_minute, clock
        self._seen: dict[str, list[float]] = {}

    def take(self, address: str) -> bool:
        now = self.clock()
        if len(self._seen) > 10_000:
            self._seen.clear()
        recent = [t for t in self._seen.get(address, ()) if now - t < 60.0]
        if len(recent) >= self.per_minute:
            self._seen[address] = recent
            return False
        self._seen[address] = [*recent, now]
        return True


def _secure(request: web.Request) -> bool | None:
    """Secure cookies over https, also when TLS ends at a proxy in front (an https redirect_url says so)."""
    verifier = request.app.get(VERIFIER)
    behind_tls = verifier is not None and verifier.config.redirect_url.startswith("https://")
    return True if request.secure or behind_tls else None


def add_routes(app: web.Application, verifier: OidcVerifier) -> None:
    app[VERIFIER] = verifier
    app[SESSIONS] = Sessions()
    app[LOGIN_LIMIT] = LoginLimit()
    app.router.add_get(LOGIN, login)
    app.router.add_get(CALLBACK, callback)
