"""The controller's git loop: every new valid commit becomes the desired state.

Fetches on an interval, at once when triggered (webhook, file-system watch), judges the
branch head, and either applies it, rejects it (the last good state stays in force and
nothing running is touched), or holds it for confirmation under the prune guard. What
it decided survives a restart through the Store, so a restarted controller comes back
on the same applied revision without applying it again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge

from llmgw.catalog import Catalog, validate_files
from llmgw.errors import BranchMissing, GitError, LlmgwError
from llmgw.gitops.desired import DesiredState
from llmgw.gitops.repo import CommitInfo, GitMirror
from llmgw.gitops.status import History, PendingPrune, Rejection, Rewrite, SyncState, SyncStatus
from llmgw.health import Tracker
from llmgw.inventory import Inventory
from llmgw.plan.guard import PruneVerdict, allows_prune, judge_prune, skips_analysis, with_trailers
from llmgw.store.protocol import Store
from llmgw.store.records import Applied
from llmgw.tasks import cancel_and_wait

log = logging.getLogger(__name__)
T = TypeVar("T")

# The prune guard's judgement of applied → new against the live fleet (the controller's).
Judge = Callable[[Catalog | None, Catalog], PruneVerdict]


def judge_without_a_fleet(old: Catalog | None, new: Catalog) -> PruneVerdict:
    """The guard with no replicas to count: only the share of models removed can hold a commit."""
    return judge_prune(old, new, Inventory(), (), now=0.0)


class GitOpsMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.applied_time = Gauge(
            "llmgw_catalog_applied_timestamp_seconds", "When the applied catalog revision was applied",
            registry=registry)
        self.applied = Counter("llmgw_catalog_applied", "Catalog commits applied", registry=registry)
        self.rejected = Counter("llmgw_catalog_rejected", "Catalog commits rejected as invalid", registry=registry)
        self.held = Counter("llmgw_catalog_held", "Catalog commits held by the prune guard", registry=registry)
        self.rewrites = Counter("llmgw_catalog_history_rewrites", "Fetched heads that went back in history "
                                "(rewind) or rewrote it (force-push)", ["kind"], registry=registry)
        self.fetch_failures = Counter("llmgw_git_fetch_failures", "Failed fetches of the catalog repository",
                                      registry=registry)
        self.state = Gauge("llmgw_catalog_sync_state", "1 for the current sync state", ["state"], registry=registry)


def git_dirs(path: Path) -> list[Path]:
    """Where the refs of the repository at ``path`` live: its ``.git`` (or where a ``.git`` file
    points, and that one's common dir for a worktree), or ``path`` itself when it is bare."""
    dot = path / ".git"
    gitdir = None
    if dot.is_dir():
        gitdir = dot
    elif dot.is_file():  # a worktree or submodule: "gitdir: <path>"
        text = dot.read_text(errors="replace").strip()
        if text.startswith("gitdir:"):
            gitdir = (path / text.removeprefix("gitdir:").strip()).resolve()
    elif (path / "HEAD").is_file() and (path / "refs").is_dir():
        gitdir = path
    if gitdir is None:
        return []
    common = gitdir / "commondir"  # a worktree's branches are in the main repository's refs
    if common.is_file():
        return [gitdir, (gitdir / common.read_text(errors="replace").strip()).resolve()]
    return [gitdir]


class GitOpsFollower:
    """Follows ``mirror``'s branch into ``desired``; ``start()`` begins, ``close()`` ends."""

    def __init__(
        self,
        mirror: GitMirror,
        desired: DesiredState,
        store: Store,
        *,
        interval: float = 15.0,
        judge: Judge = judge_without_a_fleet,
        watch_path: Path | None = None,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.mirror = mirror
        self.desired = desired
        self.store = store
        self.interval = interval
        self.judge = judge
        self.watch_path = watch_path
        self.clock = clock
        self.metrics = GitOpsMetrics(registry or CollectorRegistry())
        # Not critical: a remote that is down leaves the last good catalog in force, and a
        # restarted controller would find the remote down too.
        self.health = Tracker("git-sync", critical=False)
        self._status = SyncStatus(branch=mirror.branch, url=mirror.shown_url)
        self._judged: str | None = None  # the head last judged, so a bad commit is judged once
        self._history_note = ""  # "rewound from … to …", for the event of the commit then applied
        self._lock = asyncio.Lock()
        # Held by the thread doing the follower's blocking work (git, judging, applying): a
        # cancelled await leaves that thread running, and close() waits for it, so nothing writes
        # to a store that was closed meanwhile (seen: a segfault in 1 of 7 bench runs).
        self._busy = threading.Lock()
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stop: asyncio.Event | None = None

    # --- lifecycle ------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        await self._threaded(self.restore)
        self._tasks.append(asyncio.create_task(self._run(), name="gitops-follow"))
        if self.watch_path is not None:
            self._tasks.append(asyncio.create_task(self._watch(self.watch_path), name="gitops-watch"))

    async def close(self) -> None:
        if self._stop is not None:
            self._stop.set()
        await cancel_and_wait(*self._tasks)
        self._tasks.clear()
        await asyncio.to_thread(self._drained)

    def _drained(self) -> None:
        with self._busy:
            pass

    async def _threaded(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn`` in a worker thread, as the one piece of blocking work in progress (see _busy)."""
        def run() -> T:
            with self._busy:
                return fn(*args, **kwargs)
        return await asyncio.to_thread(run)

    def trigger(self) -> None:
        """Fetch now. Safe from any thread; many triggers before the fetch coalesce into one."""
        if self._loop is None or self._wake is None:
            return
        self._loop.call_soon_threadsafe(self._wake.set)

    @property
    def status(self) -> SyncStatus:
        return self._status

    # --- the loop -------------------------------------------------------------------
    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            self._wake.clear()
            try:
                status = await self.sync_once()
            except LlmgwError as exc:
                log.exception("sync failed")
                self.health.failed(self.clock(), exc)
            except Exception as exc:  # noqa: BLE001 - a bug must not end the loop; logged, counted, in status
                log.exception("unexpected error in the git loop")
                self.health.failed(self.clock(), exc)
            else:
                if status.last_error:  # the fetch failed: said in the sync status, and here
                    self.health.failed(self.clock(), f"fetch: {status.last_error}")
                else:
                    self.health.ok(self.clock())
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=self.interval)
            except TimeoutError:
                pass

    async def _watch(self, path: Path) -> None:
        """Fetch when a local repository's refs change (a commit, a reset, a push into it, a branch
        deleted), or its working tree does.

        watchfiles' default filter ignores ``.git``: a commit made a moment after the last edit was
        seen only at the next poll (12–13 s), and a reset not at all until then. So the repository's
        own refs are watched, by a filter of ours.
        """
        import watchfiles

        assert self._stop is not None
        gitdirs = git_dirs(path)
        paths = [path, *(d for d in gitdirs if not d.is_relative_to(path))]
        tree_filter = watchfiles.DefaultFilter()

        def relevant(change: watchfiles.Change, name: str) -> bool:
            p = Path(name)
            for d in gitdirs:
                if p.is_relative_to(d):
                    rel = p.relative_to(d).parts
                    # refs/heads/main, main.lock renamed over it, packed-refs(.lock), HEAD
                    return bool(rel) and (rel[0] in ("refs", "HEAD") or rel[0].startswith("packed-refs"))
            return tree_filter(change, name)

        try:
            async for _ in watchfiles.awatch(*paths, watch_filter=relevant, stop_event=self._stop, debounce=100,
                                             step=20, recursive=True, rust_timeout=1000):
                self.trigger()
        except (OSError, RuntimeError) as exc:
            log.warning("not watching %s for changes (%s); polling every %ss", path, exc, self.interval)

    async def sync_once(self) -> SyncStatus:
        """Fetch and judge the branch head once; the resulting status."""
        async with self._lock:
            try:
                head = await self._threaded(self.mirror.fetch)
            except BranchMissing as exc:
                self._fetch_failed(str(exc), state=SyncState.BRANCH_MISSING)
                return self._status
            except GitError as exc:
                self._fetch_failed(str(exc))
                return self._status
            previous = self._status.head_sha or self._same_source_applied()
            if previous and previous != head:
                kind = await self._threaded(self.mirror.history, previous, head)
                if kind in (History.REWIND, History.FORCE_PUSH):
                    self._rewritten(Rewrite(kind, previous, head, self.clock()))
            self._set(head_sha=head, fetched_at=self.clock(), last_error=None)
            if head == self._status.applied_sha:
                # Back on the applied commit (e.g. a bad commit force-pushed away): whatever
                # was rejected or held since is no longer the head and no longer matters, and
                # the same commit pushed again later is judged again (it was ignored).
                self._clear_judgement()
                self._judged = None
                self.store.set_judged(None)
            elif head != self._judged:
                await self._threaded(self._judge, head)
            self._history_note = ""  # it belongs to this head's judgement only
            self._set(state=self._state())
            return self._status

    async def confirm(self) -> SyncStatus:
        """Apply the commit held by the prune guard (an operator said yes)."""
        async with self._lock:
            pending = self._status.pending
            if pending is None:
                raise LlmgwError("no commit is waiting for confirmation")
            await self._threaded(self._apply_sha, pending.sha, confirmed=True)
            return self._status

    # --- decisions --------------------------------------------------------------------
    def _state(self) -> SyncState:
        s = self._status
        if s.pending is not None:
            return SyncState.NEEDS_CONFIRMATION
        if s.rejected is not None:
            return SyncState.REJECTED
        return SyncState.SYNCED if s.applied_sha else SyncState.PENDING

    def _clear_judgement(self) -> None:
        self.store.set_pending(None)
        self.store.set_rejected(None)
        self._set(pending=None, rejected=None)

    def _judge(self, sha: str) -> None:
        """Judge a new head: apply it, reject it, or hold it. Whatever came before is superseded."""
        info = self.mirror.info(sha)
        result = validate_files(self.mirror.read(sha), revision=sha)
        self._judged = sha
        self.store.set_judged(sha)
        self._clear_judgement()
        if result.catalog is None:
            self._reject(info, result.problems)
            return
        stored = self.store.applied()
        if self.desired.catalog is None and stored is not None:
            # A catalog was applied, but its revision could not be read back (history rewritten
            # while the controller was down, the mirror lost): with nothing to compare against, the
            # guard would pass anything, so a person decides (seen: "remove every model" applied).
            reasons: tuple[str, ...] = (f"the applied revision {stored.sha[:12]} could not be read back, so what "
                                        "this commit stops cannot be judged",)
            verdict_held = True
        else:
            verdict = self.judge(self.desired.catalog, result.catalog)
            reasons, verdict_held = verdict.reasons, verdict.held
        if verdict_held and not allows_prune(info.message):
            pending = PendingPrune(sha, info.author, info.subject, reasons)
            self.store.set_pending(pending)
            self._set(pending=pending, state=SyncState.NEEDS_CONFIRMATION)
            self.metrics.held.inc()
            self.store.add_event("needs-confirmation", sha[:12],
                                 f"{info.subject} ({info.author}): {'; '.join(reasons)}; "
                                 "confirm with `llmgw sync --allow-prune` or the trailer Llmgw-Allow-Prune: yes")
            return
        self._apply(info, result.catalog, note="prune allowed by trailer" if verdict_held else "")

    def _reject(self, info: CommitInfo, problems: tuple) -> None:
        rejection = Rejection(info.sha, info.author, info.subject, self.clock(), tuple(problems))
        self.store.set_rejected(rejection)
        self._set(rejected=rejection, state=SyncState.REJECTED)
        self.metrics.rejected.inc()
        shown = "; ".join(str(p) for p in problems[:5]) + (" …" if len(problems) > 5 else "")
        self.store.add_event("rejected", info.sha[:12],
                             f"{info.subject} ({info.author}): {len(problems)} problem(s): {shown}")
        log.warning("rejected %s: %s", info.sha[:12], shown)

    def _apply_sha(self, sha: str, *, confirmed: bool) -> None:
        info = self.mirror.info(sha)
        result = validate_files(self.mirror.read(sha), revision=sha)
        if result.catalog is None:  # cannot happen for a held commit, but never apply blind
            self._reject(info, result.problems)
            return
        self._apply(info, result.catalog, note="confirmed by an operator" if confirmed else "")

    def _apply(self, info: CommitInfo, catalog: Catalog, *, note: str = "") -> None:
        now = self.clock()
        catalog = with_trailers(catalog, info.message)
        previous = self._status.applied_sha
        if catalog.skip_analysis and previous and previous != info.sha:
            # The trailer speaks for its own commit: one fetch that brings an earlier change without
            # it (someone else's, wanting its canary) does not wave that change through (review).
            messages = self.mirror.messages(previous, info.sha)
            if messages is None or not all(skips_analysis(m) for m in messages):
                catalog = dataclasses.replace(catalog, skip_analysis=False)
                note = "; ".join(n for n in (note, "trailer Llmgw-Skip-Analysis ignored: commits without it "
                                                   "arrived with it") if n)
        if catalog.skip_analysis:
            note = "; ".join(n for n in (note, "canary analysis skipped by trailer Llmgw-Skip-Analysis") if n)
        # Stored before subscribers hear of it: a crash in between restarts on this revision.
        self.store.set_applied(Applied(info.sha, now, self._source))
        self._clear_judgement()
        self._set(applied_sha=info.sha, applied_at=now, state=SyncState.SYNCED)
        self.desired.set(catalog)
        self.metrics.applied.inc()
        self.metrics.applied_time.set(now)
        suffix = "".join(f"; {n}" for n in (self._history_note, note) if n)
        self.store.add_event("applied", info.sha[:12],
                             f"{info.subject} ({info.author}): {len(catalog.models)} models{suffix}")
        log.info("applied %s: %s", info.sha[:12], info.subject)

    def _fetch_failed(self, error: str, *, state: SyncState = SyncState.FETCH_FAILED) -> None:
        was = self._status.state
        self._set(state=state, last_error=error)
        self.metrics.fetch_failures.inc()
        if was != state:  # one event per outage, not one per poll
            self.store.add_event(state.value, self.mirror.shown_url, f"{error}; the last good state stays in force")
        log.warning("fetch failed: %s", error)

    @property
    def _source(self) -> str:
        return f"{self.mirror.shown_url} {self.mirror.branch}"  # stored: never the credential

    def _same_source_applied(self) -> str | None:
        """The applied sha, when it came from the branch followed now: after a switch of branch or
        repository, the new head is not a rewrite of the old one (seen: reported as a force-push)."""
        applied = self.store.applied()
        return applied.sha if applied is not None and applied.source == self._source else None

    def _rewritten(self, rewrite: Rewrite) -> None:
        """The branch went back or its history was rewritten: said so, whatever is then applied
        (seen: a reset to an older commit was applied as an ordinary commit, silently)."""
        self.store.set_rewrite(rewrite)
        self._set(rewrite=rewrite)
        self.metrics.rewrites.labels(rewrite.kind.value).inc()
        try:
            subject = self.mirror.info(rewrite.to_sha).subject
        except GitError:
            subject = "?"
        kind = "history-rewound" if rewrite.kind == History.REWIND else "history-rewritten"
        self.store.add_event(kind, rewrite.to_sha[:12], f"branch {self.mirror.branch} {rewrite.describe()} "
                                                        f"({subject})")
        self._history_note = rewrite.describe()
        log.warning("branch %s %s", self.mirror.branch, rewrite.describe())

    def _set(self, **changes: object) -> None:
        self._status = dataclasses.replace(self._status, **changes)  # type: ignore[arg-type]
        for state in SyncState:
            self.metrics.state.labels(state.value).set(1 if state == self._status.state else 0)

    # --- restart ----------------------------------------------------------------------
    def restore(self) -> None:
        """Come back on the stored applied revision, without applying it again.

        The catalog is put in force for the subscribers (the router must know the models
        at once) but no "applied" event is written and no prune judgement runs.
        """
        applied = self.store.applied()
        self._judged = self.store.judged()
        changes: dict[str, object] = {"pending": self.store.pending(), "rejected": self.store.rejected(),
                                      "rewrite": self.store.rewrite()}
        if applied:
            sha = applied.sha
            result = None
            for attempt in ("mirror", "fetch"):  # the mirror may be gone (a fresh disk): fetch, read again
                try:
                    if attempt == "fetch":
                        self.mirror.fetch()
                    else:
                        self.mirror.ensure()
                    result = validate_files(self.mirror.read(sha), revision=sha)
                    if result.catalog is not None:
                        # As applied: a rollout this commit starts after the restart skips its
                        # analysis too, if the commit said so.
                        result = dataclasses.replace(
                            result, catalog=with_trailers(result.catalog, self.mirror.info(sha).message))
                    break
                except GitError as exc:
                    log.warning("cannot restore applied revision %s from the %s: %s", sha[:12], attempt, exc)
            if result is not None and result.catalog is not None:
                changes.update(applied_sha=sha, applied_at=applied.time)
                self.desired.set(result.catalog)
                self.metrics.applied_time.set(applied.time)
            else:
                # Nothing is in force: the head must be judged again, not skipped as already judged
                # (seen: a restart with the mirror gone served no model until the next commit).
                self._judged = None
        self._set(**changes)
        self._set(state=self._state())
