"""The CLI's HTTP client for the admin API, and the one place that decides where it talks.

Every command that calls the admin API gets its address and token from `resolve_client`,
always both from one source, the first that applies:

1. ``--url U --token T``: both flags.
2. ``--data-dir D``: both from D, as `llmgw up --data-dir D` recorded them: ``D/admin.url``
   (written once its listeners are up, removed when it stops) and ``D/admin.token``.
3. ``LLMGW_ADMIN_URL`` and ``LLMGW_ADMIN_TOKEN``: both from the environment.
4. The default data dir of `llmgw up` (as 2).

A URL and a token from different sources are never combined. A token is good for the
controller that issued it; sent anywhere else it is handed to whoever listens there (the bug
this prevents: `llmgw status --data-dir D` sent D's token to the default port, another server).
So, precisely:

- ``--token`` without ``--url`` is an error, and so is ``--token`` with ``--data-dir``;
- ``--url`` without ``--token`` never chooses where a token goes: it must name the URL of the
  source that 2–4 pick (``llmgw status --data-dir D --url U`` checks that D's `up` is at U),
  and is an error otherwise;
- one of the two environment variables without the other is an error once step 3 is reached
  (rather than silently falling through to step 4);
- a source that supplies only one half (a data dir with a token but no URL) is an error.

The token travels only in the Authorization header: never in a URL, a log line, an error
message or a repr, and never along a redirect (the admin API does not redirect; a server that
does is not one to follow with a token).

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
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmgw.paths import default_data_dir

ENV_URL = "LLMGW_ADMIN_URL"
ENV_TOKEN = "LLMGW_ADMIN_TOKEN"
TOKEN_FILE = "admin.token"
URL_FILE = "admin.url"


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
                   env: Mapping[str, str] | None = None, default_dir: Path | None = None) -> Client:
    """A client whose URL and token come from one source, by the rule in this module's docstring.

    ``env`` and ``default_dir`` default to ``os.environ`` and `llmgw up`'s default data dir.
    Raises `ApiError` (with a sentence naming the flags to use) when no single source applies.
    """
    env = os.environ if env is None else env
    url, token = url or None, token or None
    if token:
        if data_dir:
            raise ApiError(f"--token and --data-dir both name a token: use --data-dir {data_dir} alone "
                           "(its `llmgw up` recorded both URL and token), or --url with --token")
        if not url:
            raise ApiError("--token needs --url: a token is only sent to an address given with it")
        return _checked(Client(url, token, source="--token"))
    if data_dir:
        found = _from_data_dir(Path(data_dir))
    elif env.get(ENV_URL) or env.get(ENV_TOKEN):
        if not (env.get(ENV_URL) and env.get(ENV_TOKEN)):
            have, missing = (ENV_URL, ENV_TOKEN) if env.get(ENV_URL) else (ENV_TOKEN, ENV_URL)
            raise ApiError(f"{have} is set but {missing} is not: set both, or pass --url and --token")
        found = Client(env[ENV_URL], env[ENV_TOKEN], source=f"${ENV_TOKEN}")
    else:
        found = _from_data_dir(default_dir or default_data_dir(), default=True)
    if url and not _same(url, found.url):
        raise ApiError(f"{url} was given without a token, and the token found ({found.source}) belongs to "
                       f"{found.url}, so it is not sent there: pass the token for {url} too (--token), "
                       "or drop the URL")
    return _checked(found)


def _from_data_dir(d: Path, *, default: bool = False) -> Client:
    token_file, url_file = d / TOKEN_FILE, d / URL_FILE
    try:
        token = token_file.read_text().strip()
    except OSError:
        token = ""
    if not token:
        if default:
            raise ApiError(f"no admin URL and token: pass --url and --token, set {ENV_URL} and {ENV_TOKEN}, "
                           f"or run `llmgw up` first (its data dir {d} has no {TOKEN_FILE})")
        raise ApiError(f"--data-dir {d}: no {TOKEN_FILE} there (not the data dir of a `llmgw up`)")
    try:
        url = url_file.read_text().strip()
    except OSError:
        url = ""
    if not url:
        # Guessing the default port here is the bug this module exists to prevent.
        raise ApiError(f"{d} has an admin token but no {URL_FILE}: is `llmgw up --data-dir {d}` running? "
                       "(it records its admin URL once it listens, and removes it when it stops)")
    return Client(url, token, source=str(token_file))


def _same(a: str, b: str) -> bool:
    return a.rstrip("/") == b.rstrip("/")


def _checked(client: Client) -> Client:
    # urllib also opens file:// and ftp:// URLs; an admin URL is HTTP.
    parsed = urllib.parse.urlsplit(client.url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ApiError(f"admin URL {client.url!r} is not an http:// or https:// address")
    if parsed.username or parsed.password or parsed.query:
        raise ApiError(f"admin URL {parsed.scheme}://{parsed.hostname}…: no credentials or query in it; "
                       "the token goes in --token or the environment")
    return client
