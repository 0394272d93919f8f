"""Every operator command against a running controller on 2 sshd nodes: text and JSON."""

from __future__ import annotations

import json
import urllib.request

import pytest

from tests.admin.conftest import TOKEN, Running, put_cache_entry
from tests.reconciler.fleet_e2e import sim_model

pytestmark = pytest.mark.slow


def cli(run_cli, running: Running, *args: str) -> tuple[int, str]:
    return run_cli(*args, "--url", running.url, "--token", TOKEN)


def test_status_nodes_models_replicas_explain(run_cli, running: Running) -> None:
    code, out = cli(run_cli, running, "status")
    assert code == 0, out
    applied = running.controller.follower.status.applied_sha
    assert f"sync      synced  applied {applied[:12]}" in out
    assert "nodes     2/2 ready" in out and "replicas  1/1 ready" in out

    code, out = cli(run_cli, running, "nodes")
    assert code == 0
    assert "n1" in out and "n2" in out and "1/2" in out and "2/2" in out and "sim" in out
    code, out = cli(run_cli, running, "nodes", "-o", "json")
    data = {n["id"]: n for n in json.loads(out)}
    assert data["n1"]["gpu_total"] == 2 and data["n1"]["gpu_free"] == 1 and data["n2"]["gpu_free"] == 2
    assert data["n1"]["agent_version"] == "0.1.0" and data["n1"]["replicas"] == 1
    assert data["n1"]["disk_total_gb"] > 0 and data["n1"]["state"] == "ready"

    code, out = cli(run_cli, running, "models")
    assert code == 0 and "chat" in out and "1/1" in out and "1-2" in out and "sim:simx1" in out
    code, out = cli(run_cli, running, "models", "-o", "json")
    (m,) = json.loads(out)
    assert (m["name"], m["ready_replicas"], m["min_replicas"], m["max_replicas"]) == ("chat", 1, 1, 2)

    code, out = cli(run_cli, running, "replicas", "-o", "json")
    (r,) = json.loads(out)
    assert r["model"] == "chat" and r["state"] == "ready" and r["shards"][0]["node"] == "n1"
    assert r["idle_seconds"] == -1  # no router has reported any use
    code, out = cli(run_cli, running, "replicas", "--model", "chat")
    assert r["id"] in out and "n1 gpus 0" in out

    code, out = cli(run_cli, running, "explain", "chat")
    assert code == 0
    assert out.splitlines()[:2] == ["model chat: 1 replica(s) placed", "  running: profile sim on n1 gpus [0]"]
    assert "  sim on n2: fits" in out
    code, out = cli(run_cli, running, "explain", "nope")
    assert code == 1 and 'model "nope" is not in the catalog' in out


