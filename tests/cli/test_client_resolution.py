"""Where the CLI sends its admin token: URL and token from one source, against real HTTP servers.

Each server records the Authorization header of every request it gets, so a test can say
not only that the right server answered but that the wrong one never saw a token.
"""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest

from llmgw.admin.labels import confinement_label
from llmgw.cli.client import ApiError, resolve_client
from tests.cli.conftest import up_dir


def node(id_: str, confinement: object = ..., **over: object) -> dict:
    n = {"id": id_, "state": "ready", "gpu_free": 1, "gpu_total": 2, "gpu_classes": ["sim"], "disk_free_gb": 10.0,
         "disk_total_gb": 20.0, "replicas": 0, "agent_version": "0.1.0", "last_seen_seconds_ago": 1.0,
         "unhealthy_gpus": [], "error": None, **over}
    if confinement is not ...:  # ... : the field absent, as from a controller that predates it
        n["confinement"] = confinement
    return n


def test_data_dir_sends_its_token_only_to_its_own_server(run_cli, admin_server, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch, clean_env: Path) -> None:
    mine, other = admin_server("token-of-d"), admin_server("token-of-other")
    d = up_dir(tmp_path / "d", mine.url, "token-of-d")
    # Every other source points at the other server: none may lend it a URL for D's token.
    monkeypatch.setenv("LLMGW_ADMIN_URL", other.url)
    monkeypatch.setenv("LLMGW_ADMIN_TOKEN", "token-of-other")
    up_dir(clean_env, other.url, "token-of-other")

    code, out = run_cli("status", "--data-dir", str(d))
    assert code == 0, out
    assert "sync      synced" in out
    assert mine.authorizations == ["Bearer token-of-d"]

    # --url alone only checks where D's `up` is; naming another server is refused before any request.
    code, out = run_cli("status", "--data-dir", str(d), "--url", other.url)
    assert code == 1
    assert f"{other.url} was given without a token" in out and f"belongs to {mine.url}" in out
    code, out = run_cli("status", "--data-dir", str(d), "--url", mine.url + "/")
    assert code == 0, out
    code, out = run_cli("nodes", "--data-dir", str(d), "--token", "token-of-other", "--url", other.url)
    assert code == 1 and "--token and --data-dir both name a token" in out

    assert mine.authorizations == ["Bearer token-of-d"] * 2
    assert other.seen == []  # the other server never received a request, let alone an Authorization header
    assert "token-of-d" not in out


def test_a_data_dir_without_a_recorded_url_is_an_error_not_a_guess(run_cli, tmp_path: Path) -> None:
    d = up_dir(tmp_path / "d", None, "token-of-d")
    code, out = run_cli("status", "--data-dir", str(d))
    assert code == 1
    assert f"{d} has an admin token but no admin.url: is `llmgw up --data-dir {d}` running?" in out
    code, out = run_cli("status", "--data-dir", str(tmp_path / "nothing"))
    assert code == 1 and "no admin.token there (not the data dir of a `llmgw up`)" in out


def test_flags_come_as_a_pair(run_cli, admin_server) -> None:
    s = admin_server("t")
    code, out = run_cli("status", "--url", s.url, "--token", "t")
    assert code == 0, out
    code, out = run_cli("status", "--token", "t")
    assert code == 1 and "--token needs --url" in out
    # What is missing is the token, and the message says so (it once blamed `up`'s admin.url).
    code, out = run_cli("status", "--url", s.url)
    assert code == 1
    assert out.strip() == (f"error: --url {s.url} was given without a token: pass its token with --token, "
                           "or set LLMGW_ADMIN_TOKEN")
    code, out = run_cli("status")
    assert code == 1 and "no admin URL and token: pass --url and --token" in out
    assert s.authorizations == ["Bearer t"]
    code, out = run_cli("status", "--url", "file:///etc/passwd", "--token", "t")
    assert code == 1 and "is not an http:// or https:// address" in out
    code, out = run_cli("status", "--url", f"http://u:p@{s.url[7:]}", "--token", "t")
    assert code == 1 and "no credentials or query in it" in out and "u:p" not in out


