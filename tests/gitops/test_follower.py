"""The controller's git loop against a real bare remote, pushed to as a person would."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import aiohttp
from aiohttp import web

from llmgw.gitops import DesiredState, GitMirror, GitOpsFollower, Store, SyncState
from llmgw.gitops.status import History
from llmgw.gitops.webhook import webhook_handler
from tests.catalog.corpus import BIG, SMALL
from tests.conftest import commit_files, git
from tests.gitops.conftest import Remote, make_follower

SECRET = "hook-secret"

T = TypeVar("T")

NEW_MODEL = SMALL.replace("name: small", "name: extra").replace("[tiny]", "[extra-alias]")


async def until(check: Callable[[], bool], timeout: float = 30.0) -> None:
    """Wait for ``check``: a bound on a hang (git runs in subprocesses, slow on a busy machine)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


async def until_applied(follower: GitOpsFollower, sha: str | None = None) -> str:
    """Until ``sha`` (None: a first commit) is applied, and applying it is over: the status says
    applied a moment before the subscribers hear of it and its event is stored (the last step),
    all in the follower's worker thread while this one reads."""
    def done() -> bool:
        now = follower.status.applied_sha
        if now is None or sha not in (None, now):
            return False
        events = [e for e in follower.store.events() if e.kind == "applied"]
        return bool(events) and events[-1].subject == now[:12]

    await until(done)
    assert follower.status.applied_sha is not None
    return follower.status.applied_sha


async def watching(follower: GitOpsFollower, gitdir: Path) -> None:
    """Until the follower's file-system watch is up (it starts in a task of its own, with no word
    when it is): HEAD put back as it is, which changes nothing for git, until a fetch follows.
    Nothing else fetches here (the poll is a minute away), so that fetch is the watch's."""
    head = gitdir / "HEAD"
    text = head.read_bytes()
    deadline = time.monotonic() + 30  # a bound on a hang
    while True:
        before = follower.status.fetched_at
        probe = gitdir / "HEAD.probe"
        probe.write_bytes(text)
        probe.replace(head)  # renamed over it, as git itself writes refs: never seen half-written
        try:
            await until(lambda before=before: follower.status.fetched_at != before, timeout=1.0)
            return
        except AssertionError:
            assert time.monotonic() < deadline, "the file-system watch never fetched"


async def serve_webhook(trigger: Callable[[], None]) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_post("/api/v1/hooks/git", webhook_handler(SECRET, trigger))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}/api/v1/hooks/git"


async def post_hook(url: str, body: bytes, signature: str | None) -> int:
    headers = {"X-Hub-Signature-256": signature} if signature else {}
    timeout = aiohttp.ClientTimeout(total=5)
    async with aiohttp.ClientSession(timeout=timeout) as session, session.post(url, data=body, headers=headers) as r:
        return r.status


def sign(body: bytes) -> str:
    return "sha256=" + hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()


def run_value(coro: Awaitable[T]) -> T:
    return asyncio.run(coro)


def run(coro: Awaitable[None]) -> None:
    asyncio.run(coro)  # type: ignore[arg-type]


