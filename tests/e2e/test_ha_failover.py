"""Several controllers on one PostgreSQL store (issue 36; the README's "Running two controllers"):
three `llmgw controller` processes share a real PostgreSQL server (the Debian package, started by
the fixture as sshd is), two sshd nodes, two standalone routers given every controller's address,
and the openai client sending through the routers all along.

- ``kill -9`` of the leader: a standby leads, the very engine processes serve (same replica ids,
  same pids, nothing started or stopped), no client request fails, and a commit pushed while no
  controller led is applied by the new leader after it takes over.
- A leader that stalls (SIGSTOP: it can neither renew its lease nor act, as one cut off from the
  database) loses the lease to the third controller; resumed, it stands by, and the nodes refuse a
  command carrying its term.
- The usage ledger in the store equals the tokens the clients received: a batch sent to a leader
  that died is neither lost nor counted twice.

Nothing sleeps for a fixed time: each step waits for what the admin API or the nodes show, within
deadlines sized for a busy 2-core machine. The figures (kill to new leader, to its node leases)
are printed, not asserted: how fast a takeover is belongs to bench/ha_bench.py."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from llmgw.dispatch.fence import FencedDispatcher
from llmgw.dispatch.ssh import SshDispatcher
from llmgw.errors import StartRefused
from tests.conftest import git
from tests.dispatch.helpers import pid_alive
from tests.e2e.processes import catalog_repo, controller_config, free_port, start, stop, wait_for
from tests.e2e.test_two_controllers import _targets
from tests.fixtures.postgres import postgres_server, postgres_url  # noqa: F401 - fixtures for this module
from tests.reconciler.fleet_e2e import sim_model

pytestmark = pytest.mark.slow

TOKEN = "ha-failover-token"
CHAT = sim_model("chat", "sim://chat", min_=2, max_=2)
EXTRA = sim_model("extra", "sim://extra", min_=1, max_=1)


def api(admin: str, path: str, body: dict | None = None):  # noqa: ANN201
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(admin + path, data=data, method="POST" if body is not None else "GET",
                                 headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=20) as r:
        return json.loads(r.read())


def role(admin: str) -> str | None:
    """The controller's role as its own admin API says, None when it does not answer."""
    try:
        return api(admin, "/api/v1/summary")["leadership"]["role"]
    except (OSError, ValueError, KeyError):
        return None


def leader_of(admins: dict[str, str]) -> str | None:
    leading = [name for name, admin in admins.items() if role(admin) == "leader"]
    return leading[0] if len(leading) == 1 else None


def ready(admin: str, model: str) -> dict[str, list[int]]:
    """The model's ready replicas on ``admin``: id → the pids of its shards."""
    return {r["id"]: [s["pid"] for s in r["shards"]] for r in api(admin, "/api/v1/replicas")
            if r["state"] == "ready" and r["model"] == model}


def events(admin: str, kind: str) -> list[dict]:
    return [e for e in api(admin, "/api/v1/events?limit=1000") if e["kind"] == kind]


def all_held(admin: str) -> bool:
    return all((n.get("lease") or {}).get("held") for n in api(admin, "/api/v1/nodes"))


