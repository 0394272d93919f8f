"""The README's "Going to a real fleet", followed literally on two real sshd nodes.

The guide's own text is read, not a copy of it: the agent config is the README's simulator block,
the controller config its YAML block, the API key made and hashed by its shell block, and each is
changed only where a path, an address or a port must be this machine's (each such change asserts
the README still says what is replaced). Then, as the steps say: a catalog repository of
examples/catalog's files (`llmgw validate`), `llmgw node trust` for each node into a known_hosts of
its own, an agent config per node named by `agent_config` in nodes.yaml, `llmgw controller
--config`, a model served through the router to the real openai client with the key, the webhook
signed with the secret. One node's nodes.yaml declares 2 × l40s while its agent (the README's
config without `gpus`, no nvidia-smi) reports none: `llmgw nodes`, its events and `llmgw explain`
say so, and the router refuses a model only that node could have run, naming why.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from llmgw.router.keys import hash_key
from tests.conftest import REPO_ROOT, git
from tests.e2e.processes import LLMGW, free_port, start, stop, wait_for
from tests.fixtures.sshd_fleet import MARKER_ENV, SshdFleet, SshdNode

pytestmark = pytest.mark.slow

EXAMPLES = REPO_ROOT / "examples" / "catalog"


def section() -> str:
    text = (REPO_ROOT / "README.md").read_text()
    start_at = text.index("## Going to a real fleet")
    return text[start_at:text.index("\n## ", start_at + 1)]


def blocks(lang: str) -> list[str]:
    """The section's fenced blocks of one language, dedented out of their list item."""
    return [textwrap.dedent(b) for b in re.findall(rf"^ *```{lang}\n(.*?)^ *```", section(), re.S | re.M)]


def swap(config: dict[str, Any], key: str, readme: object, ours: object) -> None:
    """Replace what the README says by this machine's value, after checking the README says it."""
    assert config[key] == readme, f"the README's {key} is {config[key]!r} now: update this walkthrough"
    config[key] = ours


def llmgw(*args: str, env: dict[str, str] | None = None, code: int = 0) -> str:
    proc = subprocess.run([LLMGW, *args], capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, "COLUMNS": "1000", **(env or {})})
    assert proc.returncode == code, f"llmgw {' '.join(args)}: {proc.stdout}{proc.stderr}"
    return proc.stdout


# --- step 1: the catalog repository -------------------------------------------------------------
def catalog(tmp: Path, fleet: SshdFleet, configs: dict[str, Path]) -> Path:
    repo = tmp / "llm-catalog"
    (repo / "models").mkdir(parents=True)
    shutil.copy(EXAMPLES / "llmgw.yaml", repo / "llmgw.yaml")
    sim, l40s = fleet
    (repo / "nodes.yaml").write_text(textwrap.dedent(f"""\
        # yaml-language-server: $schema=../../schemas/nodes.schema.json
        nodes:
          - id: sim-1
            address: {sim.host}
            port: {sim.port}
            user: {sim.user}
            pool: default
            gpus: {{count: 2, class: sim, memory_gb: 24}}
            disk_gb: 50
            agent_config: {configs["sim-1"]}
          - id: gpu-l40s-1
            address: {l40s.host}
            port: {l40s.port}
            user: {l40s.user}
            pool: default
            gpus: {{count: 2, class: l40s, memory_gb: 48}}
            disk_gb: 50
            agent_config: {configs["gpu-l40s-1"]}
        """))
    chat = (EXAMPLES / "models" / "sim-chat.yaml").read_text()
    assert "    pool: local\n" in chat
    (repo / "models" / "sim-chat.yaml").write_text(chat.replace("    pool: local\n", "    pool: default\n"))
    (repo / "models" / "l40s-chat.yaml").write_text(textwrap.dedent("""\
        name: l40s-chat
        source: sim://l40s-chat
        size_gb: 0.1
        scaling: {min: 0, max: 1}
        profiles:
          - {name: sim, engine: sim, gpus: 1, gpu_class: [l40s]}
        """))
    llmgw("validate", str(repo))
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "The fleet, from examples/catalog")
    return repo


# --- step 2: SSH ------------------------------------------------------------------------------------
def trust(fleet: SshdFleet, known_hosts: Path) -> None:
    for node in fleet:
        # First the fingerprint, nothing recorded (exit 2); then the key, with the fingerprint read on the node.
        said = llmgw("node", "trust", f"{node.host}:{node.port}", "--known-hosts", str(known_hosts), code=2)
        pub = f"{fleet.env.host_key_path(node.host)}.pub"
        theirs = subprocess.run(["ssh-keygen", "-lf", pub], capture_output=True, text=True, timeout=30,
                                check=True).stdout.split()[1]
        assert theirs in said, said  # the fingerprint to compare, as the README says
        llmgw("node", "trust", f"{node.host}:{node.port}", "--known-hosts", str(known_hosts), "--fingerprint", theirs)
    assert len(known_hosts.read_text().splitlines()) == len(fleet)


