"""`llmgw keys` on a running `llmgw up`, as an operator uses it: a key made is printed once and
works at once, a revoked one stops at once, neither needs a restart, only hashes are kept, and a
tenant naming a key no one has is said (status, events) rather than accepted in silence."""

from __future__ import annotations

import json
import re
import sqlite3
import subprocess
import urllib.request
from pathlib import Path

import openai
import pytest

from tests.conftest import git
from tests.e2e.processes import LLMGW, free_port, start, stop, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([LLMGW, *args], capture_output=True, text=True, timeout=60, check=False,
                          env={"COLUMNS": "200", "PATH": "/usr/bin:/bin", "HOME": str(Path.home())})


def answer(url: str, key: str, model: str = "gpt-4o-mini") -> int:
    """The HTTP status of one chat request with ``key`` (200 when answered)."""
    client = openai.OpenAI(base_url=url, api_key=key, timeout=10, max_retries=0)
    try:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}])
        return 200
    except openai.APIStatusError as exc:
        return exc.status_code
    except openai.APIConnectionError:
        return 0  # not listening yet
    finally:
        client.close()


def test_keys_made_and_revoked_on_a_running_up_take_effect_without_a_restart(tmp_path: Path) -> None:
    data = tmp_path / "state"
    router_port, admin_port = free_port(), free_port()
    url = f"http://127.0.0.1:{router_port}/v1"
    args = ["up", "--data-dir", str(data), "--router-port", str(router_port), "--admin-port", str(admin_port)]
    up = start(args, tmp_path / "up.log")
    try:
        wait_for(lambda: answer(url, "anything") == 200, 60, "the open router answers", up)  # no keys: open
        made = cli("keys", "create", "team-a", "--models", "gpt-4o-mini", "--data-dir", str(data))
        assert made.returncode == 0, made.stdout + made.stderr
        key = re.search(r"^(llmgw-\S{40,})$", made.stdout, re.M).group(1)  # whole, on a line of its own
        assert "now needs a key" in made.stdout  # the router was open: the operator is told it closed
        assert answer(url, key) == 200
        assert answer(url, "anything") == 401
        assert answer(url, key, "sim-embed") in (403, 404)  # a model the key was not made for
        listed = json.loads(cli("keys", "list", "-o", "json", "--data-dir", str(data)).stdout)
        assert [(k["name"], k["models"], k["source"]) for k in listed] == [("team-a", ["gpt-4o-mini"], "store")]
        again = cli("keys", "create", "team-a", "--data-dir", str(data))
        assert again.returncode == 1 and "a key named 'team-a' exists" in again.stdout + again.stderr
        # Only the hash is kept: not the key in the store, the log or the events.
        db = sqlite3.connect(data / "controller" / "llmgw.db")
        rows = " ".join(r[0] for r in db.execute("SELECT record FROM api_keys"))
        db.close()
        assert key not in rows and "team-a" in rows
        events = cli("events", "-o", "json", "--data-dir", str(data)).stdout
        assert "API key team-a made by" in events and key not in events
        assert key not in (tmp_path / "up.log").read_text()

        # A tenant naming a key that exists nowhere is said, not accepted in silence.
        repo = data / "catalog"
        settings = (repo / "llmgw.yaml").read_text()
        (repo / "llmgw.yaml").write_text(settings + "\ntenants:\n  - name: search\n    keys: [team-a, ghost]\n"
                                         "    limits: {budget: {tokens: 100000, per: day}}\n")
        git(repo, "commit", "-qam", "Tenant search")
        status = wait_for(lambda: (s := cli("status", "--data-dir", str(data)).stdout) and "ghost" in s and s, 30,
                          "status names the missing key", up)
        assert 'tenant "search" names key "ghost", which no API key has' in status
        assert "team-a" not in status.split("warning", 1)[1]
        # The event is written by a catalog subscriber, after the catalog status reads is in place.
        wait_for(lambda: "tenant-key-missing" in cli("events", "-o", "json", "--data-dir", str(data)).stdout, 30,
                 "the tenant-key-missing event", up)

        # The tenant's budget: its size, what it used (per the ledger), what is left, when it resets.
        assert answer(url, key) == 200

        def budget() -> dict | None:
            usage = json.loads(cli("usage", "-o", "json", "--data-dir", str(data)).stdout)
            found = [b for b in usage.get("budgets", []) if b["tenant"] == "search"]
            return found[0] if found and found[0]["used"] else None

        b = wait_for(budget, 30, "the budget's use in llmgw usage", up)
        assert b["tokens"] == 100000 and b["per"] == "day" and b["left"] == 100000 - b["used"] and b["resets_at"]
        assert "budgets (this period)" in cli("usage", "--data-dir", str(data)).stdout
        # And on the dashboard (the admin token as a bearer header, as a program would send it).
        admin_url = (data / "admin.url").read_text().strip()
        req = urllib.request.Request(admin_url + "/", headers={
            "Authorization": "Bearer " + (data / "admin.token").read_text().strip()})
        with urllib.request.urlopen(req, timeout=30) as r:
            page = r.read().decode()
        assert '<table id="budgets">' in page and '<tr data-tenant="search">' in page
        assert "<td>100,000 per day</td>" in page  # its size, then what it used and what is left

        # A spent budget: each refusal is counted, in llmgw usage, its budgets table and the dashboard.
        (repo / "llmgw.yaml").write_text(settings + "\ntenants:\n  - name: search\n    keys: [team-a, ghost]\n"
                                         "    limits: {budget: {tokens: 1, per: day}}\n")
        git(repo, "commit", "-qam", "Search's budget spent")
        codes: list[int] = []
        # 400: a request that could never fit the budget (it reserves more than the whole of it).
        wait_for(lambda: codes.append(answer(url, key)) or codes[-1] in (400, 429), 30, "the budget refusing", up)
        codes += [answer(url, key) for _ in range(2)]
        refused = codes.count(400) + codes.count(429)
        assert set(codes[-3:]) <= {400, 429} and codes.count(200) + refused == len(codes), codes

        def counted() -> dict | None:
            usage = json.loads(cli("usage", "-o", "json", "--data-dir", str(data)).stdout)
            found = [b for b in usage.get("budgets", []) if b["tenant"] == "search" and b["refused"] == refused]
            return usage if found and usage["total"]["refused"] == refused else None

        wait_for(counted, 30, f"{refused} refusals in llmgw usage", up)
        table = cli("usage", "--data-dir", str(data)).stdout
        assert "REFUSED" in table
        with urllib.request.urlopen(req, timeout=30) as r:
            page = r.read().decode()
        assert f'<td class="refused">{refused}</td>' in page
        (repo / "llmgw.yaml").write_text(settings)  # no tenant again: the key's requests unlimited
        git(repo, "commit", "-qam", "No tenants")

        # A key made for a tenant, without a commit: its use is that tenant's in the ledger.
        made = cli("keys", "create", "lab-1", "--tenant", "research", "--data-dir", str(data))
        assert made.returncode == 0 and "tenant research" in made.stdout, made.stdout + made.stderr
        lab = re.search(r"^(llmgw-\S{40,})$", made.stdout, re.M).group(1)
        assert answer(url, lab) == 200
        listed = json.loads(cli("keys", "list", "-o", "json", "--data-dir", str(data)).stdout)
        assert {k["name"]: k["tenant"] for k in listed} == {"team-a": None, "lab-1": "research"}

        def research() -> int:
            usage = json.loads(cli("usage", "--by", "tenant,key", "-o", "json", "--data-dir", str(data)).stdout)
            return sum(r["requests"] for r in usage["rows"] if (r["tenant"], r["key"]) == ("research", "lab-1"))

        wait_for(lambda: research() == 1, 30, "lab-1's request counted as research's", up)
        bad = cli("keys", "create", "lab-2", "--tenant", "no tenant", "--data-dir", str(data))
        assert bad.returncode == 1 and "tenant 'no tenant'" in bad.stdout + bad.stderr
        assert cli("keys", "revoke", "lab-1", "--data-dir", str(data)).returncode == 0

        revoked = cli("keys", "revoke", "team-a", "--data-dir", str(data))
        assert revoked.returncode == 0, revoked.stdout + revoked.stderr
        assert answer(url, key) == 401
        # The last key revoked: the router stays closed (no keys would mean open to anyone).
        assert answer(url, "anything") == 401
        assert json.loads(cli("keys", "list", "-o", "json", "--data-dir", str(data)).stdout) == []
    finally:
        assert stop(up, timeout=60) == 0
    # The store keeps what was made across a restart: still closed, and a revoked name may be made again.
    up = start(args, tmp_path / "up2.log")
    try:
        wait_for(lambda: answer(url, "anything") == 401, 60, "still closed after a restart", up)
        made = cli("keys", "create", "team-a", "--data-dir", str(data))
        key_b = re.search(r"^(llmgw-\S{40,})$", made.stdout, re.M).group(1)
    finally:
        assert stop(up, timeout=60) == 0
    up = start(args, tmp_path / "up3.log")
    try:
        wait_for(lambda: answer(url, key_b) == 200, 60, "team-b's key after a restart", up)
        assert answer(url, "anything") == 401
    finally:
        assert stop(up, timeout=60) == 0