@dataclass
class Clients:
    """Threads sending chat completions through the routers, in turn, with the openai client:
    what each was answered, and every failure with its reason."""

    routers: list[str]
    answered: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    failures: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self, n: int = 2) -> None:
        for i in range(n):
            t = threading.Thread(target=self._run, args=(i,), daemon=True)
            t.start()
            self._threads.append(t)

    def _run(self, i: int) -> None:
        import openai

        clients = [openai.OpenAI(base_url=r + "/v1", api_key="unused", max_retries=0, timeout=60)
                   for r in self.routers]
        n = i
        while not self._stop.is_set():
            client = clients[n % len(clients)]
            n += 1
            try:
                if n % 2:
                    answer = client.chat.completions.create(
                        model="chat", max_tokens=8, messages=[{"role": "user", "content": f"hello {n}"}])
                    usage = answer.usage
                else:
                    usage = None
                    for chunk in client.chat.completions.create(
                            model="chat", max_tokens=8, stream=True, stream_options={"include_usage": True},
                            messages=[{"role": "user", "content": f"stream {n}"}]):
                        usage = chunk.usage or usage
                if usage is None:
                    raise ValueError("no usage in the answer")
                with self._lock:
                    self.answered += 1
                    self.prompt_tokens += usage.prompt_tokens
                    self.completion_tokens += usage.completion_tokens
            except Exception as exc:  # noqa: BLE001 - every failure is the test's finding
                with self._lock:
                    self.failures.append(f"{time.strftime('%X')} via {self.routers[(n - 1) % 2]}: "
                                         f"{type(exc).__name__}: {exc}")
            self._stop.wait(0.02)

    def answers(self, router: str) -> bool:
        """One request (before the clients start: is the router serving yet?), its usage counted
        with theirs, since the ledger counts it too."""
        body = json.dumps({"model": "chat", "messages": [{"role": "user", "content": "hi"}],
                           "max_tokens": 2}).encode()
        req = urllib.request.Request(router + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                usage = json.loads(r.read())["usage"]
        except urllib.error.HTTPError as exc:
            exc.close()
            return False
        except OSError:
            return False
        with self._lock:
            self.answered += 1
            self.prompt_tokens += usage["prompt_tokens"]
            self.completion_tokens += usage["completion_tokens"]
        return True

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(90)


@pytest.fixture
def cluster(sshd_fleet, tmp_path: Path, postgres_url: str) -> Iterator[dict]:  # noqa: F811 - the fixture
    fleet = sshd_fleet(2)
    repo = catalog_repo(tmp_path, fleet, {"chat": CHAT}, "Chat")
    admins, configs = {}, {}
    for name in ("a", "b", "c"):
        configs[name], admins[name] = controller_config(tmp_path, name, repo, fleet, TOKEN, store=postgres_url)
    procs = {name: start(["controller", "--config", str(configs[name])], tmp_path / f"{name}.log")
             for name in admins}
    routers, router_procs = [], []
    try:
        for i in range(2):
            port = free_port()
            router_procs.append(start(["router", "--url", ",".join(admins.values()), "--listen", f"127.0.0.1:{port}",
                                       "--router-id", f"r{i}", "--report-interval", "0.5"],
                                      tmp_path / f"router{i}.log", env={"LLMGW_ADMIN_TOKEN": TOKEN}))
            routers.append(f"http://127.0.0.1:{port}")
        yield {"fleet": fleet, "repo": repo, "admins": admins, "procs": procs, "routers": routers,
               "router_procs": router_procs, "tmp": tmp_path}
    finally:
        for p in router_procs:
            if p.poll() is None:
                stop(p, signal.SIGTERM)
        for p in procs.values():
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)  # one stopped by the test must hear the signal
                stop(p, signal.SIGTERM)
        # The engines outlive their controllers, as on a real fleet: the sshd fleet's teardown
        # kills what was started under its nodes.