def test_gpus_an_engine_no_replica_claims_holds_are_not_free_in_nodes_or_explain(run_cli, running: Running) -> None:
    # An engine started on n2 outside this controller's replicas (by hand here; another controller's
    # looks the same): `llmgw nodes` and `llmgw explain` count its GPUs as placement does, taken.
    running.call(running.controller.fleet.start("n2", {
        "replica_id": "by-hand-gpus", "engine": "pyhttp", "args": ["{port}", "--bind", "{host}"], "gpus": [0, 1],
        "labels": {}}))
    try:
        running.call(running.controller.inventory.poll())
        code, out = cli(run_cli, running, "nodes", "-o", "json")
        data = {n["id"]: n for n in json.loads(out)}
        assert (data["n2"]["gpu_total"], data["n2"]["gpu_free"]) == (2, 0), data["n2"]
        assert [e["id"] for e in data["n2"]["unclaimed_engines"]] == ["by-hand-gpus"]
        code, out = cli(run_cli, running, "nodes")
        assert code == 0 and "0/2" in out
        code, out = cli(run_cli, running, "explain", "chat")
        assert "  sim on n2: rejected: needs 1 free GPU of class sim, has 0 (of 2: 2 in use)" in out, out
        metrics = urllib.request.Request(running.url + "/api/v1/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
        with urllib.request.urlopen(metrics, timeout=30) as r:
            assert 'llmgw_gpus_free{class="sim",node="n2"} 0.0' in r.read().decode()
    finally:
        running.call(running.controller.fleet.stop("n2", "by-hand-gpus", grace_seconds=2))
    running.call(running.controller.inventory.poll())
    code, out = cli(run_cli, running, "nodes", "-o", "json")
    assert {n["id"]: n["gpu_free"] for n in json.loads(out)}["n2"] == 2


def test_cordon_uncordon_drain_and_events(run_cli, running: Running) -> None:
    code, out = cli(run_cli, running, "cordon", "n2")
    assert code == 0 and out.strip() == "node n2 is now cordoned"
    code, out = cli(run_cli, running, "nodes", "-o", "json")
    assert {n["id"]: n["state"] for n in json.loads(out)}["n2"] == "cordoned"
    code, out = cli(run_cli, running, "uncordon", "n2", "-o", "json")
    assert json.loads(out)["state"] == "ready"
    code, out = cli(run_cli, running, "cordon", "n9")
    assert code == 1 and 'node "n9" is not in the fleet' in out
    code, out = cli(run_cli, running, "events", "-o", "json")
    kinds = [json.loads(line)["kind"] for line in out.splitlines()]
    assert "applied" in kinds and "replica-ready" in kinds and "node-cordoned" in kinds
    code, out = cli(run_cli, running, "events")
    assert "node-cordoned" in out and "node n2 is now cordoned" in out


def test_models_add_and_remove_write_commits(run_cli, running: Running, tmp_path) -> None:
    f = tmp_path / "extra.yaml"
    f.write_text(sim_model("extra", running.weights, min_=0, max_=1))
    code, out = cli(run_cli, running, "models", "add", str(f), "--actor", "Alice <alice@example.com>")
    assert code == 0, out
    assert "committed and pushed" in out
    running.wait(lambda: running.controller.desired.catalog.model("extra") is not None, what="extra applied")
    from tests.conftest import git

    assert git(running.repo.path, "log", "-1", "--format=%an|%s") == "Alice|Add model extra"

    bad = tmp_path / "bad.yaml"
    bad.write_text(sim_model("bad", running.weights).replace("engine: sim", "engine: simm"))
    code, out = cli(run_cli, running, "models", "add", str(bad))
    assert code == 1 and "the change would make the catalog invalid" in out
    assert "models/bad.yaml:" in out and '"simm" is not one of' in out

    code, out = cli(run_cli, running, "models", "remove", "extra", "-o", "json")
    assert code == 0 and len(json.loads(out)["commit"]) == 40
    running.wait(lambda: running.controller.desired.catalog.model("extra") is None, what="extra removed")
    code, out = cli(run_cli, running, "models", "remove", "extra")
    assert code == 1 and 'model "extra" is not in the catalog' in out


def test_sync_and_prune_confirmation(run_cli, running: Running) -> None:
    code, out = cli(run_cli, running, "sync")
    assert code == 0 and out.startswith("synced: applied")
    code, out = cli(run_cli, running, "sync", "--allow-prune")
    assert code == 1 and "no commit is waiting for confirmation" in out


def test_weights_orphans_and_guarded_collection(run_cli, running: Running) -> None:
    n1, n2 = running.fleet[0], running.fleet[1]
    orphan = put_cache_entry(n1.cache_dir, "hf://org/retired-model@v1")
    in_use = put_cache_entry(n2.cache_dir, "hf://org/used-by-hand@v2")
    foreign = n1.model_dir / "operator-copy"
    foreign.mkdir(parents=True)
    (foreign / "weights.bin").write_bytes(b"mine")
    wanted = running.controller.desired.catalog.model("chat").cache_name
    # An engine started by hand on n2 uses the second orphan: the node must refuse it.
    running.call(running.controller.fleet.start("n2", {
        "replica_id": "by-hand", "engine": "pyhttp", "args": ["{port}", "--bind", "{host}"], "gpus": [],
        "weights": in_use.name, "labels": {}}))
    try:
        running.call(running.controller.inventory.poll())
        code, out = cli(run_cli, running, "weights", "orphans", "-o", "json")
        data = json.loads(out)
        assert sorted((o["node"], o["name"]) for o in data["orphans"]) == sorted(
            [("n1", orphan.name), ("n2", in_use.name)])
        assert data["foreign"] == {"n1": [str(foreign)]}
        assert all(o["name"] != wanted for o in data["orphans"])
        code, out = cli(run_cli, running, "weights", "orphans")
        assert orphan.name in out and "foreign (never collected)" in out

        code, out = cli(run_cli, running, "weights", "collect")
        assert code == 0 and "would ask to remove 2" in out
        assert orphan.exists() and in_use.exists()

        code, out = cli(run_cli, running, "weights", "collect", "--collect")
        assert code == 0, out
        assert "asked to remove 2, removed 1, refused 1" in out
        assert f"n1: {orphan}: removed" in out
        assert f"n2: {in_use}: refused:" in out and "in use" in out
        assert not orphan.exists() and in_use.exists() and foreign.exists()
        assert (n1.cache_dir / wanted).exists()
    finally:
        running.call(running.controller.fleet.stop("n2", "by-hand", grace_seconds=2))


def test_unreachable_controller_and_wrong_token_are_errors_not_tracebacks(run_cli, running: Running) -> None:
    code, out = run_cli("status", "--url", running.url, "--token", "wrong")
    assert code == 1 and "refused the admin token" in out
    code, out = run_cli("status", "--url", "http://127.0.0.1:9", "--token", TOKEN)
    assert code == 1 and "cannot reach the controller at http://127.0.0.1:9" in out
