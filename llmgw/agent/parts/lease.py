"""Fencing: the lease that says which controller this node obeys (DESIGN §4)."""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from llmgw.agent.parts.config import NodeConfig, _is_int
from llmgw.agent.parts.files import _locked, read_json, write_json_atomic
from llmgw.agent.parts.protocol import AgentError, JsonDict, Refused

# --- fencing: which controller may drive this node (DESIGN §4) ---------------------------------
# Two controllers pointed at one fleet (a failover, a copy started by mistake, a restored backup)
# stopped each other's engines. The node keeps a lease: the holder it obeys, the instance of that
# holder (a nonce each controller process makes at start), an epoch raised each time the holder
# changes, and an expiry. Changes (start, stop, remove-weights) must carry the current holder,
# instance and epoch; a takeover (an operator's, or after expiry) raises the epoch, so the old
# holder's next command is refused with the reason.
#
# The holder id lives in the controller's data dir, so a copied or restored data dir has the same
# one: the instance tells the two processes apart (seen: each obeyed, each stopped the other's
# engines as stale). Another instance of the holder is fenced like any other controller while the
# holding instance is heard from (each of its polls touches lease.beat). Once that instance has
# been silent for the grace it asked for, or has released the lease, another instance of the same
# holder may take it, at a RAISED epoch: nothing proves the two are one controller (the silent one
# may be a live original that paused, the taker a copy), so the old instance's engines become
# foreign to the taker (reported, their GPUs taken, never stopped as stale). Only a restarted
# controller that knows the instance it replaces (``succeeds``: it ran on the same data dir during
# this boot, and the data dir's lock proves it has ended) takes over at once and at the same epoch,
# adopting its engines. The grace is four missed beats of a live holder (its keeper renews every
# few seconds between polls): a live instance that stalls longer than that (SIGSTOP, a VM paused
# or migrated, a host deep in swap) loses the node to a sibling and is told so when it resumes.
#
# Several controllers on one PostgreSQL store share one holder id (the store's) and elect a leader
# there; the leader's term (the store lease's epoch, raised at every change of leader) travels
# with its requests. A higher term than the lease's is the proof a restart's ``succeeds`` is, and
# a stronger one: the store handed the leadership over, so the silent instance cannot act any
# more (a leader stops before its store lease can lapse). It takes over at once and at the same
# epoch: the old leader's engines stay the controller's, adopted, not restarted. A lower term
# never takes the lease (an old leader that has not noticed yet), and its changes are refused.
MAX_LEASE_TTL = 3600.0
DEFAULT_SUCCESSION_GRACE = 20.0


MAX_HOLDER = 200
DAMAGED = "(an unreadable lease file)"


def _lease_path(cfg: NodeConfig) -> str:
    return os.path.join(cfg.state_dir, "lease.json")


def _beat_path(cfg: NodeConfig) -> str:
    return os.path.join(cfg.state_dir, "lease.beat")


def _mtime(path: str) -> float:
    try:
        return os.stat(path, follow_symlinks=False).st_mtime
    except OSError:
        return 0.0


def lease_heard(cfg: NodeConfig) -> float:
    """When the holding instance was last heard from: its last poll (lease.beat) or the last
    write of the lease. An mtime, not a durable write per poll: a poll that renews nothing must
    stay cheap and must not wait for the lease lock a start holds."""
    return max(_mtime(_lease_path(cfg)), _mtime(_beat_path(cfg)))


def _beat(cfg: NodeConfig) -> None:
    """The holding instance was heard from now (a poll, a renewal)."""
    path = _beat_path(cfg)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.utime(fd)
        finally:
            os.close(fd)
    except OSError:
        pass  # a missed beat costs only time: the successor waits for the lease to expire instead


def read_lease(cfg: NodeConfig) -> Optional[JsonDict]:
    """The lease, None when there is none, or one held by DAMAGED when the file cannot be trusted.

    A lease file that exists but is empty, cut short or malformed (a power loss, a hand edit) must
    not fence nobody: the node then obeys no controller until one takes it over explicitly.
    """
    path = _lease_path(cfg)
    if not os.path.exists(path):
        return None
    lease = read_json(path)
    expires = lease.get("expires") if lease is not None else None
    if (lease is None or not isinstance(lease.get("holder"), str) or not lease["holder"]
            or len(lease["holder"]) > MAX_HOLDER or not _is_int(lease.get("epoch")) or lease["epoch"] < 0
            or not isinstance(lease.get("instance", ""), (str, type(None)))
            or not isinstance(expires, (int, float)) or isinstance(expires, bool) or not math.isfinite(expires)):
        epoch = lease.get("epoch") if lease is not None else None
        return {"holder": DAMAGED, "epoch": epoch if isinstance(epoch, int) and _is_int(epoch) and epoch >= 0 else 0,
                "expires": None}
    if expires > time.time() + MAX_LEASE_TTL:
        # Renewed while the clock ran fast (an RTC on local time, fixed by NTP later): no lease is
        # that long, so it is taken as ending now, not as damage that would fence its own holder.
        return dict(lease, expires=time.time())
    return lease


