"""`--fail-rate F`: a simulated engine that passes readiness and then fails a known share of its
requests, the "bad change" a canary must catch (issue 26). Real processes, real HTTP, the real
openai client (with its own retries off, so each failure is seen once)."""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
import urllib.request
from pathlib import Path

import aiohttp
import openai
import pytest

from llmgw.agent.llmgw_agent import check_args, engine_kind
from llmgw.catalog.model import Model, ModelName, Profile
from llmgw.engines.argv import engine_args
from llmgw.engines.health import probe_ready
from llmgw.engines.testing import PACKAGE_ROOT, SimProcess

MESSAGES = [{"role": "user", "content": "Say something"}]


def ready(sim: SimProcess, model: str, task: str = "chat") -> bool:
    """The reconciler's own readiness probe (a one-token completion, or an embedding)."""
    async def probe() -> bool:
        async with aiohttp.ClientSession() as session:
            return await probe_ready(session, sim.endpoint, model, task)  # type: ignore[arg-type]
    return asyncio.run(probe())


def get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return int(resp.status)


def metric(endpoint: str, name: str) -> float:
    with urllib.request.urlopen(endpoint + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def one_request(client: openai.OpenAI, i: int) -> None:
    """Request ``i`` by every way a client generates: chat and completions, whole and streamed."""
    kind = i % 4
    if kind == 0:
        client.chat.completions.create(model="sim-chat", messages=MESSAGES, max_tokens=3)
    elif kind == 1:
        list(client.chat.completions.create(model="sim-chat", messages=MESSAGES, max_tokens=3, stream=True))
    elif kind == 2:
        client.completions.create(model="sim-chat", prompt="Once", max_tokens=3)
    else:
        list(client.completions.create(model="sim-chat", prompt="Once", max_tokens=3, stream=True))


def expected_failures(rate: float, n: int) -> list[int]:
    return [i for i in range(1, n + 1) if math.floor(i * rate) > math.floor((i - 1) * rate)]


@pytest.mark.parametrize("rate", [0.3, 1.0, 0.0])
def test_after_the_readiness_probe_exactly_that_share_fails_with_an_openai_500(rate: float) -> None:
    n = 20
    with SimProcess("sim-chat", "--fail-rate", str(rate)) as sim, \
            openai.OpenAI(base_url=sim.endpoint + "/v1", api_key="x", timeout=10, max_retries=0) as client:
        # The first generation request is the readiness probe: answered, so a bad version becomes
        # ready and fails under load, as the change a canary exists for does.
        assert ready(sim, "sim-chat")
        failed, errors = [], []
        for i in range(1, n + 1):
            try:
                one_request(client, i)
            except openai.InternalServerError as exc:
                failed.append(i)
                errors.append(exc)
            # Requests that generate nothing neither fail nor count.
            assert get(sim.endpoint + "/health") == 200
            assert get(sim.endpoint + "/metrics") == 200
            assert [m.id for m in client.models.list().data] == ["sim-chat"]
        assert failed == expected_failures(rate, n)
        assert len(failed) == math.floor(n * rate)
        assert metric(sim.endpoint, "llmgw_sim_requests_failed_total") == len(failed)
    for exc in errors:
        assert exc.status_code == 500
        body = exc.body
        assert isinstance(body, dict) and body["type"] == "InternalServerError" and body["code"] == 500
        assert "--fail-rate" in body["message"]


def test_requests_refused_for_their_own_sake_do_not_count() -> None:
    with SimProcess("sim-chat", "--fail-rate", "0.5") as sim, \
            openai.OpenAI(base_url=sim.endpoint + "/v1", api_key="x", timeout=10, max_retries=0) as client:
        assert ready(sim, "sim-chat")
        for _ in range(3):  # a 404 for an unknown model stays a 404, and takes no turn
            with pytest.raises(openai.NotFoundError):
                client.chat.completions.create(model="nope", messages=MESSAGES)
        client.chat.completions.create(model="sim-chat", messages=MESSAGES, max_tokens=1)  # i=1: 0.5 -> 0
        with pytest.raises(openai.InternalServerError):
            client.chat.completions.create(model="sim-chat", messages=MESSAGES, max_tokens=1)  # i=2: 1.0 -> 1


def test_an_embedding_model_fails_its_embeddings_alike() -> None:
    with SimProcess("sim-embed", "--task", "embedding", "--fail-rate", "1") as sim, \
            openai.OpenAI(base_url=sim.endpoint + "/v1", api_key="x", timeout=10, max_retries=0) as client:
        assert ready(sim, "sim-embed", "embedding")
        with pytest.raises(openai.InternalServerError):
            client.embeddings.create(model="sim-embed", input="hello")


@pytest.mark.parametrize("value", ["1.5", "-0.1", "nan", "x"])
def test_a_rate_outside_0_to_1_is_refused_at_start(value: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "llmgw.engines.sim", "--model", "m", "--fail-rate", value],
                          capture_output=True, text=True, timeout=60, cwd=PACKAGE_ROOT, check=False)
    assert proc.returncode == 2
    assert "--fail-rate" in proc.stderr and "0 to 1" in proc.stderr


def test_the_agent_lets_a_sim_profile_pass_the_flag(tmp_path: Path) -> None:
    # What a catalog's bad change looks like: the flag in the profile's args, through the
    # controller's argv for the sim and the agent's own check of every start.
    model = Model(name=ModelName("sim-chat"), source="sim://tiny", size_gb=0.1,
                  profiles=(Profile("sim", 0, "sim", 1, args=("--fail-rate", "0.3")),))
    args = list(engine_args(model, model.profiles[0]))
    assert args[-2:] == ["--fail-rate", "0.3"]
    prefix = (sys.executable, "-m", "llmgw.engines.sim")
    check_args(engine_kind("sim", prefix), args, area=str(tmp_path), read_roots=())
