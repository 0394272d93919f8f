"""`llmgw diff` says which rollout a change will get: strategy, steps, how long at least, and
whether the fleet has room to start the new version beside the old or must stop
``max_unavailable`` old replicas first. Real commits in a real repository, run through the CLI."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from llmgw.catalog import read_directory, validate_files
from llmgw.inventory import Inventory, NodeState
from tests.conftest import git
from tests.plan.scenarios import CHAT, FIXED_DATES, base_repo, fleet

CANARY = "rollout:\n  strategy: canary\n  steps: [5, 25, 50]\n  interval: 2m\n"
ARGS = '    args: ["--ttft", "0.05"]\n'


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    return base_repo(tmp_path_factory.mktemp("diff-rollout") / "catalog")


@pytest.fixture(scope="module")
def snapshots(repo: Path, tmp_path_factory) -> dict[str, Path]:
    """The fleet running the base catalog (n3 free), and the same fleet full: n2 and n3
    cordoned (nothing new lands there), n1's two GPUs taken by chat and embed."""
    result = validate_files(read_directory(repo))
    assert result.catalog is not None
    snap = fleet(result.catalog)
    nodes = {k: dataclasses.replace(n, state=NodeState.CORDONED) if k in ("n2", "n3") else n
             for k, n in snap.inventory.nodes.items()}
    full = dataclasses.replace(snap, inventory=Inventory(nodes, snap.inventory.taken_at))
    out = {}
    for name, s in (("room", snap), ("full", full)):
        out[name] = tmp_path_factory.mktemp(name) / "fleet.json"
        out[name].write_text(json.dumps(s.to_json()))
    return out


def diff(run_cli, repo: Path, snapshot: Path, files: dict[str, str], fmt: str = "json") -> tuple[int, str]:  # noqa: ANN001
    git(repo, "checkout", "-q", "-B", "change", "base")
    for rel, text in files.items():
        (repo / rel).write_text(text)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "--allow-empty", "-m", "change", env=FIXED_DATES)
    return run_cli("diff", "base", "HEAD", "--repo", str(repo), "--snapshot", str(snapshot), "--format", fmt)


def test_a_canary_on_a_fleet_with_room(run_cli, repo: Path, snapshots: dict[str, Path]) -> None:
    files = {"models/chat.yaml": CHAT.replace("profiles:", CANARY + "profiles:") + ARGS}
    code, out = diff(run_cli, repo, snapshots["room"], files)
    assert code == 2
    data = json.loads(out)
    (ro,) = data["plan"]["rollouts"]
    assert (ro["model"], ro["strategy"], ro["steps"], ro["interval"], ro["at_least_seconds"]) == (
        "chat", "canary", [5, 25, 50], 120, 360)
    assert ro["room_to_surge"] is True and ro["replicas"] == 1
    assert data["rollouts_summary"] == "Rollouts: 1 canary (at least 6m)."
    # The rollout block itself is a catalog change a reviewer sees.
    (change,) = [c for c in data["changes"] if c["name"] == "chat"]
    assert {"path": "rollout.strategy", "before": "replace", "after": "canary"} in change["fields"]
    assert {"path": "rollout.steps", "before": [10, 50], "after": [5, 25, 50]} in change["fields"]

    code, out = diff(run_cli, repo, snapshots["room"], files, "text")
    assert ("  rollout chat: canary, steps 5 %, 25 %, 50 %, 2m each, at least 6m; room to surge: new replicas "
            "start beside the old, 1 at a time") in out.splitlines()
    assert out.splitlines()[-2:] == ["Rollouts: 1 canary (at least 6m).",
                                     "Plan: 0 to start, 1 to replace, 0 to stop, 0 unplaceable."]
    code, out = diff(run_cli, repo, snapshots["room"], files, "markdown")
    assert ("| chat | canary, steps 5 %, 25 %, 50 %, 2m each | at least 6m | room to surge&#58; new replicas start "
            "beside the old, 1 at a time |") in out


def test_a_full_fleet_goes_max_unavailable_at_a_time(run_cli, repo: Path, snapshots: dict[str, Path]) -> None:
    files = {"models/chat.yaml": CHAT + ARGS}
    code, out = diff(run_cli, repo, snapshots["full"], files)
    data = json.loads(out)
    (ro,) = data["plan"]["rollouts"]
    assert ro["strategy"] == "replace" and ro["room_to_surge"] is False and ro["max_unavailable"] == 1
    assert ro["how"] == "no room to surge: 1 old replica(s) stopped at a time before the new start"
    assert data["rollouts_summary"] == "Rollouts: 1 replace, 1 without room to surge (max_unavailable at a time)."
    # The old replica is stopped first, since nothing can start beside it, and its replacement
    # starts in the place it frees (the next tick): the plan says both, not "cannot place".
    steps = data["plan"]["steps"]
    assert [(s["action"], s["replica"]) for s in steps] == [("start", None), ("stop", "chat-g1")]
    assert "once chat-g1 has stopped" in steps[0]["reason"] and not data["plan"]["unplaceable"]

    code, out = diff(run_cli, repo, snapshots["room"], files)
    (ro,) = json.loads(out)["plan"]["rollouts"]
    assert ro["room_to_surge"] is True
    # The same commit adds a model wanting every free GPU: the replacement is placed first (as the
    # tick does), the new model gets the rest, and the rollout's room agrees with the steps.
    fill = CHAT.replace("name: chat", "name: fill").replace("aliases: [gpt-4o-mini]\n", "").replace(
        "min: 1", "min: 3").replace("max: 2", "max: 3")
    code, out = diff(run_cli, repo, snapshots["room"], {**files, "models/fill.yaml": fill})
    data = json.loads(out)
    (ro,) = data["plan"]["rollouts"]
    assert ro["room_to_surge"] is True and data["plan"]["unplaceable"]["fill"]["replicas"] == 1
    assert [(s["action"], s["model"], s["shards"]) for s in data["plan"]["steps"]][0] == (
        "replace", "chat", [{"node": "n2", "gpus": [1]}])


