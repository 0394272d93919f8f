"""A router in its own process follows a real controller and outlives it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import openai
import pytest

from tests.e2e.processes import LLMGW, free_port, start, stop, wait_for
from tests.e2e.test_up import processes_under

pytestmark = pytest.mark.slow


def test_standalone_router_serves_from_the_controller_and_keeps_serving_without_it(tmp_path: Path) -> None:
    data = tmp_path / "state"
    admin_port, router_port = free_port(), free_port()
    up = start(["up", "--data-dir", str(data), "--router-port", str(free_port()), "--admin-port", str(admin_port)],
               tmp_path / "up.log")
    router = None
    try:
        wait_for(lambda: (data / "admin.token").exists() and "Ctrl-C" in (tmp_path / "up.log").read_text(), 60,
                 "llmgw up", up)
        token = (data / "admin.token").read_text().strip()
        router = start(["router", "--controller", f"http://127.0.0.1:{admin_port}", "--listen",
                        f"127.0.0.1:{router_port}"], tmp_path / "router.log", env={"LLMGW_ADMIN_TOKEN": token})
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{router_port}/v1", api_key="unused", timeout=10,
                               max_retries=0)

        def answer() -> str | None:
            try:
                r = client.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}])
            except openai.APIError:
                return None
            return r.choices[0].message.content

        assert wait_for(answer, 60, "an answer through the standalone router", router)

        # A key made on the controller reaches this router without a restart, and its revocation too.
        made = subprocess.run([LLMGW, "keys", "create", "edge", "--data-dir", str(data)], capture_output=True,
                              text=True, timeout=60, check=True).stdout
        key = re.search(r"^(llmgw-\S{40,})$", made, re.M).group(1)
        keyed = openai.OpenAI(base_url=f"http://127.0.0.1:{router_port}/v1", api_key=key, timeout=10, max_retries=0)

        def status(c: openai.OpenAI) -> int:
            try:
                c.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}])
            except openai.APIStatusError as exc:
                return exc.status_code
            return 200

        wait_for(lambda: status(client) == 401, 30, "the standalone router asks for a key", router)
        assert status(keyed) == 200
        subprocess.run([LLMGW, "keys", "revoke", "edge", "--data-dir", str(data)], timeout=60, check=True,
                       capture_output=True)
        wait_for(lambda: status(keyed) == 401, 30, "the revoked key refused by the standalone router", router)
        keyed.close()
        key_b = re.search(r"^(llmgw-\S{40,})$", subprocess.run(
            [LLMGW, "keys", "create", "edge-2", "--data-dir", str(data)], capture_output=True, text=True, timeout=60,
            check=True).stdout, re.M).group(1)
        client.close()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{router_port}/v1", api_key=key_b, timeout=10,
                               max_retries=0)
        wait_for(answer, 30, "the new key works on the standalone router", router)

        # The controller dies without a word (its engines live on, as on a real fleet): the
        # router keeps serving from the last endpoint list it had.
        os.kill(up.pid, signal.SIGKILL)
        up.wait(10)
        for _ in range(20):
            assert answer(), (tmp_path / "router.log").read_text()[-2000:]
    finally:
        if router is not None:
            assert stop(router, signal.SIGTERM, timeout=30) == 0
        stop(up, signal.SIGKILL)
        for pid in processes_under(data):  # the engines the killed controller left behind
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