@dataclass(frozen=True)
class Asker:
    """Who asks for the lease: a controller's holder id, the instance (None from a controller
    older than instances), how long a lease lasts and how long a silence ends it for a sibling."""

    holder: str
    instance: Optional[str] = None
    ttl: float = 60.0
    grace: float = DEFAULT_SUCCESSION_GRACE
    succeeds: Optional[str] = None  # the instance of the same holder this one replaces, if it knows
    term: Optional[int] = None  # the leader's term on the controllers' shared store, if it has one


def _lease_grace(lease: JsonDict) -> float:
    grace = lease.get("grace")
    if isinstance(grace, (int, float)) and not isinstance(grace, bool) and math.isfinite(grace) and grace >= 1:
        return float(grace)
    return DEFAULT_SUCCESSION_GRACE


def lease_view(lease: Optional[JsonDict], asker: Optional[Asker], now: float, *, heard: float = 0.0) -> JsonDict:
    """The lease as a controller sees it: who holds it, whether that is the asker, how long left.

    ``sibling``: held by another instance of the asker's own holder id (a copy of its data dir, or
    its own earlier life); ``heard`` is when the holding instance last spoke (the node's clock) and
    ``grace`` how long a silence lets a sibling succeed it. Another instance's nonce is not shown.
    """
    if lease is None:
        return {"holder": None, "epoch": 0, "expires": None, "held": False, "expired": True, "sibling": False,
                "heard": None, "grace": None, "term": None}
    damaged = lease["holder"] == DAMAGED
    same = not damaged and asker is not None and lease["holder"] == asker.holder
    mine = same and asker is not None and lease.get("instance") == asker.instance
    return {"holder": lease["holder"], "epoch": lease["epoch"], "expires": lease.get("expires"),
            "held": mine, "expired": not damaged and now >= float(lease["expires"]),
            "sibling": same and not mine, "heard": heard or None, "grace": None if damaged else _lease_grace(lease),
            "term": _term(lease)}


def _lease_request(raw: Any) -> Asker:
    if not isinstance(raw, dict) or not isinstance(raw.get("holder"), str) or not raw["holder"].strip():
        raise AgentError("lease: holder must be a non-empty string")
    if len(raw["holder"]) > MAX_HOLDER:
        raise AgentError(f"lease: holder must be at most {MAX_HOLDER} characters")
    ttl = raw.get("ttl", 60)
    if not isinstance(ttl, (int, float)) or isinstance(ttl, bool) or not 1 <= ttl <= MAX_LEASE_TTL:
        raise AgentError(f"lease: ttl must be a number of seconds from 1 to {MAX_LEASE_TTL:g}")
    term = raw.get("term")
    if term is not None and (not _is_int(term) or term < 0):
        raise AgentError("lease: term must be a non-negative integer")
    instance, succeeds = raw.get("instance"), raw.get("succeeds")
    for name, value in (("instance", instance), ("succeeds", succeeds)):
        if value is not None and (not isinstance(value, str) or not value.strip() or len(value) > MAX_HOLDER):
            raise AgentError(f"lease: {name} must be a non-empty string of at most {MAX_HOLDER} characters")
    grace = raw.get("grace", min(DEFAULT_SUCCESSION_GRACE, float(ttl)))
    if (not isinstance(grace, (int, float)) or isinstance(grace, bool) or not math.isfinite(grace)
            or not 1 <= grace <= ttl):
        raise AgentError("lease: grace must be a number of seconds from 1 to the ttl")
    return Asker(raw["holder"], instance, float(ttl), float(grace), succeeds, term)


def _lease_lock(cfg: NodeConfig) -> str:
    return _lease_path(cfg) + ".lock"