def test_commits_flow_through_webhook_reject_fix_and_force_push(remote: Remote, tmp_path: Path) -> None:
    async def scenario() -> None:
        desired = DesiredState()
        seen: list[str | None] = []
        desired.subscribe(lambda c: seen.append(c.revision))
        follower = make_follower(remote, tmp_path / "data", desired)
        await follower.start()
        runner, url = await serve_webhook(follower.trigger)
        try:
            first = await until_applied(follower)
            assert desired.catalog is not None and desired.catalog.revision == first

            # A valid commit, applied within one fetch after the webhook.
            good = remote.commit({"models/extra.yaml": NEW_MODEL}, "Add extra")
            body = b'{"ref": "refs/heads/main"}'
            assert await post_hook(url, body, sign(body)) == 202
            await until_applied(follower, good)
            assert follower.status.state == SyncState.SYNCED
            assert desired.catalog.resolve("extra-alias").name == "extra"

            # An invalid commit: rejected with its errors, the previous catalog in force.
            bad = remote.commit({"models/big.yaml": BIG.replace("[small]", "[ghost]")}, "Point big at a ghost",
                                author="Mallory <mallory@example.com>")
            follower.trigger()
            await until(lambda: follower.status.state == SyncState.REJECTED)
            rejected = follower.status.rejected
            assert rejected is not None and rejected.sha == bad
            assert rejected.author == "Mallory" and rejected.subject == "Point big at a ghost"
            assert [str(p) for p in rejected.problems] == [
                'models/big.yaml:4:13: fallback "ghost" is not in the catalog'
            ]
            assert follower.status.applied_sha == good
            assert desired.catalog.revision == good

            # A fix: applied, and the rejection no longer shows.
            fixed = remote.commit({"models/big.yaml": BIG}, "Fix big's fallback")
            follower.trigger()
            await until_applied(follower, fixed)
            assert follower.status.rejected is None

            # History rewritten: the older commit is simply the new desired state.
            remote.force_push(first)
            follower.trigger()
            await until_applied(follower, first)
            assert desired.catalog.resolve("extra") is None
            assert seen == [first, good, fixed, first]  # the bad commit never reached a subscriber

            kinds = [e.kind for e in follower.store.events()]
            assert kinds == ["applied", "applied", "rejected", "applied", "history-rewound", "applied"]
        finally:
            await runner.cleanup()
            await follower.close()

    run(scenario())


def test_bad_signature_is_401_and_fetches_nothing(remote: Remote, tmp_path: Path) -> None:
    async def scenario() -> None:
        follower = make_follower(remote, tmp_path / "data")
        await follower.start()
        runner, url = await serve_webhook(follower.trigger)
        try:
            await until(lambda: follower.status.applied_sha is not None)
            fetched_at = follower.status.fetched_at
            new = remote.commit({"models/extra.yaml": NEW_MODEL}, "Add extra")
            body = b'{"ref": "refs/heads/main"}'
            assert await post_hook(url, body, "sha256=" + "0" * 64) == 401
            assert await post_hook(url, body, None) == 401
            assert await post_hook(url, body + b"tampered", sign(body)) == 401
            await asyncio.sleep(0.5)
            assert follower.status.fetched_at == fetched_at
            assert follower.status.applied_sha != new
        finally:
            await runner.cleanup()
            await follower.close()

    run(scenario())


def test_prune_guard_holds_until_confirmed_or_trailer(remote: Remote, tmp_path: Path) -> None:
    async def scenario() -> None:
        follower = make_follower(remote, tmp_path / "data")
        await follower.start()
        try:
            await until(lambda: follower.status.applied_sha is not None)
            before = follower.status.applied_sha
            wipe = remote.commit({"models/big.yaml": None, "models/small.yaml": None}, "Remove every model")
            await follower.sync_once()
            status = follower.status
            assert status.state == SyncState.NEEDS_CONFIRMATION
            assert status.pending is not None and status.pending.sha == wipe
            assert status.pending.reasons == ("removes 2 of 2 models (more than 50%): big, small",)
            assert status.applied_sha == before
            assert follower.desired.catalog.resolve("big") is not None

            await follower.confirm()
            assert follower.status.applied_sha == wipe
            assert follower.status.state == SyncState.SYNCED
            assert follower.desired.catalog.models == ()

            # Back to two models, then a wipe that carries the trailer: applied at once.
            restore = remote.commit({"models/big.yaml": BIG, "models/small.yaml": SMALL}, "Restore models")
            await follower.sync_once()
            assert follower.status.applied_sha == restore
            trailer = remote.commit({"models/big.yaml": None, "models/small.yaml": None},
                                    "Retire the fleet\n\nLlmgw-Allow-Prune: yes")
            await follower.sync_once()
            assert follower.status.applied_sha == trailer
            assert "prune allowed by trailer" in follower.store.events()[-1].message
        finally:
            await follower.close()

    run(scenario())