def test_environment_comes_as_a_pair(run_cli, admin_server, monkeypatch: pytest.MonkeyPatch,
                                     clean_env: Path) -> None:
    env, local = admin_server("env-token"), admin_server("local-token")
    up_dir(clean_env, local.url, "local-token")
    monkeypatch.setenv("LLMGW_ADMIN_TOKEN", "env-token")
    # Half of the environment does not borrow the other half from the default data dir.
    code, out = run_cli("status")
    assert code == 1 and "LLMGW_ADMIN_TOKEN is set but LLMGW_ADMIN_URL is not" in out
    monkeypatch.setenv("LLMGW_ADMIN_URL", env.url)
    code, out = run_cli("status")
    assert code == 0, out
    code, out = run_cli("status", "--url", local.url)
    assert code == 1 and "($LLMGW_ADMIN_TOKEN) belongs to " + env.url in out
    assert env.authorizations == ["Bearer env-token"] and local.seen == []

    monkeypatch.delenv("LLMGW_ADMIN_TOKEN")
    monkeypatch.delenv("LLMGW_ADMIN_URL")
    code, out = run_cli("status")  # nothing given: the default `up`, URL and token both
    assert code == 0, out
    assert local.authorizations == ["Bearer local-token"] and env.authorizations == ["Bearer env-token"]


def test_url_without_a_token_blames_the_missing_token(run_cli, admin_server, clean_env: Path) -> None:
    """The report: `status --url X` on a machine where an `up` once ran (its data dir keeps the token,
    not the URL) said the data dir had no admin.url, which was not what was missing."""
    s = admin_server("t")
    up_dir(clean_env, None, "stale-up-token")
    code, out = run_cli("status", "--url", s.url)
    assert code == 1
    assert out.strip() == (f"error: --url {s.url} was given without a token: pass its token with --token, "
                           "or set LLMGW_ADMIN_TOKEN")
    assert s.seen == []


def test_url_flag_with_the_token_in_the_environment(run_cli, admin_server, monkeypatch: pytest.MonkeyPatch,
                                                    clean_env: Path) -> None:
    """CI and services keep the token out of `ps`: `LLMGW_ADMIN_TOKEN=… llmgw CMD --url U` sends it to U.
    The environment's token goes with the --url given when the environment names no address itself."""
    s, local = admin_server("env-token"), admin_server("local-token")
    up_dir(clean_env, local.url, "local-token")
    monkeypatch.setenv("LLMGW_ADMIN_TOKEN", "env-token")
    code, out = run_cli("status", "--url", s.url)
    assert code == 0, out
    assert s.authorizations == ["Bearer env-token"] and local.seen == []
    code, out = run_cli("status")  # no address at all: the token is not sent to `up`'s
    assert code == 1
    assert out.strip() == ("error: LLMGW_ADMIN_TOKEN is set but LLMGW_ADMIN_URL is not: set both, or pass the "
                           "controller's address with --url")
    monkeypatch.delenv("LLMGW_ADMIN_TOKEN")
    monkeypatch.setenv("LLMGW_ADMIN_URL", s.url)
    code, out = run_cli("status", "--url", s.url)  # an address twice, a token nowhere
    assert code == 1 and f"--url {s.url} was given without a token" in out
    code, out = run_cli("status")
    assert code == 1 and "LLMGW_ADMIN_URL is set but LLMGW_ADMIN_TOKEN is not: set both, or pass --url and " \
                         "--token" in out
    assert s.authorizations == ["Bearer env-token"] and local.seen == []


def test_a_redirect_is_not_followed_with_the_token(run_cli, admin_server) -> None:
    target = admin_server("t")
    bouncer = admin_server("t", redirect_to=target.url)
    code, out = run_cli("status", "--url", bouncer.url, "--token", "t")
    assert code == 1 and f"HTTP 302 from {bouncer.url}/api/v1/summary" in out
    assert target.seen == []


def test_the_token_is_in_no_message_and_no_repr(run_cli, admin_server, tmp_path: Path) -> None:
    s = admin_server("right")
    d = up_dir(tmp_path / "d", s.url, "wrong-secret")
    code, out = run_cli("status", "--data-dir", str(d))
    assert code == 1
    assert out.strip() == f"error: the controller at {s.url} refused the admin token from {d / 'admin.token'}"
    client = resolve_client(None, None, str(d))
    assert "wrong-secret" not in repr(client)
    with pytest.raises(ApiError) as e:
        resolve_client(None, "wrong-secret", str(d))
    assert "wrong-secret" not in str(e.value)


