"""The trailer ``Llmgw-Skip-Analysis: yes`` (an emergency fix without a canary), read by the
follower from a real commit pushed to a real bare remote: the catalog it applies says so, the
next commit without it does not, and a restarted controller reads it again from the commit."""

from __future__ import annotations

from pathlib import Path

from llmgw.gitops import DesiredState
from llmgw.plan.guard import skips_analysis
from tests.catalog.corpus import SMALL
from tests.gitops.conftest import Remote, make_follower
from tests.gitops.test_follower import run, until, until_applied


def test_trailer_is_a_line_of_its_own() -> None:
    assert skips_analysis("Fix chat\n\nLlmgw-Skip-Analysis: yes\n")
    assert skips_analysis("Fix chat\n\nSigned-off-by: a <a@b>\nllmgw-skip-analysis:   YES")
    assert not skips_analysis("Fix chat\n\nLlmgw-Skip-Analysis: no\n")
    assert not skips_analysis("Fix chat: see Llmgw-Skip-Analysis: yes in the runbook")
    assert not skips_analysis("Fix chat\n\nLlmgw-Allow-Prune: yes\n")


def test_the_applied_catalog_skips_analysis_only_for_the_commit_that_says_so(remote: Remote, tmp_path: Path) -> None:
    async def scenario() -> None:
        follower = make_follower(remote, tmp_path / "data")
        await follower.start()
        try:
            await until_applied(follower)  # subscribers told too, not only the status
            assert follower.desired.catalog is not None and not follower.desired.catalog.skip_analysis

            urgent = remote.commit({"models/small.yaml": SMALL.replace("name: small", "name: small\n# hotfix")},
                                   "Hotfix small\n\nLlmgw-Skip-Analysis: yes")
            await follower.sync_once()
            assert follower.status.applied_sha == urgent
            assert follower.desired.catalog.revision == urgent and follower.desired.catalog.skip_analysis
            applied = [e for e in follower.store.events() if e.kind == "applied"][-1]
            assert "canary analysis skipped by trailer Llmgw-Skip-Analysis" in applied.message
        finally:
            await follower.close()

        # A controller restarted on that commit puts it in force as it was applied.
        desired = DesiredState()
        again = make_follower(remote, tmp_path / "data", desired)
        await again.start()
        try:
            await until(lambda: desired.catalog is not None)
            assert desired.catalog.revision == urgent and desired.catalog.skip_analysis

            # The next commit without the trailer rolls out as its policy says.
            later = remote.commit({"models/small.yaml": SMALL.replace("name: small", "name: small\n# later")},
                                  "Later change to small")
            await again.sync_once()
            assert again.status.applied_sha == later
            assert desired.catalog.revision == later and not desired.catalog.skip_analysis
        finally:
            await again.close()

    run(scenario())
