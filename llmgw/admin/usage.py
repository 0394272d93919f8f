"""The usage ledger as the operator reads it: a time range, groups, totals, and the chart.

Pure: the query's text in, the store's rows in, data out (the admin API, the dashboard and
``llmgw usage`` share it, so they never add up differently).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from llmgw.catalog.durations import DurationError, parse_duration
from llmgw.contract import USAGE_COUNTS

GROUPS = ("tenant", "key", "model")
MAX_POINTS = 2000  # time steps in one series: a year by the minute is not a chart
_UNIX = re.compile(r"\d{9,11}(\.\d+)?")
_SECONDS = re.compile(r"[0-9]{1,12}")  # a step in plain seconds (ASCII digits: "²".isdigit() is true)
MAX_TIME = 2 ** 40


class UsageQueryError(ValueError):
    """The query names a time, group or step that does not parse; the message says which."""


@dataclass(frozen=True)
class UsageQuery:
    since: float
    until: float
    by: tuple[str, ...] = GROUPS
    step: int = 0
    where: Mapping[str, str] | None = None


def parse_time(text: str, now: float, what: str) -> float:
    """``now``; a duration back from now (``24h``, ``7d``); unix seconds; or ISO 8601 (UTC unless
    it says otherwise: the ledger's minutes and the budgets' periods are UTC). Between 1970 and
    ~36,800 (2**40 s): beyond, SQLite's integers and Python's floats stop being exact."""
    try:
        t = _parse_time(text.strip(), now, what)
    except OverflowError:
        t = math.inf
    if not 0 <= t <= MAX_TIME:
        raise UsageQueryError(f"{what}: {text[:40]!r} is out of range (from 1970 to 2**40 seconds after)")
    return t


def _parse_time(text: str, now: float, what: str) -> float:
    if text in ("", "now"):
        return now
    if _UNIX.fullmatch(text):
        return float(text)
    try:
        return now - parse_duration(text)
    except DurationError:
        pass
    try:
        t = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise UsageQueryError(f"{what}: {text!r} is not a time (now, a duration back such as 24h or 7d, unix "
                              "seconds, or ISO 8601 such as 2026-12-01 or 2026-12-01T08:00Z)") from None
    return (t if t.tzinfo else t.replace(tzinfo=UTC)).timestamp()


def parse_query(args: Mapping[str, str], now: float) -> UsageQuery:
    """The admin API's query string (since, until, by, step, tenant, key, model) as a query."""
    since = parse_time(args.get("since", "24h"), now, "since")
    until = parse_time(args.get("until", "now"), now, "until")
    if until <= since:
        raise UsageQueryError(f"until ({until:.0f}) must be after since ({since:.0f})")
    by = tuple(b for b in args.get("by", ",".join(GROUPS)).split(",") if b)  # "by=": no groups, one sum
    bad = [b for b in by if b not in GROUPS]
    if bad or len(set(by)) != len(by):
        raise UsageQueryError(f"by: {', '.join(bad) or 'a group named twice'}: group by one or more of "
                              f"{', '.join(GROUPS)}, each once")
    step = 0
    if args.get("step"):
        text = args["step"]
        try:
            step = int(text) if _SECONDS.fullmatch(text) else int(parse_duration(text))
        except (DurationError, OverflowError, ValueError):
            step = -1
        if not 0 < step <= MAX_TIME:
            raise UsageQueryError(f"step: {text[:40]!r} is not a step (whole minutes, such as 5m, 1h or 3600)")
        if step < 60 or step % 60:
            raise UsageQueryError("step must be whole minutes (60 s at least): the ledger counts by the minute")
        if (until - since) / step > MAX_POINTS:
            raise UsageQueryError(f"step: {(until - since) / step:.0f} steps; at most {MAX_POINTS} "
                                  "(take a longer step)")
    where = {g: args[g] for g in GROUPS if args.get(g)}
    # Whole minutes: a minute is counted in or out whole, whatever second the range starts at.
    return UsageQuery(since // 60 * 60, -(-until // 60) * 60, by, step, where)


def with_total(row: Mapping[str, Any]) -> dict[str, Any]:
    return {**row, "total_tokens": row["prompt_tokens"] + row["completion_tokens"]}


def usage_view(query: UsageQuery, rows: Sequence[Mapping[str, Any]],
               series: Sequence[Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """The API's answer: the range, the groups, each group's sums, the sum of all, the series."""
    total = {c: sum(r[c] for r in rows) for c in USAGE_COUNTS}
    out: dict[str, Any] = {"since": query.since, "until": query.until, "by": list(query.by),
                           "where": dict(query.where or {}), "rows": [with_total(r) for r in rows],
                           "total": with_total(total)}
    if series is not None:
        out["step"] = query.step
        out["series"] = [with_total(p) for p in series]
    return out


# --- the dashboard's chart ------------------------------------------------------------------------
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")
CHART_W, CHART_H, PAD_L, PAD_B = 720, 200, 56, 22


@dataclass(frozen=True)
class Line:
    tenant: str
    color: str
    points: str  # SVG polyline points
    total: int


@dataclass(frozen=True)
class Chart:
    lines: tuple[Line, ...]
    peak: int  # tokens in the busiest step of any tenant: the y axis' top
    since: float
    until: float
    step: int


def tokens_chart(series: Sequence[Mapping[str, Any]], since: float, until: float, step: int) -> Chart:
    """One line per tenant of its tokens per ``step`` over [since, until), steps without use at 0;
    the key names no tenant has are one line, "(no tenant)"."""
    starts = list(range(int(since) // step * step, int(until), step))
    per: dict[str, dict[int, int]] = {}
    for p in series:
        per.setdefault(p["tenant"] or "(no tenant)", {})[int(p["time"])] = p["prompt_tokens"] + p["completion_tokens"]
    peak = max((v for d in per.values() for v in d.values()), default=0)
    width = CHART_W - PAD_L
    lines = []
    for i, tenant in enumerate(sorted(per)):
        values = [per[tenant].get(t, 0) for t in starts]
        xs = [PAD_L + (width * j / max(1, len(starts) - 1)) for j in range(len(starts))]
        ys = [(CHART_H - PAD_B) * (1 - v / peak) if peak else CHART_H - PAD_B for v in values]
        points = " ".join(f"{x:.1f},{y:.1f}" for x, y in zip(xs, ys, strict=True))
        lines.append(Line(tenant, PALETTE[i % len(PALETTE)], points, sum(values)))
    return Chart(tuple(lines), peak, since, until, step)
