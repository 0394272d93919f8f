"""Roles and the route policy. Pure: no I/O.

Three roles, each holding the one below: a ``viewer`` reads everything but secrets, an
``operator`` also acts on the fleet as day-to-day work asks (cordon, drain, rollouts, sync,
weight collection), an ``admin`` does everything (catalog commits, API keys, takeover). A
router credential is no role at all: it opens the two routes a router needs (watch, report)
and nothing else, so a compromised router host cannot drain a node or push a commit.

Every route is registered with what it needs (:class:`Need`); a route registered without one
cannot exist (llmgw.admin.app refuses it at start), so a new route is never open by omission.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import IntEnum


class Role(IntEnum):
    VIEWER = 1
    OPERATOR = 2
    ADMIN = 3

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, text: str) -> Role:
        """``viewer``/``operator``/``admin``; ValueError naming the three otherwise."""
        try:
            return cls[text.strip().upper()]
        except KeyError:
            raise ValueError(f"unknown role {text!r}: one of viewer, operator, admin") from None


@dataclass(frozen=True)
class Need:
    """What a route asks of its caller: a role (at least), or a router's credential."""

    role: Role
    routers: bool = False  # a router credential is enough (watch, report); an admin always is

    def describe(self) -> str:
        return "a router credential or the admin role" if self.routers else f"the {self.role.label} role"


READ = Need(Role.VIEWER)
OPERATE = Need(Role.OPERATOR)
ADMINISTER = Need(Role.ADMIN)
ROUTERS = Need(Role.ADMIN, routers=True)


@dataclass(frozen=True)
class Principal:
    """Who made a request, as the admin listener established it."""

    name: str  # "admin-token", a person's e-mail or subject, "router:NAME"
    role: Role | None  # None: a router credential, which holds no role
    via: str  # "admin-token", "oidc", "router", "dashboard"
    router: str | None = None  # the router's name, for a router credential
    credential: str = ""  # a router credential's sha256: which credential, when a name is made again

    @property
    def role_label(self) -> str:
        if self.role is not None:
            return self.role.label
        return "router" if self.router is not None else "none"

    def may(self, need: Need) -> bool:
        if self.role is None:
            return need.routers and self.router is not None
        return self.role >= need.role

    def refusal(self, need: Need) -> str:
        """Why this caller may not: the role it needs and the one it has."""
        if self.role is None and self.router is None:
            return (f"this needs {need.describe()}; {self.name} has no role here: none of their groups is mapped "
                    "to one in the controller's oidc.roles")
        return f"this needs {need.describe()}; {self.name} has the {self.role_label} role" + (
            "" if self.role is not None else " (a router credential opens only the router watch and report)")


def role_for_groups(groups: Iterable[str], mapping: Mapping[str, Role]) -> Role | None:
    """The highest role any of ``groups`` is mapped to (None: no group has one)."""
    roles = [mapping[g] for g in groups if g in mapping]
    return max(roles) if roles else None