def test_unreachable_remote_keeps_last_good_state_and_recovers(remote: Remote, tmp_path: Path) -> None:
    async def scenario() -> None:
        follower = make_follower(remote, tmp_path / "data")
        await follower.start()
        try:
            await until(lambda: follower.status.applied_sha is not None)
            good = follower.status.applied_sha
            away = remote.bare.with_name("moved.git")
            remote.bare.rename(away)
            await follower.sync_once()
            status = follower.status
            assert status.state == SyncState.FETCH_FAILED
            assert "git fetch failed" in status.last_error and "does not appear to be a git repository" in \
                status.last_error
            assert status.applied_sha == good and follower.desired.catalog.revision == good
            await follower.sync_once()  # a second failed poll: still one event for the outage
            assert [e.kind for e in follower.store.events()].count("fetch-failed") == 1

            away.rename(remote.bare)
            new = remote.commit({"models/extra.yaml": NEW_MODEL}, "Add extra")
            await follower.sync_once()
            assert follower.status.state == SyncState.SYNCED
            assert follower.status.applied_sha == new
            assert follower.status.last_error is None
        finally:
            await follower.close()

    run(scenario())


def test_restart_comes_back_on_the_applied_revision_without_reapplying(remote: Remote, tmp_path: Path) -> None:
    async def first_life() -> str:
        follower = make_follower(remote, tmp_path / "data")
        await follower.start()
        await until(lambda: follower.status.applied_sha is not None)
        sha = follower.status.applied_sha
        await follower.close()
        follower.store.close()
        return sha

    async def second_life(applied: str) -> None:
        desired = DesiredState()
        follower = make_follower(remote, tmp_path / "data", desired)
        await follower.start()
        try:
            # In force at once, before any fetch, from the stored revision.
            assert follower.status.applied_sha == applied
            assert desired.catalog is not None and desired.catalog.revision == applied
            await follower.sync_once()
            assert [e.kind for e in follower.store.events()] == ["applied"]  # from the first life only
        finally:
            await follower.close()

    applied = asyncio.run(first_life())
    run(second_life(applied))


def test_commit_in_a_local_repository_is_seen_by_the_watcher(remote: Remote, tmp_path: Path) -> None:
    async def scenario() -> None:
        follower = make_follower(remote, tmp_path / "data", watch_path=remote.bare)
        await follower.start()
        try:
            await until(lambda: follower.status.applied_sha is not None)
            await watching(follower, remote.bare)
            new = remote.commit({"models/extra.yaml": NEW_MODEL}, "Add extra")
            await until(lambda: follower.status.applied_sha == new)  # well inside the 60 s poll
        finally:
            await follower.close()

    run(scenario())


def test_a_working_repository_is_followed_by_its_refs_within_a_second(remote: Remote, tmp_path: Path) -> None:
    """The README's tour: edit, look at the diff for a while, then commit. The commit is seen by
    the refs it moves, not the edit (seen: 12–13 s, at the next poll). A reset to an older commit
    is reported as a rewind from which commit to which; an orphan history as a force-push; a
    deleted branch as such, the last good state kept."""
    work = remote.clone

    async def scenario() -> None:
        store = Store(tmp_path / "data" / "state.db").open()
        follower = GitOpsFollower(GitMirror(str(work), "main", tmp_path / "data" / "mirror.git"), DesiredState(),
                                  store, interval=60.0, watch_path=work)
        await follower.start()
        try:
            await until(lambda: follower.status.applied_sha is not None)
            first = follower.status.applied_sha
            await watching(follower, work / ".git")
            (work / "models" / "extra.yaml").write_text(NEW_MODEL)
            await asyncio.sleep(3.0)  # a person reading `llmgw diff`
            t0 = time.monotonic()
            second = commit_files(work, {}, "Add extra")
            # Well inside the 60 s poll interval: the file-system watch fetched it, not the poll.
            await until(lambda: follower.status.applied_sha == second, timeout=30)
            assert time.monotonic() - t0 < 30

            # A reset to the first commit: applied, and said to be a rewind.
            git(work, "reset", "-q", "--hard", first)
            await until_applied(follower, first)  # by the watch: the poll is 60 s away
            rewrite = follower.status.rewrite
            assert rewrite is not None and rewrite.kind == History.REWIND
            assert (rewrite.from_sha, rewrite.to_sha) == (second, first)
            events = follower.store.events()
            (rewound,) = [e for e in events if e.kind == "history-rewound"]
            assert f"rewound from {second[:12]} to {first[:12]}" in rewound.message
            applied = [e for e in events if e.kind == "applied"]
            assert applied[-1].subject == first[:12] and "rewound from" in applied[-1].message

            # An orphan branch put in its place: a force-push, not a rewind.
            git(work, "checkout", "-q", "--orphan", "fresh")
            orphan = commit_files(work, {}, "Start over")
            git(work, "branch", "-q", "-M", "fresh", "main")
            await until(lambda: follower.status.applied_sha == orphan)  # the watch: the poll is 60 s away
            assert follower.status.rewrite.kind == History.FORCE_PUSH
            assert "history-rewritten" in [e.kind for e in follower.store.events()]

            # The branch deleted: reported as such, the last good state kept.
            git(work, "checkout", "-q", "-b", "elsewhere")
            git(work, "branch", "-q", "-D", "main")
            await until(lambda: follower.status.state == SyncState.BRANCH_MISSING)
            assert follower.status.applied_sha == orphan and "no branch 'main'" in follower.status.last_error
            assert [e.kind for e in follower.store.events()].count("branch-missing") == 1
        finally:
            await follower.close()

    run(scenario())


