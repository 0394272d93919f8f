"""Tokens of the organisation's OpenID Connect provider, verified here (issue 41).

A bearer token that looks like a JWT is checked against the provider named in the controller
config: its issuer exactly, this controller's audience (the client id unless configured), its
expiry, and a signature by one of the keys the provider publishes (its JWKS, found through
discovery). Keys rotate: a token signed by a key id not seen yet fetches the key set again, at
most once per ``REFRESH_EVERY`` so that a flood of forged key ids cannot make the controller a
client that hammers the provider. The role comes from the token's groups (``groups_claim``)
through the configured mapping; a person in no mapped group is known but may do nothing.

Only asymmetric signatures are accepted: ``none`` and the HMAC family would let anyone who knows
the client secret (or nothing at all) mint a token.
"""

from __future__ import annotations

import asyncio
import ipaddress
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import jwt

from llmgw.access.roles import Principal, Role, role_for_groups
from llmgw.safetext import visible

ALGORITHMS = ("RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA")
REFRESH_EVERY = 30.0  # seconds between two fetches of the key set for an unknown key id
FETCH_TIMEOUT = 5.0
LEEWAY = 30  # seconds of clock difference between this controller and the provider


class Refused(Exception):
    """A token this controller does not accept; the message says why (never the token)."""


@dataclass(frozen=True)
class OidcConfig:
    issuer: str
    client_id: str
    audience: str = ""  # "": the client id
    groups_claim: str = "groups"
    roles: Mapping[str, Role] = field(default_factory=dict)  # provider group -> role
    client_secret: str = field(default="", repr=False)  # for the dashboard's code exchange
    redirect_url: str = ""  # the dashboard's /auth/callback as the provider knows it ("": from the request)
    scopes: str = "openid email profile groups"

    @property
    def expected_audience(self) -> str:
        return self.audience or self.client_id


def is_jwt(token: str) -> bool:
    """Three dot-separated parts: a token for the provider's verifier, not a static secret."""
    return token.count(".") == 2 and token.startswith("ey")