def _term(lease: Optional[JsonDict]) -> Optional[int]:
    term = lease.get("term") if lease is not None else None
    return term if isinstance(term, int) and _is_int(term) and term >= 0 else None


def _later_term(lease: Optional[JsonDict], asker: Asker) -> bool:
    """The asker leads the holder's controllers at a later term than the lease was taken at."""
    held = _term(lease)
    return asker.term is not None and held is not None and asker.term > held


def _earlier_term(lease: Optional[JsonDict], asker: Asker) -> bool:
    """The asker's term is over: the lease was taken at a later one (by the same holder's leader)."""
    held = _term(lease)
    return asker.term is not None and held is not None and asker.term < held


def _holding(lease: Optional[JsonDict], asker: Asker) -> bool:
    return lease is not None and lease["holder"] == asker.holder and lease.get("instance") == asker.instance


def _proven(lease: Optional[JsonDict], asker: Asker) -> bool:
    """The asker is the holding instance, or proves it replaces it: a restart naming it
    (``succeeds``), or the holder's leader at a later term."""
    if lease is None or lease["holder"] != asker.holder:
        return False
    if _holding(lease, asker):
        return True
    if _earlier_term(lease, asker):
        return False
    return _later_term(lease, asker) or (asker.succeeds is not None and lease.get("instance") == asker.succeeds)


def _silent(lease: Optional[JsonDict], heard: float, now: float) -> bool:
    """The holding instance has not been heard from for the lease's grace."""
    return lease is not None and bool(heard) and now - heard >= _lease_grace(lease)


def _succeeds(lease: Optional[JsonDict], view: JsonDict, asker: Asker, now: float) -> bool:
    """A sibling may take a live lease at once when it proves it replaces the holding instance
    (:func:`_proven`), or once that instance has been silent past the lease's grace; never at an
    earlier term than the lease's."""
    if not view["sibling"] or lease is None or _earlier_term(lease, asker):
        return False
    if _proven(lease, asker):
        return True
    return view["heard"] is not None and now - float(view["heard"]) >= float(view["grace"])


def take_lease(cfg: NodeConfig, asker: Asker, *, takeover: bool) -> JsonDict:
    """Grant or renew the lease to ``asker``: when it holds it, when nobody does, when it has
    expired, when it succeeds a silent instance of its own holder, or on ``takeover``. Otherwise
    the view of the lease as it stands (``held`` false)."""
    now = time.time()
    current = read_lease(cfg)
    view = lease_view(current, asker, now, heard=lease_heard(cfg))
    # Most polls change nothing (not ours, or ours with time left): no lock, no write, only the
    # beat. A fenced verb holds the lock for its whole run; a poll must not wait behind it.
    if not takeover and not view["expired"] and not _succeeds(current, view, asker, now) and (
            not view["held"] or float(current["expires"]) - now >= asker.ttl / 2):  # type: ignore[index]
        if view["held"]:
            _beat(cfg)
        return view
    with _locked(_lease_lock(cfg)):
        now = time.time()
        lease = read_lease(cfg)
        current_view = lease_view(lease, asker, now, heard=lease_heard(cfg))
        # A leader whose term is over does not take the lease back: not while it is held, nor
        # when it has just expired. Only once it has also been silent for its grace (the term it
        # was taken at may be a restored store's, or a number nobody leads at any more: a node
        # must not refuse the real leader for ever) does it go, at a raised epoch, like any lapse.
        if not takeover and not _holding(lease, asker) and _earlier_term(lease, asker) and not (
                current_view["expired"] and _silent(lease, lease_heard(cfg), now)):
            return current_view
        if not (current_view["held"] or current_view["expired"] or takeover
                or _succeeds(lease, current_view, asker, now)):
            return current_view
        # The epoch stays only for the instance holding it (a renewal, or taking its own expired
        # lease back) and for a proven restart of it (``succeeds`` names it: same data dir, same
        # boot, its lock free): the engines it started remain the controller's. Anyone else raises
        # it, another instance of the same holder id included (succeeding a silent instance, or
        # taking a released lease): that instance may be a copy of the data dir, and at the same
        # epoch the old instance's engines would be "ours" to it and stopped as stale (seen: a
        # fenced copy stopped every engine of the original once it stopped cleanly or paused).
        same = lease is not None and lease["holder"] == asker.holder
        epoch = int(lease["epoch"]) if lease is not None else 0
        if not _proven(lease, asker) or takeover:
            epoch += 1
        since = lease.get("since", now) if lease is not None and same else now
        # The asker's term (none from a controller that leads alone: a term it did not give is
        # not carried on); a takeover never lowers it (an operator's, from a leader whose term
        # was over, made the node go back to it and the new leader's engines foreign).
        term = asker.term
        if takeover and same and term is not None and (_term(lease) or 0) > term:
            term = _term(lease)
        lease = {"holder": asker.holder, "instance": asker.instance, "epoch": epoch, "expires": now + asker.ttl,
                 "since": since, "grace": asker.grace, **({"term": term} if term is not None else {})}
        write_json_atomic(_lease_path(cfg), lease, durable=True)
        _beat(cfg)
        return lease_view(lease, asker, now, heard=now)


