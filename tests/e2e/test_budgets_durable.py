"""Budgets across a bad day, on real processes (issue 24): `llmgw controller` (with its own
router) on a local node running the simulator, standalone `llmgw router` processes, a real
redis-server without persistence, the real openai client. A tenant that spent its budget stays
refused when a router restarts, when the controller is killed and restarted, when Redis restarts
empty and while Redis is away; with Redis away, the routers together grant no more than was left.
(Before: a restarted router or controller, and each router with Redis away, granted a fresh budget;
an empty Redis granted one to all of them.)"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from llmgw.router import hash_key
from tests.e2e.processes import SIM_CHAT_MODEL_YAML, free_port, local_node_yaml, start, stop, wait_for
from tests.e2e.test_up import processes_under
from tests.router.test_budget_ledger import redis_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # ~15 s on a busy box; its waits allow 90 s and more
HELLO = [{"role": "user", "content": "Hello"}]
TOKEN = "budgets-admin-token"

LLMGW_YAML = """\
pools:
  - name: local
tenants:
  - name: team
    keys: [team-key]
    limits:
      budget: {tokens: %d, per: day}
  - name: other
    keys: [other-key, probe-0, probe-1, probe-2]
    limits:
      budget: {tokens: %d, per: day}
"""


class Fleet:
    """A controller on a local node, and standalone routers following it."""

    def __init__(self, tmp: Path, *, budget: int, other_budget: int, redis: str = "") -> None:
        self.tmp = tmp
        source = tmp / "catalog-src"
        (source / "models").mkdir(parents=True)
        (source / "llmgw.yaml").write_text(LLMGW_YAML % (budget, other_budget))
        (source / "nodes.yaml").write_text(local_node_yaml(2))
        (source / "models" / "sim-chat.yaml").write_text(SIM_CHAT_MODEL_YAML)
        self.data = tmp / "state"
        router_port, admin_port = free_port(), free_port()
        # The data dir laid out as `llmgw up` lays it out (a catalog repository, the local node's
        # config), in a process of its own: the layout takes the data dir's lock for its life.
        laid = subprocess.run([sys.executable, "-c", (
            "import json, sys; from pathlib import Path; from llmgw.control.up import prepare\n"
            "c = prepare(Path(sys.argv[1]), catalog=Path(sys.argv[2]), router_port=1, admin_port=2).controller\n"
            "print(json.dumps([c.repo, str(c.data_dir), str(c.local_agent_config)]))"),
            str(self.data), str(source)], capture_output=True, text=True, timeout=60, check=True)
        repo, data_dir, agent = json.loads(laid.stdout.splitlines()[-1])
        self.config = tmp / "controller.yaml"
        self.config.write_text(json.dumps({
            "repo": repo, "data_dir": data_dir, "local_agent_config": agent,
            "listen": {"router": f"127.0.0.1:{router_port}", "admin": f"127.0.0.1:{admin_port}"},
            "admin_token": TOKEN, "reconciler": {"tick_interval": "300ms"},
            "api_keys": [{"name": "team-key", "sha256": hash_key("sk-team")},
                         {"name": "other-key", "sha256": hash_key("sk-other")},
                         *({"name": f"probe-{i}", "sha256": hash_key(f"sk-probe-{i}")} for i in range(3))],
            **({"router": {"limits_redis": redis}} if redis else {}),
        }))
        self.own = f"http://127.0.0.1:{router_port}"
        self.admin = f"http://127.0.0.1:{admin_port}"
        self.controller: subprocess.Popen | None = None
        self.routers: dict[int, subprocess.Popen] = {}
        self.starts = 0

    def start_controller(self) -> None:
        self.starts += 1
        self.controller = start(["controller", "--config", str(self.config)], self.tmp / f"controller{self.starts}.log")
        wait_for(lambda: answer(self.own, "sk-other") in (200, 429), 90, "the controller's router answering",
                 self.controller)

    def start_router(self, port: int) -> str:
        self.routers[port] = start(["router", "--controller", self.admin, "--listen", f"127.0.0.1:{port}",
                                    "--report-interval", "0.3"], self.tmp / f"router{port}.log",
                                   env={"LLMGW_ADMIN_TOKEN": TOKEN})
        base = f"http://127.0.0.1:{port}"
        wait_for(lambda: answer(base, "sk-other", max_tokens=1) in (200, 429), 60, "a standalone router answering",
                 self.routers[port])
        return base

    def stop_router(self, port: int) -> None:
        assert stop(self.routers.pop(port), signal.SIGTERM, timeout=30) == 0  # its last batch goes with it

    def close(self) -> None:
        for proc in self.routers.values():
            stop(proc, signal.SIGTERM, timeout=30)
        if self.controller is not None:
            stop(self.controller, signal.SIGTERM, timeout=60)
        for pid in processes_under(self.data):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def ledger(self, tenant: str, key: str | None = None) -> int:
        """Tokens the ledger holds for ``tenant`` (and ``key``), by the usage API."""
        req = urllib.request.Request(f"{self.admin}/api/v1/usage?since=1d&by=tenant,key",
                                     headers={"Authorization": f"Bearer {TOKEN}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            rows = json.loads(r.read())["rows"]
        return sum(x["prompt_tokens"] + x["completion_tokens"] for x in rows
                   if x["tenant"] == tenant and key in (None, x["key"]))


def answer(base: str, key: str, max_tokens: int = 50) -> int:
    """One request's HTTP status (0: no answer: not listening yet), and nothing else."""
    c = openai.OpenAI(base_url=base + "/v1", api_key=key, timeout=20, max_retries=0)
    try:
        c.chat.completions.create(model="chat", messages=HELLO, max_tokens=max_tokens)
    except openai.APIStatusError as exc:
        ANSWERS.append(exc.message)
        return exc.status_code
    except openai.APIConnectionError:
        return 0
    return 200


