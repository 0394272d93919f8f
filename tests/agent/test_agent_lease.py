"""The node's lease (DESIGN §4, fencing), through the agent's own command line: who may drive the
node, how the epoch moves, and what is refused to anyone else."""

from __future__ import annotations

import json
import time

import pytest

from tests.agent.helpers import Node

A, B = {"holder": "ctl-a", "ttl": 60}, {"holder": "ctl-b", "ttl": 60}
ENGINE = {"replica_id": "r1", "engine": "pyhttp", "args": ["{port}", "--bind", "{host}"], "gpus": [0],
          "labels": {"llmgw.replica": "r1"}}


def refused(node: Node, verb: str, request: dict) -> str:
    code, answer = node.run(verb, request)
    assert code != 0 and answer["refused"] == {"setting": "lease"}, answer
    return answer["error"]


def test_the_first_controller_gets_the_lease_and_the_second_is_told_who_holds_it(node: Node) -> None:
    lease = node.ok("inventory", {"lease": A})["lease"]
    assert (lease["holder"], lease["epoch"], lease["held"]) == ("ctl-a", 1, True)
    assert node.ok("inventory", {"lease": A})["lease"]["epoch"] == 1  # renewed, not taken again
    other = node.ok("inventory", {"lease": B})["lease"]
    assert (other["holder"], other["epoch"], other["held"]) == ("ctl-a", 1, False)
    assert node.ok("inventory", {})["lease"]["holder"] == "ctl-a"  # a poll without a lease only reads it


def test_changes_need_the_current_holder_and_epoch(node: Node) -> None:
    node.ok("inventory", {"lease": A})
    fence_a = {"holder": "ctl-a", "epoch": 1}
    message = refused(node, "start", {**ENGINE, "fence": {"holder": "ctl-b", "epoch": 1}})
    assert "driven by controller 'ctl-a' (epoch 1)" in message and "'ctl-b'" in message
    assert "without a lease" in refused(node, "stop", {"replica_id": "r1"})
    refused(node, "remove-weights", {"paths": [], "fence": {"holder": "ctl-a", "epoch": 0}})
    started = node.ok("start", {**ENGINE, "fence": fence_a})
    try:
        (engine,) = node.ok("status")["engines"]
        assert (engine["holder"], engine["epoch"], engine["gpus"]) == ("ctl-a", 1, [0])  # stamped by the node
        # B takes the node over: A's next command is refused, its engine keeps running.
        taken = node.ok("lease", {**B, "takeover": True})
        assert (taken["holder"], taken["epoch"], taken["held"]) == ("ctl-b", 2, True)
        assert "epoch 2" in refused(node, "stop", {"replica_id": "r1", "fence": fence_a})
        assert node.ok("status")["engines"][0]["alive"] and started["pid"]
    finally:
        node.ok("stop", {"replica_id": "r1", "grace_seconds": 1, "fence": {"holder": "ctl-b", "epoch": 2}})


def test_an_expired_or_released_lease_goes_to_the_next_controller_at_a_higher_epoch(node: Node) -> None:
    node.ok("inventory", {"lease": A})
    path = node.state / "lease.json"
    lease = json.loads(path.read_text())
    path.write_text(json.dumps({**lease, "expires": time.time() - 1}))  # A has been gone a minute
    assert node.ok("inventory", {"lease": B})["lease"] | {"expires": None} == {
        "holder": "ctl-b", "epoch": 2, "expires": None, "held": True, "expired": False}
    released = node.ok("lease", {**B, "release": True})
    assert released["expired"] and released["holder"] == "ctl-b"
    assert node.ok("lease", A)["epoch"] == 3  # no takeover needed after a release
    assert "ttl must be" in node.fail("lease", {"holder": "x", "ttl": 0})[1]
    assert "holder must be" in node.fail("lease", {"ttl": 5})[1]


def test_a_node_nobody_leased_obeys_anyone(node: Node) -> None:
    node.ok("start", ENGINE)  # no lease file: nothing to be fenced from (a node before its first controller)
    node.ok("stop", {"replica_id": "r1", "grace_seconds": 1})


@pytest.mark.parametrize("damage", ["", "{", json.dumps({"holder": None, "epoch": 1, "expires": 1e12}),
                                    "NAN-EXPIRES", json.dumps({"holder": "ctl-a", "epoch": "1", "expires": 1e12})])
def test_a_damaged_lease_file_fences_everyone_until_a_takeover(node: Node, damage: str) -> None:
    node.ok("inventory", {"lease": A})
    path = node.state / "lease.json"
    if damage == "NAN-EXPIRES":
        damage = json.dumps({**json.loads(path.read_text()), "expires": float("nan")})
    path.write_text(damage)  # a power loss, a hand edit: not a reason to obey anyone
    view = node.ok("inventory", {"lease": B})["lease"]
    assert view["holder"] == "(an unreadable lease file)" and not view["held"] and not view["expired"]
    for fence in ({"holder": "ctl-a", "epoch": 1}, {"holder": "ctl-b", "epoch": 1}, None):
        message = refused(node, "stop", {"replica_id": "r1", **({"fence": fence} if fence else {})})
        assert "lease file is unreadable" in message
    taken = node.ok("lease", {**B, "takeover": True})
    assert taken["held"] and taken["epoch"] >= 1
    node.ok("stop", {"replica_id": "r1", "fence": {"holder": "ctl-b", "epoch": taken["epoch"]}})


def test_an_epoch_must_be_the_very_integer_and_a_holder_not_too_long(node: Node) -> None:
    node.ok("inventory", {"lease": A})
    for epoch in (True, 1.0, "1", None):
        refused(node, "stop", {"replica_id": "r1", "fence": {"holder": "ctl-a", "epoch": epoch}})
    assert "at most 200 characters" in node.fail("lease", {"holder": "x" * 201, "ttl": 5})[1]


def test_a_replica_id_running_for_another_controller_is_not_adopted(node: Node) -> None:
    node.ok("inventory", {"lease": A})
    node.ok("start", {**ENGINE, "fence": {"holder": "ctl-a", "epoch": 1}})
    try:
        taken = node.ok("lease", {**B, "takeover": True})
        fence_b = {"holder": "ctl-b", "epoch": taken["epoch"]}
        # B numbers its replicas as A does: its r1 is not A's engine, whatever the id says.
        message = refused(node, "start", {**ENGINE, "gpus": [1], "fence": fence_b})
        assert "already running here, started by controller 'ctl-a'" in message
    finally:
        node.ok("stop", {"replica_id": "r1", "grace_seconds": 1, "fence": fence_b})


def test_a_lease_renewed_while_the_clock_ran_fast_ends_rather_than_fencing_its_holder(node: Node) -> None:
    node.ok("inventory", {"lease": A})
    path = node.state / "lease.json"
    lease = json.loads(path.read_text())
    path.write_text(json.dumps({**lease, "expires": time.time() + 7200}))  # renewed an hour "ahead"
    again = node.ok("inventory", {"lease": A})["lease"]
    assert again["held"] and again["holder"] == "ctl-a" and again["epoch"] == 1  # still ours, not damaged
