"""The commit says what became of it (issue 37): commit statuses on the git host.

After each commit the controller posts, through GitHub's or Gitea's commit-status API, what it did
with it, as Flux's notification controller and Argo CD's notifications do:

- context ``llmgw/<controller>``: ``success`` applied, ``failure`` rejected (with the first
  problems), ``pending`` held for an operator's confirmation (a prune);
- context ``llmgw/<controller>/<model>`` for each model the commit changed: ``pending`` rolling
  out (the canary's step, or promoting), ``success`` done, ``failure`` rolled back (the reason),
  ``error`` aborted.

:func:`wanted` decides (pure: what each commit's statuses should say now); :class:`CommitStatuses`
posts what changed since it last posted, every few seconds, on the leader only. The token goes
only to the configured API, never follows a redirect, and is never logged; a host that refuses
or is away costs a warning, and the status is tried again at the next turn.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

import aiohttp

from llmgw.decide.rollout import Phase, Rollout
from llmgw.gitops.status import SyncState, SyncStatus
from llmgw.redact import redact

log = logging.getLogger(__name__)

Provider = Literal["github", "gitea"]
State = Literal["pending", "success", "failure", "error"]
DESCRIPTION_MAX = 140  # GitHub's limit (Gitea's is larger): longer ones are refused
EVERY = 2.0  # seconds between looks at what changed
TIMEOUT = 10.0  # seconds per request to the git host
SHA = re.compile(r"^[0-9a-f]{40}$")


@dataclass(frozen=True)
class CommitStatusConfig:
    """Where statuses go: ``provider`` (github or gitea), the API's base ``url``
    (https://api.github.com, or the Gitea server's), ``repo`` as owner/name, the ``token``, and
    ``dashboard``, the link each status carries (optional)."""

    provider: Provider
    url: str
    repo: str
    token: str
    dashboard: str = ""

    def endpoint(self, sha: str) -> str:
        base = self.url.rstrip("/")
        api = base if self.provider == "github" else f"{base}/api/v1"
        return f"{api}/repos/{self.repo}/statuses/{sha}"

    def headers(self) -> dict[str, str]:
        if self.provider == "github":
            return {"Authorization": f"Bearer {self.token}", "Accept": "application/vnd.github+json",
                    "X-GitHub-Api-Version": "2022-11-28"}
        return {"Authorization": f"token {self.token}", "Accept": "application/json"}


Key = tuple[str, str]  # (commit sha, context)
Said = tuple[State, str]  # (state, description)


def wanted(sync: SyncStatus, rollouts: Iterable[Rollout], controller: str) -> dict[Key, Said]:
    """What each commit's statuses should say now. Pure."""
    out: dict[Key, Said] = {}
    context = f"llmgw/{controller}"
    if sync.applied_sha:
        out[(sync.applied_sha, context)] = ("success", "applied")
    if sync.state == SyncState.REJECTED and sync.rejected is not None:
        rejected = sync.rejected
        first = "; ".join(str(p) for p in rejected.problems[:2])
        out[(rejected.sha, context)] = ("failure", f"rejected: {len(rejected.problems)} problem(s): {first}")
    if sync.state == SyncState.NEEDS_CONFIRMATION and sync.pending is not None:
        out[(sync.pending.sha, context)] = ("pending", "held: it stops too much; confirm with "
                                                       "llmgw sync --allow-prune")
    for r in rollouts:
        if not r.revision:
            continue
        key = (r.revision, f"{context}/{r.model}")
        if r.phase == Phase.CANARY:
            out[key] = ("pending", f"rolling out {r.model}: canary, step {r.step + 1}")
        elif r.phase == Phase.PROMOTING:
            out[key] = ("pending", f"rolling out {r.model}: replacing the replicas")
        elif r.phase == Phase.DONE:
            out[key] = ("success", f"{r.model} rolled out")
        elif r.phase == Phase.ROLLED_BACK:
            out[key] = ("failure", f"{r.model} rolled back: {r.reason}")
        elif r.phase == Phase.ABORTED:
            out[key] = ("error", f"{r.model} rollout aborted: {r.reason}")
    return {k: (state, _short(text)) for k, (state, text) in out.items() if SHA.match(k[0])}


def _short(text: str) -> str:
    return text if len(text) <= DESCRIPTION_MAX else text[:DESCRIPTION_MAX - 1] + "…"


class CommitStatuses:
    """Posts what :func:`wanted` says that was not posted yet (see the module)."""

    def __init__(self, config: CommitStatusConfig, *, controller: Callable[[], str], sync: Callable[[], SyncStatus],
                 rollouts: Callable[[], Iterable[Rollout]], every: float = EVERY) -> None:
        self.config = config
        self._controller, self._sync, self._rollouts = controller, sync, rollouts
        self.every = every
        self.posted: dict[Key, Said] = {}
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._warned = False

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT))
        self._task = asyncio.create_task(self._run(), name="llmgw-commit-statuses")

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _run(self) -> None:
        while True:
            await self.post_changes()
            await asyncio.sleep(self.every)

    async def post_changes(self) -> int:
        """Post every status that changed; how many were posted."""
        now = wanted(self._sync(), self._rollouts(), self._controller())
        changed = {k: v for k, v in now.items() if self.posted.get(k) != v}
        done = 0
        for key, said in changed.items():
            if await self._post(key, said):
                self.posted[key] = said
                done += 1
        return done

    async def _post(self, key: Key, said: Said) -> bool:
        assert self._session is not None
        sha, context = key
        body: Mapping[str, str] = {"state": said[0], "description": said[1], "context": context,
                                   **({"target_url": self.config.dashboard} if self.config.dashboard else {})}
        try:
            async with self._session.post(self.config.endpoint(sha), json=body, headers=self.config.headers(),
                                          allow_redirects=False) as resp:
                if resp.status in (200, 201):
                    self._warned = False
                    return True
                problem = f"answered {resp.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            problem = f"did not answer ({type(exc).__name__})"
        if not self._warned:  # once until it works again: a host away must not flood the log
            log.warning("commit status for %s (%s) not posted: %s %s; trying again", sha[:12], context,
                        redact(self.config.url), problem)
            self._warned = True
        return False