def loopback(url: str) -> bool:
    """The URL's host is this machine: "localhost" or a loopback address (not a name that merely
    starts with 127., such as 127.attacker.example)."""
    host = urllib.parse.urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_url(url: str, what: str) -> str:
    """An https URL, or http on this machine only: keys fetched in the clear could be swapped."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme == "https" or (parts.scheme == "http" and loopback(url)):
        return url
    raise Refused(f"{what} {visible(url)} is not https (plain http only for a provider on this machine)")


class OidcVerifier:
    """Turns a provider's token into a :class:`Principal`; the I/O (discovery, keys) is lazy."""

    def __init__(self, config: OidcConfig, *, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self._clock = clock
        self._meta: dict[str, Any] | None = None
        self._keys: dict[str, jwt.PyJWK] = {}
        self._fetched = -REFRESH_EVERY
        self._discovery_failed = (-REFRESH_EVERY, "")
        self._lock = asyncio.Lock()

    async def metadata(self) -> dict[str, Any]:
        """The provider's discovery document (fetched once; its issuer must be the configured one)."""
        if self._meta is None:
            # A provider that is down is asked again at most every REFRESH_EVERY: each request
            # bearing a token must not become a fetch that waits out its timeout.
            failed_at, why = self._discovery_failed
            if self._clock() - failed_at < REFRESH_EVERY:
                raise Refused(why)
            url = check_url(self.config.issuer.rstrip("/") + "/.well-known/openid-configuration", "the issuer")
            try:
                meta = await _get_json(url)
            except Refused as exc:
                self._discovery_failed = (self._clock(), str(exc))
                raise
            if meta.get("issuer") != self.config.issuer:
                # A document naming another issuer: a proxy or a misconfiguration, and tokens it
                # vouches for are not the configured provider's.
                raise Refused(f"the provider's discovery names issuer {visible(meta.get('issuer'))}, "
                              f"not the configured {visible(self.config.issuer)}")
            for key in ("jwks_uri", "authorization_endpoint", "token_endpoint"):
                if not isinstance(meta.get(key), str):
                    raise Refused(f"the provider's discovery document has no {key}")
                check_url(meta[key], f"the provider's {key}")
            self._meta = meta
        return self._meta

    async def _key(self, kid: str) -> jwt.PyJWK:
        async with self._lock:
            kid = kid or ""
            if kid not in self._keys and self._clock() - self._fetched >= REFRESH_EVERY:
                meta = await self.metadata()
                self._fetched = self._clock()
                self._keys = _parse_keys(await _get_json(meta["jwks_uri"]))
            if kid in self._keys:
                return self._keys[kid]
            if not kid and len(self._keys) == 1:
                return next(iter(self._keys.values()))
        raise Refused(f"the token is signed by a key the provider does not publish (kid {visible(kid)})")

    async def principal(self, token: str) -> Principal:
        """Who ``token`` names, with the role of their groups; Refused with the reason otherwise."""
        return (await self.verify(token))[0]

    async def verify(self, token: str) -> tuple[Principal, dict[str, Any]]:
        """:meth:`principal` and the token's claims (the sign-in checks its nonce)."""
        cfg = self.config
        try:
            header = jwt.get_unverified_header(token)
            unverified = jwt.decode(token, options={"verify_signature": False})
        except jwt.PyJWTError:
            raise Refused("the bearer token is not a well-formed JWT") from None
        alg = header.get("alg")
        if alg not in ALGORITHMS:
            raise Refused(f"the token's signature algorithm {visible(alg)} is not accepted")
        if unverified.get("iss") != cfg.issuer:
            # Said before any key is fetched: another provider's token must not make this one's
            # key set be fetched again and again.
            raise Refused(f"the token is from another issuer ({visible(unverified.get('iss'))})")
        if header.get("typ") not in (None, "JWT", "jwt", "at+jwt", "application/at+jwt"):
            # A logout token or another JWT the provider signs is no sign-in.
            raise Refused(f"the token's type {visible(header.get('typ'))} is not a sign-in token")
        key = await self._key(str(header.get("kid") or ""))
        if not _fits(key, alg):
            raise Refused(f"the token's algorithm {visible(alg)} does not match its key's")
        try:
            claims = jwt.decode(token, key=key.key, algorithms=[alg], audience=cfg.expected_audience,
                                issuer=cfg.issuer, leeway=LEEWAY,
                                options={"require": ["exp", "iat", "iss", "aud", "sub"]})
        except jwt.ExpiredSignatureError:
            raise Refused("the token has expired: sign in again") from None
        except jwt.InvalidAudienceError:
            raise Refused(f"the token is for another audience, not {visible(cfg.expected_audience)}") from None
        except jwt.PyJWTError as exc:
            raise Refused(f"the token is not valid: {type(exc).__name__}") from None
        except (TypeError, ValueError):  # a key PyJWT cannot use with this algorithm: no 500
            raise Refused(f"the token's algorithm {visible(alg)} does not match its key") from None
        aud = claims.get("aud")
        if isinstance(aud, list) and len(aud) > 1 and claims.get("azp") != cfg.client_id:
            # OIDC Core: with several audiences, the party it was issued to must be this client.
            raise Refused("the token names several audiences and was not issued to this controller (azp)")
        groups = claims.get(cfg.groups_claim) or []
        if isinstance(groups, str):
            groups = [groups]
        if not isinstance(groups, list):
            groups = []
        name = _name(claims)
        return Principal(visible(name)[:200], role_for_groups([g for g in groups if isinstance(g, str)], cfg.roles),
                         via="oidc"), claims

    async def exchange(self, code: str, verifier: str, redirect_uri: str) -> str:
        """The ID token the provider gives for an authorization ``code`` (with its PKCE verifier)."""
        meta = await self.metadata()
        form = {"grant_type": "authorization_code", "code": code, "redirect_uri": redirect_uri,
                "client_id": self.config.client_id, "code_verifier": verifier}
        if self.config.client_secret:
            form["client_secret"] = self.config.client_secret
        timeout = aiohttp.ClientTimeout(total=FETCH_TIMEOUT * 2)
        try:
            async with aiohttp.ClientSession(timeout=timeout) as session, \
                    session.post(meta["token_endpoint"], data=form, allow_redirects=False) as r:
                data = await r.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as exc:
            raise Refused(f"the identity provider's token endpoint failed: {type(exc).__name__}") from None
        if not isinstance(data, dict) or not isinstance(data.get("id_token"), str):
            why = data.get("error") if isinstance(data, dict) else None
            raise Refused(f"the identity provider gave no ID token ({visible(why or 'no reason')})")
        return data["id_token"]


def _parse_keys(jwks: dict[str, Any]) -> dict[str, jwt.PyJWK]:
    keys: dict[str, jwt.PyJWK] = {}
    for raw in jwks.get("keys") or []:
        if not isinstance(raw, dict) or raw.get("use", "sig") != "sig":
            continue
        try:
            key = jwt.PyJWK(raw)
        except jwt.PyJWTError:
            continue  # a key type this controller cannot use: the others still verify
        keys[str(raw.get("kid") or "")] = key
    return keys


async def _get_json(url: str) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=FETCH_TIMEOUT)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session, \
                session.get(url, allow_redirects=False) as r:
            if r.status != 200:
                raise Refused(f"the identity provider answered {r.status} at {visible(url)}")
            data = await r.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise Refused(f"the identity provider could not be reached at {visible(url)}: {type(exc).__name__}") from None
    if not isinstance(data, dict):
        raise Refused(f"the identity provider sent no JSON object at {visible(url)}")
    return data


KEY_TYPE_ALGS = {"RSA": ("RS", "PS"), "EC": ("ES",), "OKP": ("EdDSA",)}


def _fits(key: jwt.PyJWK, alg: str) -> bool:
    """The token's algorithm is one its key can verify (an ES256 header on an RSA key raised a
    TypeError out of PyJWT: a 500 for anyone who sends one)."""
    return alg.startswith(KEY_TYPE_ALGS.get(str(key.key_type), ()))


RESERVED = ("admin-token", "controller", "unauthenticated", "git-webhook")


def _name(claims: dict[str, Any]) -> str:
    """Who the token names, for the audit trail and commit authors: a verified e-mail, else the
    username, else the subject; never a name llmgw gives its own actors (prefixed "oidc:" then)."""
    email = claims.get("email") if claims.get("email_verified") is not False else None
    found = (email, claims.get("preferred_username"), claims.get("sub"))
    name = next((v for v in found if isinstance(v, str) and v), "")
    name = visible(name)[:200]
    return f"oidc:{name}" if name in RESERVED or name.startswith(("router:", "oidc:")) else name
