"""Where a command finds the controller's admin API: one rule, one set of flags, for every command.

The operator commands (`llmgw status`, `nodes`, ... through `llmgw.cli.client`), `llmgw diff`,
`llmgw inventory export` and the standalone `llmgw router` all name a controller the same way,
``--url`` and ``--token`` (``--data-dir`` for a local `llmgw up`, ``LLMGW_ADMIN_URL`` and
``LLMGW_ADMIN_TOKEN`` in the environment), so an operator learns it once and a hint printed by
one command is true of every other. Older spellings stay as aliases of the same option
(``diff --controller``, ``router --controller``/``--admin-token``). This module sits outside
both the CLI and the router (each may import it; neither may import the other).

The URL and the token come from one source, the first that applies:

1. ``--url U`` with a token: ``--token T``, or ``$LLMGW_ADMIN_TOKEN`` when ``LLMGW_ADMIN_URL`` is
   not set (the token then has no address of its own, and a CI job or a service keeps it out of
   ``ps`` this way: ``LLMGW_ADMIN_TOKEN=… llmgw router --url U``).
   ``--url U`` alone, with no ``LLMGW_ADMIN_URL``: the token `llmgw login` kept for exactly U
   (a person's ID token from the organisation's provider; ``logins.json`` in the XDG config
   dir, mode 0600, keyed by URL so it goes nowhere else).
2. ``--data-dir D``: both from D, as `llmgw up --data-dir D` recorded them: ``D/admin.url``
   (written once its listeners are up, removed when it stops) and ``D/admin.token``; the URL only
   while a process holds the lock of D's controller (an `up` killed with -9 leaves admin.url).
3. ``LLMGW_ADMIN_URL`` and ``LLMGW_ADMIN_TOKEN``: both from the environment.
4. The default data dir of `llmgw up` (as 2).

A URL and a token from sources that each name an address are never combined. A token is good
for the controller that issued it; sent anywhere else it is handed to whoever listens there
(the bug this prevents: `llmgw status --data-dir D` sent D's token to the default port,
another server). So, precisely:

- ``--token`` without ``--url`` is an error, and so is ``--token`` with ``--data-dir``;
- ``--url`` without a token of its own (1) never chooses where a token goes: it must name the
  URL of the source that 2–4 pick (``llmgw status --data-dir D --url U`` checks that D's `up`
  is at U), and is an error otherwise — one that says the token is what is missing;
- one of the two environment variables without the other is an error once step 3 is reached
  (rather than silently falling through to step 4);
- a source that supplies only one half (a data dir with a token but no URL) is an error.

Every error names flags the command has (all of them have ``--url``, ``--token`` and
``--data-dir``; tests/cli/test_controller_flags.py checks each command's parser against the hints).
The token is never in a message or a repr.

A router follows every controller that shares one store (DESIGN §5): its ``--url`` takes several,
comma-separated or the flag repeated (:func:`resolve_each`), each by the same rule, so one token
goes to each address given with it and to no other.
"""

from __future__ import annotations

import argparse
import json
import os
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from llmgw.errors import AccessError
from llmgw.paths import default_data_dir, lock_held

ENV_URL = "LLMGW_ADMIN_URL"
ENV_TOKEN = "LLMGW_ADMIN_TOKEN"
TOKEN_FILE = "admin.token"
URL_FILE = "admin.url"
UP_CONTROLLER_DIR = "controller"  # the part of `up`'s data dir its controller locks (llmgw.control.up)


@dataclass(frozen=True)
class AdminAccess:
    url: str
    token: str = field(repr=False)
    source: str  # where the token came from, for the message when a controller refuses it


class _Joined(argparse.Action):
    """A repeated ``--url`` adds to a comma-separated list: ``args.url`` stays one string."""

    def __call__(self, _parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 _option_string: str | None = None) -> None:
        before = getattr(namespace, self.dest, None)
        setattr(namespace, self.dest, f"{before},{values}" if before else values)