def test_a_held_commit_pushed_again_after_a_revert_is_held_again(remote: Remote, tmp_path: Path) -> None:
    async def scenario() -> None:
        follower = make_follower(remote, tmp_path / "data")
        await follower.start()
        try:
            await until(lambda: follower.status.applied_sha is not None)
            good = follower.status.applied_sha
            wipe = remote.commit({"models/big.yaml": None, "models/small.yaml": None}, "Remove every model")
            await follower.sync_once()
            assert follower.status.state == SyncState.NEEDS_CONFIRMATION
            remote.force_push(good)  # reverted: nothing is held any more
            await follower.sync_once()
            assert follower.status.state == SyncState.SYNCED and follower.status.pending is None
            remote.force_push(wipe)  # the same commit again: judged again, not taken as already judged
            await follower.sync_once()
            assert follower.status.state == SyncState.NEEDS_CONFIRMATION and follower.status.pending.sha == wipe
            assert follower.status.applied_sha == good
        finally:
            await follower.close()

    run(scenario())


def test_a_restart_with_the_mirror_gone_comes_back_on_the_applied_catalog(remote: Remote, tmp_path: Path) -> None:
    async def life(check_restored: bool) -> str | None:
        follower = make_follower(remote, tmp_path / "data")
        await follower.start()
        try:
            if check_restored:  # before any fetch of this life: the catalog is in force already
                assert follower.desired.catalog is not None and follower.desired.catalog.resolve("big") is not None
            await until(lambda: follower.status.applied_sha is not None)
            return follower.status.applied_sha
        finally:
            # The follower first: its worker may still be writing the "applied" event (the status
            # says applied a moment before), and a store closed under it crashed the process.
            await follower.close()
            follower.store.close()

    applied = run_value(life(False))
    shutil.rmtree(tmp_path / "data" / "mirror.git")  # a fresh disk, a cleanup script
    assert run_value(life(True)) == applied


def test_following_another_branch_is_not_a_rewrite_of_history(remote: Remote, tmp_path: Path) -> None:
    git(remote.clone, "checkout", "-q", "-b", "staging")
    staging = commit_files(remote.clone, {"models/extra.yaml": NEW_MODEL}, "Staging only")
    git(remote.clone, "push", "-q", "origin", "staging")

    async def follow(branch: str) -> str | None:
        store = Store(tmp_path / "data" / "state.db").open()
        follower = GitOpsFollower(GitMirror(str(remote.bare), branch, tmp_path / "data" / "mirror.git"),
                                  DesiredState(), store, interval=60.0)
        await follower.start()
        try:
            await until(lambda: follower.status.applied_sha is not None and follower.status.head_sha is not None)
            await follower.sync_once()
            return follower.status.applied_sha
        finally:
            await follower.close()  # before its store (see life() above)
            kinds = [e.kind for e in store.events()]
            store.close()
            assert "history-rewritten" not in kinds and "history-rewound" not in kinds, kinds

    run_value(follow("main"))
    assert run_value(follow("staging")) == staging
