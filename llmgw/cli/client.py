"""The CLI's HTTP client for the admin API: address and token from flags, env, or a local `up`.

Synchronous (urllib) because a CLI does one request at a time; every call has a timeout.
Errors come back as `ApiError` with the server's own message, or a sentence saying the
controller cannot be reached — never a traceback.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmgw.paths import default_data_dir

ENV_URL = "LLMGW_ADMIN_URL"
ENV_TOKEN = "LLMGW_ADMIN_TOKEN"
DEFAULT_URL = "http://127.0.0.1:8081"
TOKEN_FILE = "admin.token"


class ApiError(Exception):
    def __init__(self, message: str, *, status: int = 0, body: Any = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = body


@dataclass
class Client:
    url: str
    token: str
    timeout: float = 30.0

    def request(self, method: str, path: str, body: Any = None, *, query: dict[str, Any] | None = None,
                actor: str | None = None, raw: bool = False) -> Any:
        q = {k: v for k, v in (query or {}).items() if v is not None}
        url = self.url.rstrip("/") + path + (("?" + urllib.parse.urlencode(q)) if q else "")
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(url, data=data, method=method)
        req.add_header("Authorization", f"Bearer {self.token}")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if actor:
            req.add_header("X-Llmgw-Actor", actor)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                payload = resp.read()
        except urllib.error.HTTPError as exc:
            payload = exc.read()
            try:
                parsed = json.loads(payload)
            except ValueError:
                parsed = None
            message = parsed.get("error") if isinstance(parsed, dict) else None
            if exc.code == 401:
                message = "the controller refused the admin token (check --token, LLMGW_ADMIN_TOKEN)"
            raise ApiError(message or f"HTTP {exc.code} from {url}", status=exc.code, body=parsed) from None
        except (urllib.error.URLError, OSError, TimeoutError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ApiError(f"cannot reach the controller at {self.url}: {reason}") from None
        if raw:
            return payload.decode("utf-8", errors="replace")
        return json.loads(payload) if payload else None


def resolve_client(url: str | None, token: str | None, data_dir: str | None) -> Client:
    """Flags first, then the environment, then a local `llmgw up`'s token file."""
    url = url or os.environ.get(ENV_URL) or DEFAULT_URL
    token = token or os.environ.get(ENV_TOKEN)
    if not token:
        path = Path(data_dir) if data_dir else default_data_dir()
        try:
            token = (path / TOKEN_FILE).read_text().strip()
        except OSError:
            token = ""
    if not token:
        raise ApiError("no admin token: pass --token, set LLMGW_ADMIN_TOKEN, or run `llmgw up` here first")
    return Client(url, token)
