"""A model whose weights live in an S3-compatible store, served end to end: the catalog names
``s3://bucket/prefix``, the node's own agent config says where that store is and holds the key,
the controller has the node fetch it (signed requests to a real ``rclone serve s3``), the replica
starts on the fetched entry and the openai client is answered through the router. The catalog
never holds an endpoint or a secret, and `llmgw replicas` names where the weights came from."""

from __future__ import annotations

import json
import os
import re
import subprocess
import urllib.request
from pathlib import Path

import openai
import pytest

from llmgw.agent.parts.protocol import cache_name
from tests.e2e.processes import LLMGW, SIM_CHAT_MODEL_YAML, local_controller, start, stop_everything, wait_for
from tests.fixtures.s3 import ACCESS_KEY, SECRET_KEY, s3_server

pytestmark = pytest.mark.timeout(300)
TOKEN = "s3-model-admin-token"
SOURCE = "s3://weights/models/tiny-chat"
MODEL = SIM_CHAT_MODEL_YAML.replace("source: sim://tiny-chat", f"source: {SOURCE}")


def summary(admin: str) -> dict:
    req = urllib.request.Request(admin + "/api/v1/summary", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def test_a_model_in_s3_is_fetched_by_the_node_and_served(tmp_path: Path) -> None:
    with s3_server(tmp_path) as s3:
        weights = s3.put("weights", "models/tiny-chat/model.safetensors", b"\x00" * 4_000_000)
        s3.put("weights", "models/tiny-chat/config.json", b'{"model_type": "tiny"}')
        c = local_controller(tmp_path, model_yaml=MODEL, token=TOKEN)
        # The node's own settings: where its store is and its key (a file only it reads).
        agent_config = Path(json.loads(c.config.read_text())["local_agent_config"])
        secret = tmp_path / "s3-secret"
        secret.write_text(SECRET_KEY)
        secret.chmod(0o600)
        node = json.loads(agent_config.read_text())
        node["s3"] = {"endpoint": s3.url, "access_key_id": ACCESS_KEY, "secret_access_key_file": str(secret)}
        agent_config.write_text(json.dumps(node))
        catalog_text = "".join(p.read_text() for p in c.repo.rglob("*.yaml"))
        assert SECRET_KEY not in catalog_text and s3.url not in catalog_text

        s3.proxy.delay = 0.1  # a slow store: the fetch is seen under way
        procs = [start(["controller", "--config", str(c.config)], tmp_path / "controller.log")]
        try:
            # While it fetches, `llmgw replicas` says from where and how far.
            def fetching() -> str | None:
                done = subprocess.run([LLMGW, "replicas", "--url", c.admin, "--token", TOKEN], capture_output=True,
                                      text=True, timeout=60, env={**os.environ, "COLUMNS": "250"})
                return done.stdout if "fetching" in done.stdout and f"from {SOURCE}" in done.stdout else None

            table = wait_for(fetching, 120, "the fetch under way in llmgw replicas", procs[0])
            assert re.search(rf"local (\d+% of 4\.0 MB|[\d.]+ [KM]?B so far) from {SOURCE}", table), table
            req = urllib.request.Request(c.admin + "/api/v1/replicas", headers={"Authorization": f"Bearer {TOKEN}"})
            with urllib.request.urlopen(req, timeout=30) as r:
                [replica] = json.loads(r.read())
            if replica["state"] == "fetching":
                [(node, how_far)] = replica["weights"]["fetch"].items()
                assert how_far["from"] == SOURCE and how_far["bytes_total"] in (None, 4_000_022)
            s3.proxy.delay = 0.0
            wait_for(lambda: summary(c.admin)["replicas_ready"] == 1, 120, "the replica ready", procs[0])
            explained = subprocess.run([LLMGW, "explain", "chat", "--url", c.admin, "--token", TOKEN],
                                       capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "250"})
            assert f"weights: {SOURCE} (the origin); held by local" in explained.stdout, explained.stdout
            entry = c.data.rglob(cache_name(SOURCE))
            [fetched] = [p for p in entry if p.is_dir()]
            assert (fetched / "model.safetensors").read_bytes() == weights.read_bytes()
            client = openai.OpenAI(base_url=c.router + "/v1", api_key="unused", max_retries=0, timeout=30)
            answer = client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=4)
            assert answer.choices[0].message.content
            assert s3.proxy.sent >= 4_000_000  # read from the store, through the node's endpoint
        finally:
            stop_everything(procs, c.data)
