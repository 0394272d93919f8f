"""The node's lease (DESIGN §4, fencing), through the agent's own command line: who may drive the
node, how the epoch moves, and what is refused to anyone else."""

from __future__ import annotations

import json
import os
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
    assert node.ok("inventory", {"lease": B})["lease"] | {"expires": None, "heard": None} == {
        "holder": "ctl-b", "epoch": 2, "expires": None, "held": True, "expired": False, "sibling": False,
        "heard": None, "grace": 20.0, "term": None}
    released = node.ok("lease", {**B, "release": True})
    assert released["expired"] and released["holder"] == "ctl-b"
    assert node.ok("lease", A)["epoch"] == 3  # no takeover needed after a release
    assert "ttl must be" in node.fail("lease", {"holder": "x", "ttl": 0})[1]
    assert "holder must be" in node.fail("lease", {"ttl": 5})[1]


def test_a_node_nobody_leased_obeys_anyone(node: Node) -> None:
    node.ok("start", ENGINE)  # no lease file: nothing to be fenced from (a node before its first controller)
    node.ok("stop", {"replica_id": "r1", "grace_seconds": 1})


@pytest.mark.parametrize("damage", ["", "{", json.dumps({"holder": None, "epoch": 1, "expires": 1e12}),
                                    "NAN-EXPIRES", json.dumps({"holder": "ctl-a", "epoch": "1", "expires": 1e12}),
                                    json.dumps({"holder": "ctl-a", "epoch": 1, "expires": 1e12, "instance": 7})])
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


# --- instances: one holder id, two processes (a restart after a crash; a copied data dir) ---------
# A controller's holder id lives in its data dir, so a restored backup or a copy has the same id.
# Each start also sends an instance nonce: another instance of the same holder is fenced like any
# other controller while the one holding the lease is heard from; it succeeds that one once it has
# been silent for the lease's grace (a higher epoch: it may be a copy), or at once and at the same
# epoch when it names it as the instance it replaces (a proven restart).
A1 = {"holder": "ctl-a", "instance": "i1", "ttl": 60, "grace": 5}
A2 = {"holder": "ctl-a", "instance": "i2", "ttl": 60, "grace": 5}
FENCE_1 = {"holder": "ctl-a", "epoch": 1, "instance": "i1"}
FENCE_2 = {"holder": "ctl-a", "epoch": 1, "instance": "i2"}


def silence(node: Node, seconds: float) -> None:
    """As if the lease's holder was last heard ``seconds`` ago (no waiting in a test)."""
    then = time.time() - seconds
    for name in ("lease.json", "lease.beat"):
        path = node.state / name
        if path.exists():
            os.utime(path, (then, then))


def test_another_instance_of_the_holder_is_fenced_while_the_holder_is_heard_from(node: Node) -> None:
    assert node.ok("inventory", {"lease": A1})["lease"]["held"]
    view = node.ok("inventory", {"lease": A2})["lease"]
    assert (view["holder"], view["epoch"], view["held"], view["sibling"]) == ("ctl-a", 1, False, True)
    assert "instance" not in view or view["instance"] != "i1"  # another's nonce is not handed out
    message = refused(node, "start", {**ENGINE, "fence": FENCE_2})
    assert "another instance of controller 'ctl-a' (a copied data dir?)" in message
    assert "another instance" in refused(node, "stop", {"replica_id": "r1", "fence": FENCE_2})
    assert "another instance" in refused(node, "remove-weights", {"paths": [], "fence": FENCE_2})
    # No ping-pong: the two ask in turn, the holder keeps renewing, the lease never moves.
    for _ in range(3):
        silence(node, 4)  # close to the grace, but the holder speaks before it runs out
        assert node.ok("inventory", {"lease": A1})["lease"]["held"]
        assert not node.ok("inventory", {"lease": A2})["lease"]["held"]
    assert node.ok("lease", A2)["held"] is False
    lease = json.loads((node.state / "lease.json").read_text())
    assert (lease["instance"], lease["epoch"]) == ("i1", 1)