def verb_lease(cfg: NodeConfig, request: JsonDict) -> JsonDict:
    """Take the lease (``takeover`` true: even from a live holder), renew it, or ``release`` it."""
    asker = _lease_request(request)
    takeover, release = request.get("takeover", False), request.get("release", False)
    if not isinstance(takeover, bool) or not isinstance(release, bool):
        raise AgentError("lease: takeover and release must be true or false")
    if release:
        return release_lease(cfg, asker)
    return take_lease(cfg, asker, takeover=takeover)


def release_lease(cfg: NodeConfig, asker: Asker) -> JsonDict:
    """End the asker's lease now (a controller stopping cleanly), keeping its epoch: the next
    controller to ask gets the node without waiting for the expiry. Only the instance holding it
    can: a copy of the data dir stopping must not give away the live controller's nodes."""
    with _locked(_lease_lock(cfg)):
        now = time.time()
        lease = read_lease(cfg)
        if lease_view(lease, asker, now)["held"]:
            lease = dict(lease, expires=now)  # type: ignore[arg-type]
            write_json_atomic(_lease_path(cfg), lease, durable=True)
        return lease_view(lease, asker, now, heard=lease_heard(cfg))


@contextlib.contextmanager
def fenced(cfg: NodeConfig, verb: str, request: JsonDict, *, hold: bool = True) -> Iterator[Optional[JsonDict]]:
    """Run a change only for the lease's holder at its current epoch; yields the lease obeyed.

    With ``hold`` the lease lock is kept for the whole change (a start: a takeover cannot land
    between the check and the launch, and a launch is quick). Without it, only for the check: a
    stop waits out its grace and a removal deletes after it, and holding the lock through either
    made every other stop and the holder's own renewal wait. A node no controller has leased yet
    obeys anyone (it has nobody to be fenced from); once leased, a request without a fence is
    refused too, so an old controller cannot slip past.
    """
    with contextlib.ExitStack() as stack:
        stack.enter_context(_locked(_lease_lock(cfg)))
        lease = read_lease(cfg)
        if lease is not None:
            fence = request.get("fence")
            holder = fence.get("holder") if isinstance(fence, dict) else None
            epoch = fence.get("epoch") if isinstance(fence, dict) else None
            instance = fence.get("instance") if isinstance(fence, dict) else None
            term = fence.get("term") if isinstance(fence, dict) else None
            if lease["holder"] == DAMAGED:
                raise Refused(f"{verb}: this node's lease file is unreadable, so it obeys no controller until one "
                              "takes it over (`llmgw node takeover`)", setting="lease")
            if holder == lease["holder"] and instance != lease.get("instance") and _term(lease) is not None:
                raise Refused(f"{verb}: this node is driven by the leader of controller {lease['holder']!r} at term "
                              f"{_term(lease)}; refused from {'term ' + str(term) if _is_int(term) else 'another'} "
                              "instance, which no longer leads", setting="lease")
            if holder == lease["holder"] and instance != lease.get("instance"):
                raise Refused(f"{verb}: this node is driven by another instance of controller {lease['holder']!r} "
                              f"(a copied data dir?) (epoch {lease['epoch']}); refused from this one; stop the "
                              "other, or `llmgw node takeover` moves the node here", setting="lease")
            if holder != lease["holder"] or not _is_int(epoch) or epoch != lease["epoch"]:
                asker = (f"controller {holder!r} (epoch {epoch!r})" if holder is not None
                         else "a request without a lease")
                raise Refused(f"{verb}: this node is driven by controller {lease['holder']!r} (epoch "
                              f"{lease['epoch']}); refused from {asker}; `llmgw node takeover` moves the node to "
                              "another controller", setting="lease")
        if not hold:
            stack.close()
        yield lease