ANSWERS: list[str] = []


def degraded(base: str) -> bool:
    """Whether the router at ``base`` limits alone (its client port's /metrics)."""
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return any(line.startswith("llmgw_router_limits_degraded ") and float(line.split()[-1]) == 1
               for line in text.splitlines())


def spend(base: str, key: str = "sk-team", max_tokens: int = 50) -> int:
    """Requests until the budget refuses; the tokens they were served."""
    c = openai.OpenAI(base_url=base + "/v1", api_key=key, timeout=20, max_retries=0)
    served = 0
    while True:
        try:
            r = c.chat.completions.create(model="chat", messages=HELLO, max_tokens=max_tokens)
        except openai.RateLimitError as exc:
            assert "-token budget per day" in exc.message, exc.message
            return served
        assert r.usage is not None
        served += r.usage.total_tokens


def refused_at_once(base: str) -> None:
    c = openai.OpenAI(base_url=base + "/v1", api_key="sk-team", timeout=20, max_retries=0)
    with pytest.raises(openai.RateLimitError) as refused:
        c.chat.completions.create(model="chat", messages=HELLO, max_tokens=50)
    assert "budget" in refused.value.message


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    made: list[Fleet] = []

    def make(**kw: object) -> Fleet:
        made.append(Fleet(tmp_path, **kw))  # type: ignore[arg-type]
        return made[-1]

    yield make  # type: ignore[misc]
    for f in made:
        f.close()


def test_a_spent_budget_stays_spent_when_a_router_or_the_controller_restarts(fleet) -> None:  # noqa: ANN001
    f = fleet(budget=600, other_budget=10_000)
    f.start_controller()
    port = free_port()
    theirs = f.start_router(port)
    served = spend(theirs)
    assert 500 < served <= 600

    # The router stops (its last batch goes to the ledger) and starts again: no count of its own.
    f.stop_router(port)
    wait_for(lambda: f.ledger("team") >= served, 20, "the router's usage in the ledger")
    theirs = f.start_router(port)
    refused_at_once(theirs)

    # The controller is killed and started again: its own router starts from the ledger too.
    assert f.controller is not None
    stop(f.controller, signal.SIGKILL)
    f.start_controller()
    refused_at_once(f.own)
    refused_at_once(theirs)  # and the standalone router, following the new controller, still refuses