@pytest.mark.timeout(600)
def test_a_standby_takes_over_adopts_the_engines_and_no_request_fails(cluster: dict) -> None:
    admins, procs, routers, repo = cluster["admins"], cluster["procs"], cluster["routers"], cluster["repo"]
    first = wait_for(lambda: leader_of(admins), 90, "one of three controllers leads")
    lead = admins[first]
    pids = wait_for(lambda: (r := ready(lead, "chat")) and len(r) == 2 and r, 120, "2 chat replicas ready",
                    procs[first])
    wait_for(lambda: all_held(lead), 60, "the leader holds both nodes")
    clients = Clients(routers)
    wait_for(lambda: all(clients.answers(r) for r in routers), 60, "both routers answer")
    standbys = [n for n in admins if n != first]
    for n in standbys:  # a standby says who leads, and refuses a change
        assert role(admins[n]) == "standby"
        with pytest.raises(urllib.error.HTTPError) as refused:
            api(admins[n], "/api/v1/sync", {})
        assert refused.value.code == 503
        assert json.loads(refused.value.read())["leader"] == lead

    clients.start()
    try:
        wait_for(lambda: clients.answered >= 40, 60, "clients answered before the kill")

        # --- kill -9 of the leader, and a commit pushed while nobody leads ---------------------
        killed_at = time.time()
        os.kill(procs[first].pid, signal.SIGKILL)
        procs[first].wait(10)
        (repo / "models" / "extra.yaml").write_text(EXTRA)
        git(repo, "add", "-A")
        git(repo, "commit", "-qm", "Extra, pushed during the failover")
        head = git(repo, "rev-parse", "HEAD").strip()

        second = wait_for(lambda: leader_of({n: admins[n] for n in standbys}), 60, "a standby leads")
        led_at = time.time()
        lead2 = admins[second]
        wait_for(lambda: all_held(lead2), 60, "the new leader holds both nodes")
        held_at = time.time()
        # The very engines serve: the same replica ids and pids, none started, none stopped.
        assert wait_for(lambda: (r := ready(lead2, "chat")) and len(r) == 2 and r, 60, "chat ready again") == pids
        assert [e for e in events(lead2, "replica-created") if e["time"] >= killed_at
                and e["subject"].startswith("chat")] == []
        assert all(pid_alive(p) for ps in pids.values() for p in ps)
        # The commit pushed while nobody led is applied by the new leader.
        wait_for(lambda: api(lead2, "/api/v1/sync")["applied_sha"] == head, 90, "the new commit applied")
        wait_for(lambda: len(ready(lead2, "extra")) == 1, 120, "extra's replica ready")
        answered_after = clients.answered
        wait_for(lambda: clients.answered >= answered_after + 40, 60, "clients answered after the failover")
        print(f"\nfailover figures: kill -> leader {led_at - killed_at:.2f} s, "
              f"kill -> node leases {held_at - killed_at:.2f} s")

        # --- a leader that stalls (cannot renew, cannot act) loses the lease ------------------
        third = next(n for n in standbys if n != second)
        term2 = api(lead2, "/api/v1/summary")["leadership"]["epoch"]
        os.kill(procs[second].pid, signal.SIGSTOP)
        try:
            wait_for(lambda: role(admins[third]) == "leader", 60, "the third controller leads")
            lead3 = admins[third]
            wait_for(lambda: all_held(lead3), 60, "the third holds both nodes")
        finally:
            os.kill(procs[second].pid, signal.SIGCONT)
        wait_for(lambda: role(admins[second]) == "standby", 60, "the resumed leader stands by")
        assert wait_for(lambda: (r := ready(lead3, "chat")) and len(r) == 2 and r, 60, "chat ready") == pids
        # No node accepts a command carrying the stalled leader's term.
        node_holder = api(lead3, "/api/v1/nodes")[0]["lease"]["holder"]
        assert node_holder

        async def as_the_old_leader() -> str:
            fleet = cluster["fleet"]
            ssh = SshDispatcher([t for t in _targets(fleet) if t.id == "n1"], client_key=fleet.client_key,
                                known_hosts=fleet.known_hosts)
            old = FencedDispatcher(ssh, node_holder)
            old.term = term2
            old.leases["n1"] = {"holder": node_holder, "epoch": api(lead3, "/api/v1/nodes")[0]["lease"]["epoch"],
                                "held": True}
            async with old:
                with pytest.raises(StartRefused) as err:
                    await old.stop("n1", next(iter(pids)) + ".r0", grace_seconds=1)
            return str(err.value)

        refusal = asyncio.run(as_the_old_leader())
        assert f"term {term2}" in refusal and "no longer leads" in refusal, refusal
        answered_after = clients.answered
        wait_for(lambda: clients.answered >= answered_after + 40, 60, "clients answered after the stall")
    finally:
        clients.stop()
    assert clients.failures == [], clients.failures[:5]
    assert all(pid_alive(p) for ps in pids.values() for p in ps)

    # --- the ledger equals what the clients received ----------------------------------------
    for p in cluster["router_procs"]:  # SIGTERM: each sends its last usage batch before it exits
        stop(p, signal.SIGTERM)
    lead3 = admins[third]
    # A last batch can come before the controller's router read the tokens it counts: the usage
    # gate holds it until the next reading (issue 41), so the ledger is waited for, not read once.
    wanted = (clients.prompt_tokens, clients.completion_tokens, clients.answered)

    def ledger() -> tuple[int, int, int]:
        total = api(lead3, "/api/v1/usage?since=1000000000&by=model")["total"]
        return total["prompt_tokens"], total["completion_tokens"], total["requests"]

    try:
        wait_for(lambda: ledger() == wanted, 60, "the ledger equal to what the clients received")
    except AssertionError:
        # Says both, and what the gate holds or dropped and what the routers said of their usage.
        req = urllib.request.Request(lead3 + "/api/v1/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
        with urllib.request.urlopen(req, timeout=20) as r:
            gate = [line for line in r.read().decode().splitlines()
                    if line.startswith(("llmgw_controller_usage_held", "llmgw_controller_usage_unconfirmed"))]
        said = [line for i in range(len(cluster["router_procs"]))
                for line in (cluster["tmp"] / f"router{i}.log").read_text().splitlines() if "usage" in line]
        assert ledger() == wanted, (gate, said[-20:])