def test_nodes_show_confinement_and_json_passes_it_through(run_cli, admin_server) -> None:
    bwrap = {"user": "nobody", "sandbox": "bwrap", "detail": "bwrap 0.8.0, user namespace"}
    s = admin_server("t", nodes=[
        node("boxed", bwrap), node("plain", {"user": "llmgw", "sandbox": "none", "detail": "no bwrap"}),
        node("rooted", {"user": "root", "sandbox": "none", "detail": "agent runs as root", "problem": None}),
        node("refusing", {"user": "nobody", "sandbox": "none", "detail": "", "problem": "bwrap is required"},
             error="unreachable once"),
        node("silent", None), node("old")])
    code, out = run_cli("nodes", "--url", s.url, "--token", "t")
    assert code == 0, out
    assert "CONFINEMENT" in out.splitlines()[2]
    cells = [[c.strip() for c in line.split("│")] for line in out.splitlines() if line.startswith("│")]
    rows = {c[1]: (c[8], c[10]) for c in cells}
    assert rows == {"boxed": ("bwrap as nobody", ""), "plain": ("user llmgw", ""), "rooted": ("root!", ""),
                    "refusing": ("user nobody", "unreachable once; refuses starts: bwrap is required"),
                    "silent": ("unknown", ""), "old": ("unknown", "")}
    code, out = run_cli("nodes", "--url", s.url, "--token", "t", "-o", "json")
    data = {n["id"]: n for n in json.loads(out)}
    assert data["boxed"]["confinement"] == bwrap and data["silent"]["confinement"] is None
    assert "confinement" not in data["old"]


def test_confinement_labels() -> None:
    assert confinement_label({"user": "root", "sandbox": "bwrap", "detail": ""}) == "bwrap as root!"
    assert confinement_label({"user": "nobody"}) == "user nobody"
    assert confinement_label({"sandbox": "bwrap"}) == "unknown"
    assert confinement_label("garbage") == "unknown"  # type: ignore[arg-type]


@pytest.mark.slow
def test_llmgw_up_records_its_url_and_status_finds_it(tmp_path: Path) -> None:
    from tests.e2e.processes import LLMGW, free_port, start, stop, wait_for

    data, log = tmp_path / "state", tmp_path / "up.log"
    admin_port = free_port()
    proc = start(["up", "--data-dir", str(data), "--router-port", str(free_port()), "--admin-port",
                  str(admin_port)], log)
    try:
        wait_for(lambda: "Ctrl-C stops everything" in log.read_text(), 60, "llmgw up printed its welcome", proc)
        assert (data / "admin.url").read_text() == f"http://127.0.0.1:{admin_port}\n"
        # The very command `up` prints, with no --url: the recorded address, not a default port.
        status = subprocess.run([LLMGW, "status", "--data-dir", str(data)], capture_output=True, text=True,
                                timeout=60, check=False)
        assert status.returncode == 0, status.stdout + status.stderr
        assert f"(main of {data}/catalog)" in status.stdout  # this `up`'s controller answered
        token = (data / "admin.token").read_text().strip()
        text = log.read_text()
        # Output to a log file, not a terminal: the dashboard line says where the token is instead.
        assert token not in text
        assert f"dashboard  http://127.0.0.1:{admin_port}/   (first visit: add ?token= and the token in " \
               f"{data}/admin.token)" in text
    finally:
        assert stop(proc, signal.SIGINT, timeout=60) == 0
    assert not (data / "admin.url").exists()  # a stopped `up`'s port may be someone else's next


def test_admin_url_left_by_a_killed_up_is_not_trusted(run_cli, admin_server, tmp_path: Path,
                                                       clean_env: Path) -> None:
    """`up` killed with -9 leaves admin.url; whoever listens on that port next must not get the token."""
    stranger = admin_server("token-of-d")  # answers as the dead `up` would: only the URL tells them apart
    d = up_dir(tmp_path / "d", stranger.url, "token-of-d", running=False)
    code, out = run_cli("status", "--data-dir", str(d))
    assert code == 1
    assert f"no llmgw up is running with data dir {d} (admin.url is left from one that died)" in out
    up_dir(clean_env, stranger.url, "token-of-d", running=False)
    code, out = run_cli("status")
    assert code == 1 and f"no llmgw up is running with data dir {clean_env}" in out
    assert stranger.seen == []
