"""Build a `llmgw diff` report from catalog files and a fleet: shared by the CLI and the API."""

from __future__ import annotations

from collections.abc import Mapping

from llmgw.catalog import RawFile, validate_files
from llmgw.catalog.keys import tenants_without_keys
from llmgw.catalog.loader import validate_best_effort
from llmgw.plan.changes import catalog_changes
from llmgw.plan.plan import FleetSnapshot, make_plan
from llmgw.plan.render import DiffReport


def build_report(
    base_name: str,
    base_files: Mapping[str, RawFile] | None,
    head_name: str,
    head_files: Mapping[str, RawFile],
    fleet: FleetSnapshot | None,
    *,
    now: float,
    fleet_note: str = "",
) -> DiffReport:
    base = validate_files(base_files).catalog if base_files is not None else None
    checked = validate_files(head_files)
    head = checked
    if checked.problems:
        # Plan what is valid: a broken file counts as unchanged (its base version), so a typo
        # in one model shows as a problem, not as that model being removed from the fleet.
        broken = {p.file for p in checked.problems}
        merged = {k: v for k, v in head_files.items() if not _within(k, broken)}
        merged.update({k: v for k, v in (base_files or {}).items() if _within(k, broken)})
        best = validate_best_effort(merged)
        head = type(checked)(best.catalog, checked.problems, checked.files)
    if head.catalog is None:
        return DiffReport(base_name, head_name, (), head.problems, None, "the catalog cannot be read")
    plan = make_plan(base, head.catalog, fleet, now=now) if fleet is not None else None
    warnings = tuple(tenants_without_keys(head.catalog, fleet.key_names)) \
        if fleet is not None and fleet.key_names is not None else ()
    return DiffReport(base_name, head_name, tuple(catalog_changes(base, head.catalog)), head.problems, plan,
                      fleet_note, warnings)


def _within(path: str, broken: set[str]) -> bool:
    # A broken directory (a symlinked `models`) breaks every file under it: they count as
    # unchanged too, not as every model being removed.
    return path in broken or path.split("/", 1)[0] in broken