# --- step 3: the agent's node config, the simulator ------------------------------------------------
def agent_config(node: SshdNode, *, gpus: bool) -> Path:
    [block] = [b for b in blocks("json") if '"llmgw.engines.sim"' in b]
    config = json.loads(block)
    here = node.dir / "guide"
    swap(config, "cache_dir", "/var/cache/llmgw", str(here / "cache"))
    swap(config, "state_dir", "/var/lib/llmgw", str(here / "state"))
    swap(config, "port_range", [8100, 8199], list(node.port_range))
    swap(config, "advertise_address", "10.0.0.11", node.host)
    # The venv the README installs llmgw into is this interpreter's.
    swap(config, "engines", {"sim": ["/opt/llmgw/bin/python", "-m", "llmgw.engines.sim"]},
         {"sim": [sys.executable, "-m", "llmgw.engines.sim"]})
    # What the README says to list: the venv, its base Python and, for `pip install -e`, the checkout.
    import llmgw as package

    editable = Path(package.__file__).resolve().is_relative_to(REPO_ROOT)
    swap(config, "sandbox_paths", ["/opt/llmgw"], [sys.prefix, sys.base_prefix, *([str(REPO_ROOT)] * editable)])
    assert os.geteuid() == 0, "sshd test nodes log in as root"
    swap(config, "engine_user", "llmgw-engine", "nobody")  # the README's useradd is not run here
    if not shutil.which("bwrap"):
        swap(config, "sandbox", "bwrap", "auto")
    if not gpus:  # the production config of step 3: GPUs from nvidia-smi, which this node lacks
        del config["gpus"]
    config["engine_env"] = {MARKER_ENV: str(node.dir)}  # the fixture's teardown finds engines by it
    for d in ("cache", "state"):
        (here / d).mkdir(parents=True, exist_ok=True)
    path = node.dir / f"agent-{'sim-1' if gpus else 'gpu-l40s-1'}.json"
    path.write_text(json.dumps(config))
    return path


# --- step 5: the controller's config and an API key ------------------------------------------------
def api_key() -> tuple[str, str]:
    """(key, sha256 hex), made and hashed by the README's own shell block."""
    [block] = [b for b in blocks("sh") if "sha256sum" in b]
    assert 'printf %s "$KEY" | sha256sum' in block
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", block + '\nprintf %s "$KEY" >&2'], capture_output=True,
                          text=True, timeout=60, check=True)
    key, digest = proc.stderr, proc.stdout.strip()
    assert key.startswith("sk-") and len(key) > 40
    assert re.fullmatch(r"[0-9a-f]{64}", digest) and digest == hash_key(key)  # as the router hashes keys
    return key, digest


def controller_config(tmp: Path, repo: Path, fleet: SshdFleet, known_hosts: Path, digest: str) -> tuple[Path, str, str]:
    """(config path, admin URL, router URL)."""
    [block] = [b for b in blocks("yaml") if b.startswith("repo:")]
    config = yaml.safe_load(block)
    swap(config, "repo", "git@git.example.com:infra/llm-catalog.git", str(repo))
    swap(config, "data_dir", "/var/lib/llmgw", str(tmp / "data"))
    router, admin = f"0.0.0.0:{free_port()}", f"127.0.0.1:{free_port()}"
    swap(config, "listen", {"router": "0.0.0.0:8080", "admin": "127.0.0.1:8081"}, {"router": router, "admin": admin})
    swap(config, "ssh", {"key": "/etc/llmgw/id_ed25519", "known_hosts": "/etc/llmgw/known_hosts"},
         {"key": str(fleet.client_key), "known_hosts": str(known_hosts)})
    (tmp / "admin.token").write_text("guide-admin-token\n")
    (tmp / "webhook.secret").write_text("guide-webhook-secret\n")
    swap(config, "admin_token_file", "/etc/llmgw/admin.token", str(tmp / "admin.token"))
    swap(config, "webhook_secret_file", "/etc/llmgw/webhook.secret", str(tmp / "webhook.secret"))
    [entry] = config["api_keys"]
    swap(entry, "sha256", "<sha256 hex of the key>", digest)
    path = tmp / "controller.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, f"http://{admin}", f"http://127.0.0.1:{router.rsplit(':', 1)[1]}/v1"


