"""The trailer Llmgw-Skip-Analysis speaks only for the commits that carry it (a review finding).

Real git: a bare remote, a person's clone, the real follower (the project's tests/gitops set-up).
"""

from __future__ import annotations

from pathlib import Path

from tests.catalog.corpus import SMALL
from tests.gitops.conftest import (
    Remote,
    make_follower,
    remote,  # noqa: F401 - the fixture
)
from tests.gitops.test_follower import run, until


def test_an_emergency_trailer_does_not_wave_through_an_earlier_commit_fetched_with_it(remote: Remote,  # noqa: F811
                                                                                    tmp_path: Path) -> None:
    """LOW-MEDIUM. Alice pushes a risky engine change to `small` (no trailer: she wants its canary).
    Before the follower's next fetch Bob pushes an unrelated emergency commit with
    `Llmgw-Skip-Analysis: yes`. The follower applies HEAD and reads only HEAD's message
    (follower.py: with_trailers(catalog, info.message)): the applied catalog has skip_analysis, so
    Alice's change, which never asked for it, is promoted without analysis. README: "the canary
    rollouts *that commit* starts go straight to promoting". (The converse also holds: an emergency
    commit followed within one poll by an ordinary one loses its trailer.)"""

    async def scenario() -> None:
        follower = make_follower(remote, tmp_path / "data")
        await follower.start()
        try:
            await until(lambda: follower.status.applied_sha is not None)
            remote.commit({"models/small.yaml": SMALL.replace("name: small", "name: small\n# new engine build")},
                          "small: new engine build (wants its canary)")
            urgent = remote.commit({"notes.md": "on call: rotated a key\n"},
                                   "Emergency: unrelated fix\n\nLlmgw-Skip-Analysis: yes")
            await follower.sync_once()
            assert follower.status.applied_sha == urgent
            catalog = follower.desired.catalog
            assert catalog is not None
            assert not catalog.skip_analysis, (
                "the catalog that starts small's rollout skips analysis: the trailer of a later commit that did "
                "not touch small waves small's unreviewed change through")
        finally:
            await follower.close()

    run(scenario())
