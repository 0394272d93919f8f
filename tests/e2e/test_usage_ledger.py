"""The usage ledger across restarts, as an operator runs it: `llmgw up` and a standalone router
in their own processes, the real openai client, `llmgw usage -o json` read back. Whoever restarts
(the router, gracefully; the controller, killed or stopped), every token the clients were told
they used is in the ledger, once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import openai
import pytest

from tests.e2e.processes import LLMGW, free_port, start, stop, wait_for
from tests.e2e.test_up import processes_under

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # bounds: a busy machine is slow, not wrong
HELLO = [{"role": "user", "content": "tell me a story"}]


class Clients:
    """What the clients were told: requests made, prompt and completion tokens."""

    def __init__(self) -> None:
        self.requests = self.prompt = self.completion = 0

    def ask(self, base: str, n: int) -> None:
        # A bound, not a speed: a machine busy with a vLLM test beside this one answered past 20 s.
        c = openai.OpenAI(base_url=base + "/v1", api_key="unused", timeout=120, max_retries=0)
        for i in range(n):
            if i % 2:
                r = c.chat.completions.create(model="gpt-4o-mini", messages=HELLO, max_tokens=8)
                assert r.usage is not None
                usage = r.usage
            else:
                s = c.chat.completions.create(model="gpt-4o-mini", messages=HELLO, max_tokens=8, stream=True,
                                              stream_options={"include_usage": True})
                usage = None
                for chunk in s:
                    usage = chunk.usage or usage
                assert usage is not None
            self.requests += 1
            self.prompt += usage.prompt_tokens
            self.completion += usage.completion_tokens

    def __eq__(self, total: object) -> bool:
        return isinstance(total, dict) and (total["requests"], total["prompt_tokens"], total["completion_tokens"]) \
            == (self.requests, self.prompt, self.completion)

    def __repr__(self) -> str:
        return f"requests={self.requests} prompt={self.prompt} completion={self.completion}"


def ledger(data: Path) -> dict:
    out = subprocess.run([LLMGW, "usage", "--data-dir", str(data), "--since", "1d", "-o", "json"],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    return json.loads(out)["total"]


def test_every_token_is_in_the_ledger_once_across_router_and_controller_restarts(tmp_path: Path) -> None:
    data = tmp_path / "state"
    admin_port, up_port, router_port = free_port(), free_port(), free_port()
    up_args = ["up", "--data-dir", str(data), "--router-port", str(up_port), "--admin-port", str(admin_port)]
    log = tmp_path / "up.log"

    def start_up() -> subprocess.Popen:
        proc = start(up_args, log)
        wait_for(lambda: (data / "admin.token").exists() and log.read_text().count("Ctrl-C") > starts, 90,
                 "llmgw up", proc)
        return proc

    def start_router() -> subprocess.Popen:
        return start(["router", "--controller", f"http://127.0.0.1:{admin_port}", "--listen",
                      f"127.0.0.1:{router_port}", "--report-interval", "0.5"], tmp_path / "router.log",
                     env={"LLMGW_ADMIN_TOKEN": (data / "admin.token").read_text().strip()})

    told = Clients()

    def ready(base: str) -> bool:
        try:
            told.ask(base, 1)  # a probe that is answered is counted like any request
        except openai.APIError:
            return False
        return True

    def exact() -> bool:
        got = ledger(data)
        seen.append(got)
        return told == got

    seen: list[dict] = []

    def settle(timeout: float, what: str) -> None:
        try:
            wait_for(exact, timeout, what)
        except AssertionError:
            raise AssertionError(f"{what}: the clients were told {told}; the ledger says {seen[-1:]}") from None

    starts = 0
    up = start_up()
    starts += 1
    router = None
    ours, theirs = f"http://127.0.0.1:{up_port}", f"http://127.0.0.1:{router_port}"
    try:
        router = start_router()
        wait_for(lambda: ready(theirs), 60, "an answer through the standalone router", router)
        wait_for(lambda: ready(ours), 30, "an answer through up's router", up)
        told.ask(theirs, 6)
        told.ask(ours, 6)
        settle(15, "the clients' counts")

        # The controller is killed: the standalone router serves on and keeps what it counts
        # until a controller takes it; the restarted one has the ledger it had.
        stop(up, signal.SIGKILL)
        told.ask(theirs, 5)
        up = start_up()
        starts += 1
        settle(20, "the ledger after the controller's restart")

        # The router stops gracefully right after answering: its last batch goes with it.
        told.ask(theirs, 3)
        assert stop(router, signal.SIGTERM, timeout=30) == 0
        settle(10, "the ledger after the router stopped")
        router = start_router()  # a new process: a new instance, nothing of the old one sent again
        wait_for(lambda: ready(theirs), 30, "the new router", router)
        told.ask(theirs, 2)
        settle(10, "the ledger with the new router")

        # The controller stops cleanly right after its own router answered: flushed at close.
        told.ask(ours, 4)
        assert stop(up, signal.SIGINT, timeout=60) == 0
        up = start_up()
        starts += 1
        assert told == ledger(data), (ledger(data), told)
    finally:
        if router is not None:
            stop(router, signal.SIGTERM, timeout=30)
        stop(up, signal.SIGINT, timeout=60)
        for pid in processes_under(data):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