# --- the walkthrough ------------------------------------------------------------------------------
@pytest.mark.timeout(420)
def test_the_real_fleet_guide_as_written(sshd_fleet, tmp_path: Path) -> None:
    if shutil.which("nvidia-smi"):
        pytest.skip("this machine has nvidia-smi: the agent would report its GPUs, not the README's")
    fleet = sshd_fleet(2)
    sim, l40s = fleet
    configs = {"sim-1": agent_config(sim, gpus=True), "gpu-l40s-1": agent_config(l40s, gpus=False)}
    repo = catalog(tmp_path, fleet, configs)
    known_hosts = tmp_path / "known_hosts"
    trust(fleet, known_hosts)
    key, digest = api_key()
    config, admin, router = controller_config(tmp_path, repo, fleet, known_hosts, digest)

    log = tmp_path / "controller.log"
    proc = start(["controller", "--config", str(config)], log)
    cli_env = {"LLMGW_ADMIN_TOKEN": "guide-admin-token"}
    try:
        def api(path: str) -> Any:
            req = urllib.request.Request(admin + path, headers={"Authorization": "Bearer guide-admin-token"})
            with urllib.request.urlopen(req, timeout=20) as r:
                return json.loads(r.read())

        def ready() -> bool:
            nodes = {n["id"]: n for n in api("/api/v1/nodes")}
            serving = [r for r in api("/api/v1/replicas") if r["model"] == "sim-chat" and r["state"] == "ready"]
            return all(n["state"] == "ready" for n in nodes.values()) and len(nodes) == 2 and bool(serving)

        try:
            wait_for(ready, 240, "both nodes ready and sim-chat serving", proc)
        except AssertionError as exc:  # say what the controller saw, not only that time ran out
            seen = [f"{e['kind']} {e['subject']}: {e['message']}" for e in api("/api/v1/events?limit=30")]
            raise AssertionError(f"{exc}\nevents:\n" + "\n".join(seen) + f"\nlog:\n{log.read_text()[-3000:]}") from None

        # The model, through the router, with the key the README made; the real OpenAI client.
        client = openai.OpenAI(base_url=router, api_key=key, max_retries=0, timeout=60)
        answer = client.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "Hi"}])
        assert answer.choices[0].message.content
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=router, api_key="sk-not-a-key", max_retries=0, timeout=60).models.list()
        # A model only the l40s node could have run: refused at once, saying why nothing will help.
        with pytest.raises(openai.InternalServerError) as refused:
            client.chat.completions.create(model="l40s-chat", messages=[{"role": "user", "content": "Hi"}])
        assert refused.value.status_code == 503
        assert "never fits on this node" in str(refused.value), refused.value

        # The engine ran under the node's own config (agent_config reached the agent's --config).
        [(shard, port)] = [(s, s["port"]) for r in api("/api/v1/replicas") if r["model"] == "sim-chat"
                           for s in r["shards"]]
        assert shard["node"] == "sim-1" and sim.port_range[0] <= port <= sim.port_range[1]
        assert any((sim.dir / "guide" / "state").iterdir())

        # Declared against reported: `llmgw nodes` (table and JSON), one event, `llmgw explain`.
        said = "nodes.yaml declares 2 × l40s 48 GB, the agent reports none"
        table = llmgw("nodes", "--url", admin, env=cli_env)
        [row] = [line for line in table.splitlines() if "gpu-l40s-1" in line]
        assert f"GPUs: {said} (placement counts the agent's)" in row, table
        assert "0/0" in row
        [sim_row] = [line for line in table.splitlines() if "sim-1" in line]
        assert "GPUs:" not in sim_row and "1/2" in sim_row, table
        nodes = {n["id"]: n for n in json.loads(llmgw("nodes", "--url", admin, "-o", "json", env=cli_env))}
        assert nodes["gpu-l40s-1"]["gpu_disagreement"] == said and nodes["sim-1"]["gpu_disagreement"] is None
        events = [json.loads(line) for line in llmgw("events", "--url", admin, "-o", "json", env=cli_env).splitlines()]
        gpu_events = [(e["kind"], e["subject"]) for e in events if e["kind"].startswith("node-gpus")]
        assert gpu_events == [("node-gpus-disagree", "gpu-l40s-1")], gpu_events  # once, over many polls
        explained = llmgw("explain", "l40s-chat", "--url", admin, env=cli_env)
        assert (f"sim on gpu-l40s-1: rejected: node has no GPUs ({said}: placement counts the agent's): "
                "never fits on this node") in explained, explained
        assert ("sim on sim-1: rejected: node has no GPU of class l40s (it has 2 × sim): never fits on this node"
                in explained), explained

        # Step 6: the git host's webhook, signed with the secret file's secret (its newline is not part of it).
        body = json.dumps({"ref": "refs/heads/main"}).encode()
        digest_hook = hmac.new(b"guide-webhook-secret", body, hashlib.sha256).hexdigest()
        hook = urllib.request.Request(admin + "/api/v1/hooks/git", data=body, method="POST",
                                      headers={"X-Hub-Signature-256": f"sha256={digest_hook}"})
        with urllib.request.urlopen(hook, timeout=20) as r:
            assert r.status == 202
        forged = urllib.request.Request(admin + "/api/v1/hooks/git", data=body, method="POST",
                                        headers={"X-Hub-Signature-256": "sha256=" + "0" * 64})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(forged, timeout=20)
        with err.value:
            assert err.value.code == 401

        # Keys are set: no open-router warning in the log or on the dashboard.
        page = urllib.request.Request(admin + "/", headers={"Authorization": "Bearer guide-admin-token"})
        with urllib.request.urlopen(page, timeout=20) as r:
            assert 'id="open-router"' not in r.read().decode()
        assert "is open" not in log.read_text()
    finally:
        stop(proc, signal.SIGTERM)
