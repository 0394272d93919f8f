"""The CLI's HTTP client for the admin API.

Where it talks, and with which token, is decided in one place for every command that calls a
controller: `llmgw.adminaccess` (``--url``/``--token``, ``--data-dir``, ``LLMGW_ADMIN_URL`` with
``LLMGW_ADMIN_TOKEN``; its docstring has the rule). `resolve_client` is that rule as a `Client`.

The token travels only in the Authorization header: never in a URL, a log line, an error
message or a repr, and never along a redirect (the admin API does not redirect; a server that
does is not one to follow with a token).

Synchronous (urllib) because a CLI does one request at a time; every call has a timeout.
Errors come back as `ApiError` with the server's own message, or a sentence saying the
controller cannot be reached — never a traceback.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmgw.adminaccess import ENV_TOKEN, ENV_URL, TOKEN_FILE, URL_FILE, add_options, resolve
from llmgw.errors import AccessError

__all__ = ["ENV_TOKEN", "ENV_URL", "TOKEN_FILE", "URL_FILE", "ApiError", "Client", "add_options", "resolve_client"]


class ApiError(Exception):
    def __init__(self, message: str, *, status: int = 0, body: Any = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = body


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Refuse redirects: urllib would replay the Authorization header to wherever they point."""

    def redirect_request(self, *_request: object) -> None:  # None: the 3xx comes back as an HTTPError
        return None


_OPENER = urllib.request.build_opener(_NoRedirect)


@dataclass
class Client:
    url: str
    token: str = field(repr=False)
    timeout: float = 30.0
    source: str = "--token"  # where the token came from, for the message when it is refused

    def request(self, method: str, path: str, body: Any = None, *, query: dict[str, Any] | None = None,
                actor: str | None = None, raw: bool = False) -> Any:
        q = {k: v for k, v in (query or {}).items() if v is not None}
        url = self.url.rstrip("/") + path + (("?" + urllib.parse.urlencode(q)) if q else "")
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(url, data=data, method=method)
        req.add_unredirected_header("Authorization", f"Bearer {self.token}")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if actor:
            req.add_header("X-Llmgw-Actor", actor)
        try:
            with _OPENER.open(req, timeout=self.timeout) as resp:
                payload = resp.read()
        except urllib.error.HTTPError as exc:
            payload = exc.read()
            try:
                parsed = json.loads(payload)
            except ValueError:
                parsed = None
            message = parsed.get("error") if isinstance(parsed, dict) else None
            if exc.code == 401:
                message = f"the controller at {self.url} refused the admin token from {self.source}"
            raise ApiError(message or f"HTTP {exc.code} from {url}", status=exc.code, body=parsed) from None
        except (urllib.error.URLError, OSError, TimeoutError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ApiError(f"cannot reach the controller at {self.url}: {reason}") from None
        if raw:
            return payload.decode("utf-8", errors="replace")
        return json.loads(payload) if payload else None


def resolve_client(url: str | None, token: str | None, data_dir: str | None, *,
                   env: Mapping[str, str] | None = None, default_dir: Path | None = None,
                   timeout: float = 30.0) -> Client:
    """A client whose URL and token come from one source (`llmgw.adminaccess.resolve`).

    Raises `ApiError` (with a sentence naming the flags to use) when no single source applies.
    """
    try:
        found = resolve(url, token, data_dir, env=env, default_dir=default_dir)
    except AccessError as exc:
        raise ApiError(str(exc)) from None
    return Client(found.url, found.token, timeout=timeout, source=found.source)