WELCOME_END = "Ctrl-C stops everything"


def test_up_makes_a_key_at_start_and_keeps_it_out_of_its_log(tmp_path: Path) -> None:
    """`llmgw up --key NAME`: the router takes keys from the start; writing to a log (not a
    terminal), the key goes to a file only the user reads and the welcome's examples read it there."""
    data = tmp_path / "state"
    router_port, admin_port = free_port(), free_port()
    url = f"http://127.0.0.1:{router_port}/v1"
    args = ["up", "--data-dir", str(data), "--router-port", str(router_port), "--admin-port", str(admin_port),
            "--key", "demo", "--tenant", "lab"]
    up = start(args, tmp_path / "up.log")
    try:
        # The welcome's last line: it is written line by line, and a read at its first missed the rest.
        wait_for(lambda: WELCOME_END in (tmp_path / "up.log").read_text(), 60, "the welcome", up)
        key_file = data / "demo.key"
        key = key_file.read_text().strip()
        assert key.startswith("llmgw-") and key_file.stat().st_mode & 0o777 == 0o600
        log = (tmp_path / "up.log").read_text()
        assert key not in log and f"api key    demo: in {key_file}" in log
        assert f'Authorization: Bearer $(cat {key_file})' in log
        assert wait_for(lambda: answer(url, key) == 200 or None, 60, "the key answered", up)
        assert answer(url, "anything") == 401
        listed = json.loads(cli("keys", "list", "-o", "json", "--data-dir", str(data)).stdout)
        assert [(k["name"], k["tenant"]) for k in listed] == [("demo", "lab")]
    finally:
        assert stop(up, timeout=60) == 0
    key_file.unlink()
    up = start(args, tmp_path / "up2.log")  # again: the key made before is kept, not made twice
    try:
        wait_for(lambda: WELCOME_END in (tmp_path / "up2.log").read_text(), 60, "the welcome", up)
        assert "API key demo exists (made earlier" in (tmp_path / "up2.log").read_text()
        assert not key_file.exists() and answer(url, key) == 200
    finally:
        assert stop(up, timeout=60) == 0