def test_an_instance_succeeding_a_silent_one_raises_the_epoch_and_leaves_its_engines_alone(node: Node) -> None:
    # The silent instance may be a live original that paused (SIGSTOP, a VM migrating) and the one
    # asking a copy of its data dir: nothing proves they are one controller, so what the silent one
    # started is not the new one's to stop (seen: a fenced copy stopped all the original's engines).
    node.ok("inventory", {"lease": A1})
    node.ok("start", {**ENGINE, "fence": FENCE_1})
    fence = {"holder": "ctl-a", "epoch": 2, "instance": "i2"}
    try:
        assert not node.ok("inventory", {"lease": A2})["lease"]["held"]  # i1 was heard just now
        silence(node, 6)  # i1 not heard for longer than its grace
        view = node.ok("inventory", {"lease": A2})["lease"]
        assert (view["held"], view["epoch"], view["sibling"]) == (True, 2, False)
        engine = node.ok("inventory", {"lease": A2})["engines"][0]
        assert (engine["holder"], engine["epoch"]) == ("ctl-a", 1)  # i1's, not at i2's epoch
        message = refused(node, "start", {**ENGINE, "fence": fence})
        assert "already running here, started by controller 'ctl-a' (epoch 1)" in message
        # The old instance, should it come back, is fenced, and cannot take the lease back.
        assert "another instance" in refused(node, "stop", {"replica_id": "r1", "fence": FENCE_1})
        assert not node.ok("inventory", {"lease": A1})["lease"]["held"]
    finally:
        node.ok("stop", {"replica_id": "r1", "grace_seconds": 1, "fence": fence})


def test_only_a_proven_restart_keeps_the_epoch_after_a_release(node: Node) -> None:
    node.ok("inventory", {"lease": A1})
    # A copy stopping cleanly must not hand the live controller's nodes to whoever asks next.
    after = node.ok("lease", {**A2, "release": True})
    assert not after["expired"] and not after["held"]
    assert node.ok("inventory", {"lease": B})["lease"]["held"] is False
    released = node.ok("lease", {**A1, "release": True})
    assert released["expired"]
    # The restart of the same controller (it names i1: its data dir's lock and record prove it)
    # continues at once, at the same epoch: i1's engines are its own.
    view = node.ok("inventory", {"lease": {**A2, "succeeds": "i1"}})["lease"]
    assert (view["held"], view["epoch"]) == (True, 1)
    # Another instance taking a released lease (a copy waiting fenced) gets a higher epoch.
    assert node.ok("lease", {**A2, "release": True})["expired"]
    taken = node.ok("inventory", {"lease": {**A1, "instance": "i3"}})["lease"]
    assert (taken["held"], taken["epoch"]) == (True, 2)
    # The holding instance taking its own expired lease back is no succession: the same epoch.
    assert node.ok("lease", {**A1, "instance": "i3", "release": True})["expired"]
    assert node.ok("inventory", {"lease": {**A1, "instance": "i3"}})["lease"]["epoch"] == 2


def test_a_takeover_by_another_instance_raises_the_epoch_and_fences_the_first(node: Node) -> None:
    node.ok("inventory", {"lease": A1})
    node.ok("start", {**ENGINE, "fence": FENCE_1})
    fence = {"holder": "ctl-a", "epoch": 2, "instance": "i2"}
    try:
        taken = node.ok("lease", {**A2, "takeover": True})
        assert (taken["held"], taken["epoch"]) == (True, 2)
        assert "another instance" in refused(node, "stop", {"replica_id": "r1", "fence": FENCE_1})
        assert not node.ok("inventory", {"lease": A1})["lease"]["held"]
        # The first instance's engine is not the second's, though both carry the same holder id.
        message = refused(node, "start", {**ENGINE, "gpus": [1], "fence": fence})
        assert "already running here, started by controller 'ctl-a' (epoch 1)" in message
    finally:
        node.ok("stop", {"replica_id": "r1", "grace_seconds": 1, "fence": fence})


def test_an_instance_and_a_grace_must_be_sane(node: Node) -> None:
    assert "instance must be" in node.fail("lease", {**A1, "instance": ""})[1]
    assert "instance must be" in node.fail("lease", {**A1, "instance": "x" * 201})[1]
    assert "instance must be" in node.fail("lease", {**A1, "instance": 5})[1]
    for grace in (0, -1, 61, True, "5", float("nan")):
        assert "grace must be" in node.fail("lease", {**A1, "grace": grace})[1], grace