def test_a_canary_of_a_single_replica_on_a_full_fleet_and_max_unavailable_zero(
        run_cli, repo: Path, snapshots: dict[str, Path]) -> None:  # noqa: ANN001
    canary = {"models/chat.yaml": CHAT.replace("profiles:", CANARY + "profiles:") + ARGS}
    code, out = diff(run_cli, repo, snapshots["full"], canary, "text")
    assert ("  rollout chat: canary, steps 5 %, 25 %, 50 %, 2m each, at least 6m; no room to surge and a single "
            "replica: replaced 1 at a time, then judged against the old version's figures") in out.splitlines()

    stuck = {"models/chat.yaml": CHAT.replace("profiles:", "rollout:\n  max_unavailable: 0\nprofiles:") + ARGS}
    code, out = diff(run_cli, repo, snapshots["full"], stuck)
    (ro,) = json.loads(out)["plan"]["rollouts"]
    assert ro["how"] == "no room to start a new replica beside the old and max_unavailable 0: waits for free GPUs"


def test_no_rollout_for_what_does_not_change_a_running_version(run_cli, repo: Path,
                                                                snapshots: dict[str, Path]) -> None:
    # The policy alone, the scaling, a profile no replica uses, a new model: nothing running changes.
    spare = "  - name: spare\n    priority: 9\n    engine: sim\n    gpus: 2\n    gpu_class: [sim]\n"
    files = {"models/chat.yaml": CHAT.replace("profiles:", CANARY + "profiles:").replace("max: 2", "max: 3")
             + spare,
             "models/qwen.yaml": CHAT.replace("name: chat", "name: qwen").replace("aliases: [gpt-4o-mini]\n", "")
             + ARGS}
    code, out = diff(run_cli, repo, snapshots["room"], files)
    data = json.loads(out)
    assert data["plan"]["rollouts"] == [] and data["rollouts_summary"] is None
    (qwen,) = [c for c in data["changes"] if c["name"] == "qwen"]
    assert not [f for f in qwen["fields"] if f["path"].startswith("rollout.")]  # nothing to roll out: not shown
    code, out = diff(run_cli, repo, snapshots["room"], files, "text")
    assert "rollout " not in out and "Rollouts:" not in out


def test_a_change_that_goes_out_unjudged_or_supersedes_a_live_rollout_says_so_plainly(
        run_cli, repo: Path, snapshots: dict[str, Path], tmp_path: Path) -> None:
    from llmgw.decide.rollout import Phase, Rollout
    from llmgw.plan import FleetSnapshot

    # The fleet with chat's canary of an earlier revision at its second step, as a controller exports it.
    snap = FleetSnapshot.from_json(json.loads(snapshots["full"].read_text()))
    live = Rollout("chat", "v2", "v1", "canary", Phase.CANARY, started_at=0.0, revision="c" * 40, step=1)
    mid = tmp_path / "fleet.json"
    mid.write_text(json.dumps(dataclasses.replace(snap, rollouts=(live,)).to_json()))
    files = {"models/chat.yaml": CHAT.replace("profiles:", CANARY + "profiles:") + ARGS}
    code, out = diff(run_cli, repo, mid, files, "text")
    lines = out.splitlines()
    # A single replica on a full fleet: no canary can run beside it.
    assert ("  ! chat goes out UNJUDGED: a single replica and no room for a canary beside it: it takes all traffic "
            "at once, judged after against the old version's figures and reverted if worse: no canary analysis; no "
            "acceptance prompts either") in lines, out
    assert any(f"now: a canary of revision {'c' * 12} is at step 2; this change supersedes it" in line
               for line in lines), out
    # With acceptance prompts it is still unjudged by a canary, and says what it has instead.
    accept = ('  acceptance:\n    - prompt: "2 + 2 ="\n      expect: {contains: ["4"]}\n')
    files = {"models/chat.yaml": CHAT.replace("profiles:", CANARY + accept + "profiles:") + ARGS}
    code, out = diff(run_cli, repo, snapshots["full"], files)
    (ro,) = json.loads(out)["plan"]["rollouts"]
    assert ro["unjudged"].endswith("reverted if worse: no canary analysis; each new replica answers 1 acceptance "
                                   "prompt(s) first") and ro["live"] is None
    # A canary with room is judged: nothing to warn about.
    code, out = diff(run_cli, repo, snapshots["room"], files)
    assert json.loads(out)["plan"]["rollouts"][0]["unjudged"] is None
