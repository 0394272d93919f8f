"""The one way the router asks about tenants' limits: :class:`Limits`, async, with two
implementations, :class:`~llmgw.tenancy.memory.LocalLimits` (this router's own counts) and
:class:`~llmgw.tenancy.shared.SharedLimits` (counts every router shares, in Redis). Both apply
:mod:`llmgw.tenancy.rules` to the scopes of one :class:`~llmgw.tenancy.memory.Limiter`, so the
router never asks which one it has (issue 29: it used to fork, sync here, async there).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Protocol

from llmgw.tenancy.rules import Refusal

if TYPE_CHECKING:
    from llmgw.catalog.model import Tenant
    from llmgw.tenancy.memory import Limiter


class Admitted(Protocol):
    """An admitted request's hold on its limits: settle its real tokens, then release it (each at
    most once; a release unsettled charges :meth:`charge_at_least`'s figure, 0 if never called)."""

    def charge_at_least(self, tokens: int) -> None: ...

    def settle(self, tokens: int) -> None: ...

    def release(self) -> None: ...


Admission = Admitted | Refusal | None  # None: the key is in no tenant (not limited)


class Limits(Protocol):
    """Tenants' limits, as the router asks about them. ``now`` is this router's wall clock."""

    limiter: Limiter  # the tenants and their scopes, as the catalog says
    url: str  # where the counts are shared ("": this router's own)

    @property
    def degraded(self) -> bool:
        """Shared limits applied by this router alone for now (their store is away)."""
        ...

    @property
    def offset(self) -> float:
        """Seconds the limits' clock is ahead of this router's: budget periods are named by it."""
        ...

    def tenant(self, key: str) -> str | None:
        """The tenant of the API key named ``key``; None: the key is not limited."""
        ...

    def set_tenants(self, tenants: Iterable[Tenant]) -> None:
        """A new catalog's tenants: what each scope used and has in flight goes on."""
        ...

    def set_spent(self, figures: Mapping[tuple[str, str], tuple[float, int]], *, routers: int) -> None:
        """What the controller's ledger says each budget used, and how many routers share the limits."""
        ...

    def caps_unasked(self, key: str, models: tuple[str, ...]) -> bool:
        """Whether a request that names no completion limit is sent with one (a budget applies)."""
        ...

    def precheck(self, key: str, reserve: int, now: float) -> Refusal | None:
        """A refusal that needs no body (at least ``reserve`` tokens), or None. Takes nothing."""
        ...

    async def admit(self, key: str, models: tuple[str, ...], reserve: int, now: float) -> Admission:
        """Admit a request for ``models`` (the model asked for and its fallbacks: it must fit each
        one's limits) reserving ``reserve`` tokens: a ticket, a refusal, or None (not limited)."""
        ...

    async def close(self) -> None: ...
