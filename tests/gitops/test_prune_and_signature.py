"""Pure parts of GitOps: the prune guard's judgement of a commit against a fleet, and the webhook
signature check."""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import replace

from llmgw.catalog import validate_files
from llmgw.catalog.loader import RawFile
from llmgw.decide.replica import ReplicaState
from llmgw.gitops.webhook import signature_ok
from llmgw.inventory import Inventory
from llmgw.plan.guard import allows_prune, judge_prune
from tests.plan.scenarios import BASE, CHAT, NODES, fleet


def _catalog(files: dict[str, str | None]):
    texts = {k: v for k, v in {**BASE, **files}.items() if v is not None}
    result = validate_files({k: RawFile(k, v.encode(), len(v.encode())) for k, v in texts.items()})
    assert result.catalog is not None, result.problems
    return result.catalog


OLD = _catalog({})
FLEET = fleet(OLD)  # n1 runs chat and embed, n2 runs old, n3 runs nothing; all three ready


def judge(new, snapshot=FLEET, *, now: float = 100.0):  # noqa: ANN001, ANN201
    return judge_prune(OLD, new, snapshot.inventory, snapshot.replicas, now=now)


def test_emptying_nodes_yaml_is_held_with_the_cause() -> None:
    verdict = judge(_catalog({"nodes.yaml": "nodes: []\n"}))
    assert verdict.held and verdict.models_removed == ()
    assert verdict.replicas_stopped == 3 and verdict.replicas_ready == 3
    assert verdict.reasons == ("stops 3 of 3 ready replicas (more than 50%): 2 because node n1 left nodes.yaml; "
                               "1 because node n2 left nodes.yaml",)
    assert dict(verdict.causes) == {"chat-g1": "node n1 left nodes.yaml", "embed-g2": "node n1 left nodes.yaml",
                                    "old-g3": "node n2 left nodes.yaml"}


def test_removing_a_node_that_runs_most_replicas_is_held_and_an_empty_one_is_not() -> None:
    without = {n: NODES.split("  - id: ")[0] + "".join("  - id: " + b for b in NODES.split("  - id: ")[1:]
                                                        if not b.startswith(n + "\n"))
               for n in ("n1", "n3")}
    assert judge(_catalog({"nodes.yaml": without["n1"]})).held
    verdict = judge(_catalog({"nodes.yaml": without["n3"]}))
    assert not verdict.held and verdict.replicas_stopped == 0


def test_removing_most_models_is_held() -> None:
    verdict = judge(_catalog({"models/chat.yaml": None, "models/embed.yaml": None}))
    assert verdict.held and verdict.models_removed == ("chat", "embed")
    assert verdict.reasons[0] == "removes 2 of 3 models (more than 50%): chat, embed"
    assert verdict.reasons[1] == "stops 2 of 3 ready replicas (more than 50%): 2 because model left the catalog"


def test_removing_one_model_of_three_passes_and_says_what_it_stops() -> None:
    verdict = judge(_catalog({"models/old.yaml": None}))
    assert not verdict.held and verdict.causes == (("old-g3", "model left the catalog"),)


def test_a_lowered_max_counts_what_it_stops() -> None:
    chat = FLEET.replicas[0]
    second = replace(chat, id="chat-g4", shards=(replace(chat.shards[0], node="n3"),),
                     placement=replace(chat.placement, shards=(replace(chat.placement.shards[0], node="n3"),)))
    two = replace(FLEET, replicas=(*FLEET.replicas, second))
    verdict = judge(_catalog({"models/chat.yaml": CHAT.replace("max: 2", "max: 1"), "models/embed.yaml": None,
                              "models/old.yaml": None}), two)
    assert verdict.held and verdict.replicas_ready == 4
    (above_max,) = [rid for rid, why in verdict.causes if why == "above max (1)"]
    assert above_max in ("chat-g1", "chat-g4")
    assert {rid for rid, why in verdict.causes if why == "model left the catalog"} == {"embed-g2", "old-g3"}


def test_replicas_already_lost_with_their_node_are_not_the_commits_doing() -> None:
    n2 = FLEET.inventory.nodes["n2"]
    gone = replace(FLEET, inventory=Inventory({**FLEET.inventory.nodes, "n2": replace(n2, unreachable_since=0.0)}))
    # n2 has been unreachable for 100 s (past the 30 s grace): old-g3 is lost whatever the commit.
    verdict = judge(_catalog({"models/old.yaml": None, "models/embed.yaml": None}), gone)
    assert dict(verdict.causes) == {"embed-g2": "model left the catalog"}


def test_first_catalog_is_never_held() -> None:
    assert not judge_prune(None, OLD, FLEET.inventory, FLEET.replicas, now=0.0).held


def test_trailer() -> None:
    assert allows_prune("Remove everything\n\nLlmgw-Allow-Prune: yes\n")
    assert not allows_prune("Remove everything\n\nLlmgw-Allow-Prune: no\n")
    assert not allows_prune("mentions Llmgw-Allow-Prune: yes in the middle of a line")


def test_signatures_github_and_gitea() -> None:
    secret, body = b"s3cret", b'{"ref": "refs/heads/main"}'
    digest = hmac.new(secret, body, hashlib.sha256).hexdigest()
    assert signature_ok(secret, body, {"X-Hub-Signature-256": f"sha256={digest}"})
    assert signature_ok(secret, body, {"X-Gitea-Signature": digest})
    assert not signature_ok(secret, body, {"X-Hub-Signature-256": digest})  # missing the sha256= prefix
    assert not signature_ok(secret, body + b" ", {"X-Gitea-Signature": digest})
    assert not signature_ok(secret, body, {})


def test_a_commit_that_makes_every_replica_idle_at_once_is_held() -> None:
    # min 0 and idle_after 1s everywhere: nothing is removed, yet the next tick would stop all three.
    idle = {f"models/{m}.yaml": BASE[f"models/{m}.yaml"].replace("min: 1", "min: 0").replace(
        "scaling:\n", "scaling:\n  idle_after: 1s\n") for m in ("chat", "embed", "old")}
    new = _catalog(idle)
    used_long_ago = {r.id: 0.0 for r in FLEET.replicas}  # the router last used them 600 s ago
    verdict = judge_prune(OLD, new, FLEET.inventory, FLEET.replicas, now=600.0, last_used=used_long_ago)
    assert verdict.held and verdict.replicas_stopped == 3
    assert all(why.startswith("idle for 600s") for _, why in verdict.causes)
    # Used a moment ago, nothing is idle yet: the same commit passes.
    recent = {r.id: 599.5 for r in FLEET.replicas}
    assert not judge_prune(OLD, new, FLEET.inventory, FLEET.replicas, now=600.0, last_used=recent).held


def test_replicas_adopted_after_a_restart_count_as_ready() -> None:
    # Just after a restart every stored replica is STARTING (adopted) until probed again.
    adopted = replace(FLEET, replicas=tuple(replace(r, state=ReplicaState.STARTING, adopted=True)
                                            for r in FLEET.replicas))
    verdict = judge(_catalog({"nodes.yaml": "nodes: []\n"}), adopted)
    assert verdict.held and verdict.replicas_ready == 3
