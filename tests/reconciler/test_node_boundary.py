"""A catalog commit can only ask; the node decides (DESIGN §4). Seen through the real control
plane: a start a node refuses is an event and the replica's error naming what was refused and
the node setting that decides; no engine runs for it; once the node's owner allows it, the
retry starts the engine without a new commit."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from llmgw.admin.app import build_admin_app
from llmgw.control.feed import FeedHub
from llmgw.decide import ReplicaState
from tests.reconciler.fleet_e2e import LLMGW_YAML, Recorder, make_controller, make_repo, ready, sim_model, until

pytestmark = pytest.mark.slow


async def explain_through_the_admin_api(c, model: str) -> dict:  # noqa: ANN001 - a Controller
    app = build_admin_app(c, token="t", webhook_secret="s", hub=FeedHub())
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with aiohttp.ClientSession() as s, s.get(
                f"http://127.0.0.1:{port}/api/v1/explain-placement", params={"model": model},
                headers={"Authorization": "Bearer t"}, timeout=aiohttp.ClientTimeout(total=10)) as r:
            assert r.status == 200
            return await r.json()
    finally:
        await runner.cleanup()


@pytest.fixture(scope="module")
def fleet(sshd_fleet):
    return sshd_fleet(1)


async def test_a_start_the_node_would_refuse_is_not_placed_and_says_the_variable_and_setting_until_allowed(
        fleet, tmp_path: Path) -> None:
    """The node reports what it allows (env_allow): the plan does not promise a start it would
    refuse, and `llmgw explain` says which variable and which node setting decide. The node still
    refuses such a start itself (tests/agent); here it is never asked."""
    source = tmp_path / "w.bin"
    source.write_bytes(os.urandom(64))
    model = sim_model("chat", f"file://{source}", min_=1, max_=1) + "    env: " + json.dumps({"SIM_KNOB": "1"}) + "\n"
    repo = make_repo(tmp_path, fleet, {})
    # The catalog declares the name, so the commit validates; only the node's config allows it.
    repo.commit({"llmgw.yaml": LLMGW_YAML + "env_allow: [SIM_KNOB]\n", "models/chat.yaml": model}, "Add chat")
    [node] = list(fleet)
    original = node.config_path.read_text()
    c = make_controller(repo, tmp_path / "data", fleet, Recorder(), backoff_base=0.5, backoff_cap=1.0)
    await c.start()
    try:
        async def said() -> dict | None:
            try:
                explained = await explain_through_the_admin_api(c, "chat")
            except AssertionError:  # 404 until the first commit is applied
                return None
            return explained if any("SIM_KNOB" in line for line in explained["text"]) else None

        deadline = asyncio.get_running_loop().time() + 30
        while (explained := await said()) is None:
            assert asyncio.get_running_loop().time() < deadline, "explain never named SIM_KNOB"
            await asyncio.sleep(0.2)
        assert any("node does not allow env SIM_KNOB (its env_allow)" in line for line in explained["text"]), explained
        assert c.reconciler.snapshot() == []  # nothing placed, so nothing the node refused
        assert not [e for e in c.store.events() if e.kind == "replica-failed"]
        assert not list((node.state_dir / "engines").glob("*.json"))

        # The owner allows it in the node's own config: placed and started, without a commit.
        config = json.loads(original)
        config["env_allow"] = [*config.get("env_allow", []), "SIM_KNOB"]
        node.config_path.write_text(json.dumps(config))
        await until(lambda: ready(c, "chat"), timeout=40, what="chat ready once the node allows SIM_KNOB")
        [record] = [json.loads(p.read_text()) for p in (node.state_dir / "engines").glob("*.json")]
        assert record["env_keys"] == ["SIM_KNOB"] and record["user"] != "root"
    finally:
        await c.close()
        node.config_path.write_text(original)


async def test_a_replica_failed_on_a_node_is_retried_at_once_when_its_owner_changes_the_node_config(
        fleet, tmp_path: Path) -> None:
    """Not after the backoff (seen: 32 s after the fix): the node's config digest moved. The engine
    the node's config names exits at once (as a binary missing a library did, exit 127)."""
    source = tmp_path / "w.bin"
    source.write_bytes(os.urandom(64))
    repo = make_repo(tmp_path, fleet, {})
    repo.commit({"models/chat.yaml": sim_model("chat", f"file://{source}", min_=1, max_=1)}, "Add chat")
    [node] = list(fleet)
    original = node.config_path.read_text()
    broken = json.loads(original)
    broken["engines"] = {**broken["engines"], "sim": ["/bin/false"]}
    node.config_path.write_text(json.dumps(broken))
    # A backoff far longer than the test may wait: only the config change can start it again.
    c = make_controller(repo, tmp_path / "data", fleet, Recorder(), backoff_base=3600.0, backoff_cap=3600.0)
    await c.start()
    try:
        await until(lambda: any(r.state == ReplicaState.FAILED for r in c.reconciler.snapshot()),
                    timeout=60, what="the engine failing")
        [r] = c.reconciler.snapshot()
        assert r.retry_at is not None and r.retry_at - r.state_since >= 3600
        await c.reconciler.tick()  # seen failed with the config as it was
        node.config_path.write_text(original)  # the owner fixes the engine's command
        await until(lambda: ready(c, "chat"), timeout=60, what="chat ready once the node's engine is fixed")
        [retry] = [e for e in c.store.events() if e.kind == "replica-retry"]
        assert "the config of node n1 changed since it failed: retried now, not in 3600s" in retry.message
    finally:
        await c.close()
        node.config_path.write_text(original)
