"""Whether a router is open to others: no API keys, on an address other machines can reach.

With no API keys the router serves anyone (llmgw.router.keys): the single-machine default, where
it listens on loopback. The same config on ``0.0.0.0`` hands every model to whoever can reach the
port, and nothing said so. The controller and a standalone router both ask :func:`open_warning`
when they start (and a standalone router again whenever the controller's keys change), log what
it says, and the controller's dashboard shows it as a banner.
"""

from __future__ import annotations

import ipaddress

LOOPBACK_NAMES = frozenset({"localhost", "localhost.", "ip6-localhost"})


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a listen address) is reachable from this machine only.

    A hostname other than localhost counts as reachable: what it resolves to can change, and a
    warning too many is cheaper than a silent open router. ``""``, ``0.0.0.0`` and ``::`` are every
    address, so reachable.
    """
    name = host.strip("[]").lower()
    if name in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def open_warning(*, keys_open: bool, host: str, port: int) -> str | None:
    """The warning for a router listening on ``host:port`` with no API keys, or None when it has
    keys or only this machine can reach it."""
    if not keys_open or is_loopback(host):
        return None
    shown = f"[{host}]" if ":" in host else host
    return (f"the router on {shown}:{port} is open: there are no API keys, so anyone who can reach it may use "
            "every model. Set api_keys (README: Going to a real fleet, step 5), or listen on 127.0.0.1")