def add_options(p: argparse.ArgumentParser, *, url_aliases: Sequence[str] = (), token_aliases: Sequence[str] = (),
                fallback: str = "`llmgw up`'s default data dir", several: bool = False) -> None:
    """``--url``, ``--token`` and ``--data-dir`` (plus a command's older spellings, same dest).

    ``fallback`` says, in the help, what the command uses when none of them is given. ``several``:
    ``--url`` names every controller, comma-separated or repeated (:func:`resolve_each`).
    """
    def old(names: Sequence[str]) -> str:
        return f" ({', '.join(names)}: the older spelling)" if names else ""

    if several:
        p.add_argument("--url", *url_aliases, dest="url", metavar="URL[,URL...]", action=_Joined,
                       help=f"every controller's admin API address, comma-separated or the flag repeated (one "
                            f"leads, the others stand by); their token: --token or ${ENV_TOKEN}{old(url_aliases)}")
    else:
        p.add_argument("--url", *url_aliases, dest="url", metavar="URL",
                       help=f"the controller's admin API address; its token: --token or "
                            f"${ENV_TOKEN}{old(url_aliases)}")
    p.add_argument("--token", *token_aliases, dest="token", metavar="TOKEN",
                   help=f"the admin token for --url (or ${ENV_TOKEN}, which keeps it out of `ps`){old(token_aliases)}")
    p.add_argument("--data-dir", dest="data_dir", metavar="DIR",
                   help=f"a local `llmgw up`'s data dir: its admin URL and token. Without any of these flags: "
                        f"${ENV_URL} with ${ENV_TOKEN}, else {fallback}")


def given(url: str | None, token: str | None, data_dir: str | None, *, env: Mapping[str, str] | None = None) -> bool:
    """Whether anything names a controller explicitly (a flag, or either environment variable)."""
    env = os.environ if env is None else env
    return bool(url or token or data_dir or env.get(ENV_URL) or env.get(ENV_TOKEN))


def resolve(url: str | None, token: str | None, data_dir: str | None, *,
            env: Mapping[str, str] | None = None, default_dir: Path | None = None) -> AdminAccess:
    """URL and token from one source, by the rule in this module's docstring.

    ``env`` and ``default_dir`` default to ``os.environ`` and `llmgw up`'s default data dir.
    Raises `AccessError` (with a sentence naming the flags to use) when no single source applies.
    """
    env = os.environ if env is None else env
    url, token = url or None, token or None
    env_url, env_token = env.get(ENV_URL) or None, env.get(ENV_TOKEN) or None
    if token:
        if data_dir:
            raise AccessError(f"--token and --data-dir both name a token: use --data-dir {data_dir} alone "
                              "(its `llmgw up` recorded both URL and token), or --url with --token")
        if not url:
            raise AccessError("--token needs --url: a token is only sent to an address given with it")
        return _checked(AdminAccess(url, token, "--token"))
    if data_dir:
        found = _from_data_dir(Path(data_dir))
    elif url and env_token and not env_url:
        return _checked(AdminAccess(url, env_token, f"${ENV_TOKEN}"))
    elif url and not env_url and (saved := saved_login(url, env=env)) is not None:
        return _checked(AdminAccess(url, saved, "llmgw login"))
    elif env_url or env_token:
        if not env_token:
            if url:
                raise _no_token(url)
            raise AccessError(f"{ENV_URL} is set but {ENV_TOKEN} is not: set both, or pass --url and --token")
        if not env_url:
            raise AccessError(f"{ENV_TOKEN} is set but {ENV_URL} is not: set both, or pass the controller's "
                              "address with --url")
        found = AdminAccess(env_url, env_token, f"${ENV_TOKEN}")
    else:
        d = default_dir or default_data_dir()
        try:
            found = _from_data_dir(d, default=True)
        except AccessError:
            if url:  # the URL was given: what is missing is its token, not anything of `up`'s
                raise _no_token(url) from None
            raise
    if url and not _same(url, found.url):
        raise AccessError(f"{url} was given without a token, and the token found ({found.source}) belongs to "
                          f"{found.url}, so it is not sent there: pass the token for {url} too (--token), "
                          "or drop the URL")
    return _checked(found)


