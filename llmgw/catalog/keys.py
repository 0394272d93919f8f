"""Tenants name API keys that live outside git (the controller config, `llmgw keys create`): a name
no key has is said where both are known (status, the dashboard, `llmgw diff` against a controller)."""

from __future__ import annotations

from collections.abc import Collection

from llmgw.catalog.model import Catalog


def tenants_without_keys(catalog: Catalog | None, names: Collection[str]) -> list[str]:
    """Each tenant key the catalog names that no API key has, in words (its requests could never be
    that tenant's: the limits it sets would hold for nobody, silently)."""
    if catalog is None:
        return []
    return [f'tenant "{t.name}" names key "{k}", which no API key has (the controller config\'s api_keys, '
            "or `llmgw keys create`)"
            for t in catalog.settings.tenants for k in t.keys if k not in names]