def test_an_instance_that_names_the_one_it_replaces_takes_over_at_once(node: Node) -> None:
    node.ok("inventory", {"lease": A1})
    # Naming another instance than the holder's proves nothing: still fenced.
    assert not node.ok("inventory", {"lease": {**A2, "succeeds": "i7"}})["lease"]["held"]
    view = node.ok("inventory", {"lease": {**A2, "succeeds": "i1"}})["lease"]
    assert (view["held"], view["epoch"]) == (True, 1)  # no silence waited out, the same epoch
    # ...and only for the same holder id: another controller naming i1 gets nothing.
    assert not node.ok("inventory", {"lease": {**B, "succeeds": "i2"}})["lease"]["held"]
    assert "succeeds must be" in node.fail("lease", {**A1, "succeeds": ""})[1]


def test_a_later_leader_of_a_shared_store_takes_over_at_once_and_keeps_the_engines(node: Node) -> None:
    # Controllers on one PostgreSQL store share a holder id; the store's leader term is the proof.
    lead1 = {**A1, "term": 4}
    assert node.ok("inventory", {"lease": lead1})["lease"]["term"] == 4
    node.ok("start", {**ENGINE, "fence": {**FENCE_1, "term": 4}})
    lead2 = {**A2, "term": 5}
    fence2 = {**FENCE_2, "term": 5}
    try:
        # The old leader was heard from just now: a later term does not wait for its silence...
        view = node.ok("inventory", {"lease": lead2})["lease"]
        # ...and keeps the node's epoch: the old leader's engine is the new one's, not foreign.
        assert (view["held"], view["epoch"], view["term"]) == (True, 1, 5)
        again = node.ok("start", {**ENGINE, "fence": fence2})
        assert again["already_running"]
        # The old leader is refused, saying why, and cannot take the lease back, even just expired.
        message = refused(node, "stop", {"replica_id": "r1", "fence": {**FENCE_1, "term": 4}})
        assert "leader of controller 'ctl-a' at term 5" in message and "term 4" in message
        path = node.state / "lease.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "expires": time.time() - 1}))
        assert not node.ok("inventory", {"lease": lead1})["lease"]["held"]
        # An equal term proves nothing more than an instance does: fenced while heard from.
        assert node.ok("inventory", {"lease": lead2})["lease"]["held"]
        assert not node.ok("inventory", {"lease": {**A1, "instance": "i9", "term": 5}})["lease"]["held"]
        # An operator's takeover still goes through, at a raised epoch.
        taken = node.ok("lease", {**lead1, "takeover": True})
        assert (taken["held"], taken["epoch"]) == (True, 2)
    finally:
        node.ok("stop", {"replica_id": "r1", "grace_seconds": 1, "fence": {**FENCE_1, "epoch": 2, "term": 4}})


def test_a_term_must_be_a_non_negative_integer(node: Node) -> None:
    for term in (-1, 1.5, True, "5"):
        assert "term must be" in node.fail("lease", {**A1, "term": term})[1], term



def test_a_term_nobody_leads_at_does_not_lock_the_node_for_ever(node: Node) -> None:
    # Seen in review: a term far ahead (a restored store's, a reset lease row, anyone's number)
    # took the node, and the real leader was refused even once that holder was long gone.
    assert node.ok("inventory", {"lease": {**A2, "term": 2 ** 62}})["lease"]["held"]
    lead = {**A1, "term": 6}
    assert not node.ok("inventory", {"lease": lead})["lease"]["held"]  # while it is heard from
    path = node.state / "lease.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "expires": time.time() - 1}))
    silence(node, 60)  # expired, and silent past its grace (5 s)
    view = node.ok("inventory", {"lease": lead})["lease"]
    assert (view["held"], view["epoch"], view["term"]) == (True, 2, 6)  # a lapse: a raised epoch


def test_a_takeover_never_lowers_the_term_and_a_termless_holder_carries_none(node: Node) -> None:
    assert node.ok("inventory", {"lease": {**A2, "term": 5}})["lease"]["held"]
    taken = node.ok("lease", {**A1, "term": 4, "takeover": True})
    assert (taken["held"], taken["epoch"], taken["term"]) == (True, 2, 5)
    # Its own renewals go on at its epoch (the holding instance, whatever its term).
    path = node.state / "lease.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "expires": time.time() - 1}))
    assert node.ok("inventory", {"lease": {**A1, "term": 4}})["lease"]["epoch"] == 2
    # A term-less asker taking the node (after the grace) writes no term it was not given.
    path.write_text(json.dumps({**json.loads(path.read_text()), "expires": time.time() - 1}))
    silence(node, 60)
    view = node.ok("inventory", {"lease": {**A2, "instance": "i9"}})["lease"]
    assert view["held"] and view["term"] is None