def logins_file(env: Mapping[str, str] | None = None) -> Path:
    """Where `llmgw login` keeps each controller's token (XDG config, mode 0600)."""
    env = os.environ if env is None else env
    return Path(env.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "llmgw" / "logins.json"


def saved_logins(env: Mapping[str, str] | None = None) -> dict[str, str]:
    try:
        data = json.loads(logins_file(env).read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


def saved_login(url: str, *, env: Mapping[str, str] | None = None) -> str | None:
    """The token `llmgw login` saved for exactly ``url`` (a token goes only where it was given for)."""
    return saved_logins(env).get(url.rstrip("/"))


def save_login(url: str, token: str | None, *, env: Mapping[str, str] | None = None) -> Path:
    """Keep ``token`` for ``url`` (None: forget it); the file is written 0600, replaced whole."""
    path = logins_file(env)
    logins = saved_logins(env)
    if token is None:
        logins.pop(url.rstrip("/"), None)
    else:
        logins[url.rstrip("/")] = token
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(logins, fh)
    os.replace(tmp, path)
    return path


def split_urls(url: str | None) -> list[str]:
    """The addresses in a comma-separated ``--url`` (blanks dropped), in order."""
    return [u.strip() for u in (url or "").split(",") if u.strip()]


def resolve_each(url: str | None, token: str | None, data_dir: str | None, *,
                 env: Mapping[str, str] | None = None, default_dir: Path | None = None) -> list[AdminAccess]:
    """One :class:`AdminAccess` per controller named in ``url`` (comma-separated; several that
    share one store), each by :func:`resolve`'s rule, so all have the one token given with them
    (``--token``, or ``$LLMGW_ADMIN_TOKEN`` without ``$LLMGW_ADMIN_URL``); a token found with an
    address of its own (a data dir, ``$LLMGW_ADMIN_URL``) goes to that address alone. Without
    ``url``: :func:`resolve`'s single controller. Addresses named twice are kept once."""
    urls = split_urls(url)
    if url and not urls:
        raise AccessError(f"--url {url!r} names no address")
    if len(urls) <= 1:
        return [resolve(urls[0] if urls else None, token, data_dir, env=env, default_dir=default_dir)]
    found: list[AdminAccess] = []
    for u in urls:
        access = resolve(u, token, data_dir, env=env, default_dir=default_dir)
        if not any(_same(access.url, f.url) for f in found):
            found.append(access)
    return found


def _no_token(url: str) -> AccessError:
    return AccessError(f"--url {url} was given without a token: pass its token with --token, or set {ENV_TOKEN}")


def _from_data_dir(d: Path, *, default: bool = False) -> AdminAccess:
    token_file, url_file = d / TOKEN_FILE, d / URL_FILE
    try:
        token = token_file.read_text().strip()
    except OSError:
        token = ""
    if not token:
        if default:
            raise AccessError(f"no admin URL and token: pass --url and --token, set {ENV_URL} and {ENV_TOKEN}, "
                              f"or run `llmgw up` first (its data dir {d} has no {TOKEN_FILE})")
        raise AccessError(f"--data-dir {d}: no {TOKEN_FILE} there (not the data dir of a `llmgw up`)")
    try:
        url = url_file.read_text().strip()
    except OSError:
        url = ""
    if not url:
        # Guessing the default port here is the bug this module exists to prevent.
        raise AccessError(f"{d} has an admin token but no {URL_FILE}: is `llmgw up --data-dir {d}` running? "
                          "(it records its admin URL once it listens, and removes it when it stops)")
    if not lock_held(d / UP_CONTROLLER_DIR):
        # `up` removes admin.url when it stops; one killed (kill -9, the OOM killer) leaves it, and
        # whoever listens on that port next would be sent the token. The lock dies with the process.
        raise AccessError(f"no llmgw up is running with data dir {d} ({URL_FILE} is left from one that died)")
    return AdminAccess(url, token, str(token_file))


def _same(a: str, b: str) -> bool:
    return a.rstrip("/") == b.rstrip("/")


def _checked(access: AdminAccess) -> AdminAccess:
    # urllib also opens file:// and ftp:// URLs; an admin URL is HTTP.
    parsed = urllib.parse.urlsplit(access.url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise AccessError(f"admin URL {access.url!r} is not an http:// or https:// address")
    if parsed.username or parsed.password or parsed.query:
        raise AccessError(f"admin URL {parsed.scheme}://{parsed.hostname}…: no credentials or query in it; "
                          "the token goes in --token or the environment")
    return access
