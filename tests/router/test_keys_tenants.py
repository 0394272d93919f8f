"""with_key_tenants(): a key made for a tenant (`llmgw keys create --tenant`) is that tenant's,
unless a catalog tenant names it (git's word wins); a tenant the catalog lacks has no limits."""

from __future__ import annotations

from llmgw.catalog.model import Budget, Limits, Tenant
from llmgw.router.keys import ApiKey, with_key_tenants


def key(name: str, tenant: str | None = None) -> ApiKey:
    return ApiKey(name, b"\0" * 32, frozenset({"*"}), tenant)


def test_a_key_made_for_a_tenant_joins_it_and_the_catalog_wins() -> None:
    search = Tenant("search", ("web",), Limits(budget=Budget(1000, "day")))
    got = with_key_tenants((search,), [key("web", "batch"), key("lab", "search"), key("ci", "batch"), key("open")])
    assert got == (Tenant("search", ("web", "lab"), search.limits), Tenant("batch", ("ci",)))
    assert with_key_tenants((search,), [key("open")]) == (search,)