@pytest.mark.skipif(not shutil.which("redis-server"), reason="redis-server is not installed")
def test_a_spent_budget_stays_spent_when_redis_restarts_empty_or_goes_away(fleet) -> None:  # noqa: ANN001
    redis_port = free_port()
    redis = redis_server(redis_port)
    try:
        f = fleet(budget=600, other_budget=3_000, redis=f"redis://127.0.0.1:{redis_port}/0")
        f.start_controller()
        a, b = free_port(), free_port()
        bases = [f.start_router(a), f.start_router(b)]
        # (A call to Redis slower than 0.25 s on a busy machine is degraded mode for 5 s, whose
        # share may refuse sooner: the bounds below hold whatever was served.)
        served = spend(bases[0])
        assert 0 < served <= 600
        # Half of the other tenant's budget, through the controller's own router.
        c = openai.OpenAI(base_url=f.own + "/v1", api_key="sk-other", timeout=20, max_retries=0)
        used = 0
        while used < 1_500:
            try:
                r = c.chat.completions.create(model="chat", messages=HELLO, max_tokens=100)
            except openai.RateLimitError:  # degraded for a while: its share spent; Redis answers again
                wait_for(lambda: not degraded(f.own), 30, "Redis answering the controller's router again")
                continue
            assert r.usage is not None
            used += r.usage.total_tokens
        # Each router reports once more after the ledger has all of it (a one-token probe each,
        # with a key of its own): the figures that router got back have everything in.
        wait_for(lambda: f.ledger("team") >= served and f.ledger("other") >= used, 20, "the usage in the ledger")
        # On a busy machine a router may be in degraded mode (Redis slower than 0.25 s) or still
        # hold an allowance for a few tenths of a second: a probe is asked again until it is
        # served (the tenant has ~1,500 tokens left; a bound on a hang, not a check of speed).
        for i, base in enumerate((*bases, f.own)):
            wait_for(lambda i=i, base=base: answer(base, f"sk-probe-{i}", max_tokens=1) == 200, 30,
                     f"probe {i} served", None)
        wait_for(lambda: all(f.ledger("other", f"probe-{i}") for i in range(3)), 20, "each router's probe in ledger")
        used = f.ledger("other")

        # Redis restarts without its data: the ledger's figure is where each budget starts. (What
        # the routers held of it when the tenant was refused is free again: a few tokens, not 600.)
        redis.kill()
        redis.wait(5)
        redis = redis_server(redis_port)
        more = [spend(base) for base in bases]
        assert served + sum(more) <= 600, (served, more)
        # What they spent reaches the ledger and every router hears the ledger's figure back (a
        # probe each, as above) before Redis goes away: a router alone starts from the last figure
        # it heard. (Seen once in CI's run: Redis killed before the ledger had the 255 tokens just
        # spent, and a router alone granted its share of a figure that did not count them.)
        wait_for(lambda: f.ledger("team") >= served + sum(more), 20, "the new spending in the ledger")
        probed = [f.ledger("other", f"probe-{i}") for i in range(3)]
        for i, base in enumerate((*bases, f.own)):
            wait_for(lambda i=i, base=base: answer(base, f"sk-probe-{i}", max_tokens=1) == 200, 30,
                     f"probe {i} served again", None)
        wait_for(lambda: all(f.ledger("other", f"probe-{i}") > probed[i] for i in range(3)), 20,
                 "each router's second probe in the ledger")
        used = f.ledger("other")

        # Redis goes away: each router on its own, from the ledger's figure, with its share of
        # what was left (3 routers: the controller's and two standalone ones).
        redis.kill()
        redis.wait(5)
        alone = [spend(base) for base in (*bases, f.own)]
        assert served + sum(more) + sum(alone) <= 600, (served, more, alone)
        alone = [spend(base, key="sk-other", max_tokens=20) for base in (*bases, f.own)]
        left = 3_000 - used
        assert sum(alone) <= left and all(s <= (left + 10) // 3 for s in alone), (alone, left)
        assert sum(alone) > left // 2, (alone, left)  # each did grant its share
    finally:
        redis.kill()
        redis.wait(5)
