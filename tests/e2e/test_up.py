"""`llmgw up` as a newcomer runs it: a subprocess, no config, an answer in seconds."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import openai
import pytest

from tests.conftest import git
from tests.e2e.processes import LLMGW, free_port, start, stop, wait_for

NEW_MODEL = """\
name: sim-extra
aliases: [extra]
source: sim://extra
size_gb: 0.1
scaling: {min: 1, max: 1}
profiles:
  - name: sim
    engine: sim
    gpus: 0
    pool: local
"""


def processes_under(root: Path) -> list[int]:
    """Living processes whose command line or working directory lies under ``root``."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            cwd = os.readlink(d / "cwd")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and (str(root) in cmd or cwd.startswith(str(root))):
            found.append(int(d.name))
    return found


@pytest.mark.slow
@pytest.mark.timeout(300)  # ~12 s on a busy box; its waits allow 60 s each (the default timeout: 60)
def test_up_serves_applies_commits_and_stops_clean(tmp_path: Path) -> None:
    data = tmp_path / "state"
    router_port, admin_port = free_port(), free_port()
    log = tmp_path / "up.log"
    proc = start(["up", "--data-dir", str(data), "--router-port", str(router_port), "--admin-port",
                  str(admin_port)], log)
    try:
        text = wait_for(lambda: "Ctrl-C stops everything" in log.read_text() and log.read_text(), 60,
                        "llmgw up printed its welcome", proc)
        url = re.search(r"router\s+(http://\S+/v1)", text).group(1)
        assert url == f"http://127.0.0.1:{router_port}/v1"
        assert f"token in {data}/admin.token" in text and f"catalog    {data}/catalog" in text
        assert oct((data / "admin.token").stat().st_mode & 0o777) == "0o600"
        # The hint names a command that runs from anywhere: bare only when that is this llmgw on PATH.
        on_path = shutil.which("llmgw") and Path(shutil.which("llmgw")).resolve() == Path(LLMGW).resolve()
        assert f"{'llmgw' if on_path else LLMGW} status --data-dir {data}" in text

        client = openai.OpenAI(base_url=url, api_key="unused", timeout=10, max_retries=0)

        def answer(model: str) -> str | None:
            try:
                r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello"}])
            except openai.APIError:
                return None
            return r.choices[0].message.content

        assert wait_for(lambda: answer("gpt-4o-mini"), 60, "an answer from the sim model")

        # A commit in the catalog repository is applied live (the watcher sees it).
        repo = data / "catalog"
        (repo / "models" / "sim-extra.yaml").write_text(NEW_MODEL)
        git(repo, "add", "-A")
        git(repo, "commit", "-q", "-m", "Add sim-extra")
        assert wait_for(lambda: answer("extra"), 60, "the new model served")

        # The tour: `llmgw diff` in the repository plans an uncommitted edit against the live fleet,
        # and the operator commands find the token of this `up` by themselves.
        (repo / "models" / "sim-more.yaml").write_text(NEW_MODEL.replace("sim-extra", "sim-more").replace(
            "[extra]", "[more]").replace("sim://extra", "sim://more"))
        diff = subprocess.run([LLMGW, "diff", "--repo", str(repo)], capture_output=True, text=True, timeout=60,
                              check=False)
        assert diff.returncode == 2, diff.stdout + diff.stderr
        assert re.search(r"llmgw diff [0-9a-f]{12} → working tree", diff.stdout)
        assert "+ model sim-more" in diff.stdout and "(live fleet at http://127.0.0.1:" in diff.stdout
        assert "+ start   sim-more/sim on local" in diff.stdout
        # Models the local node can never hold are not this change's doing: shown apart, not counted.
        assert "Plan: 1 to start, 0 to stop, 0 unplaceable." in diff.stdout
        assert "still cannot be placed, as before this change: bge-large-en-v1.5 (1)" in diff.stdout
        (repo / "models" / "sim-more.yaml").unlink()
        status = subprocess.run([LLMGW, "status", "--data-dir", str(data), "--url", f"http://127.0.0.1:{admin_port}"],
                                capture_output=True, text=True, timeout=60, check=False)
        assert status.returncode == 0 and "sync      synced" in status.stdout, status.stdout + status.stderr
    finally:
        code = stop(proc, signal.SIGINT, timeout=60)
    assert code == 0, log.read_text()[-3000:]
    assert "stopped;" in log.read_text()
    # An engine's monitor writes the exit record the stop waits for, then ends: waited for too.
    wait_for(lambda: processes_under(data) == [], 30, "nothing left under the data dir")

    # Starting again comes back on the same state: the commit made above is still applied.
    log2 = tmp_path / "up2.log"
    proc = start(["up", "--data-dir", str(data), "--router-port", str(router_port), "--admin-port",
                  str(admin_port)], log2)
    try:
        wait_for(lambda: "Ctrl-C stops everything" in log2.read_text(), 60, "second start", proc)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{router_port}/v1", api_key="unused", timeout=10,
                               max_retries=0)

        def extra() -> str | None:
            try:
                return client.chat.completions.create(
                    model="extra", messages=[{"role": "user", "content": "hi"}]).choices[0].message.content
            except openai.APIError:
                return None

        wait_for(extra, 60, "sim-extra served after restart")
    finally:
        assert stop(proc, signal.SIGINT, timeout=60) == 0
    # An engine's monitor writes the exit record the stop waits for, then ends: waited for too.
    wait_for(lambda: processes_under(data) == [], 30, "nothing left under the data dir")


@pytest.mark.slow
def test_a_port_in_use_is_a_clear_error_naming_the_flag(tmp_path: Path) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        log = tmp_path / "up.log"
        proc = start(["up", "--data-dir", str(tmp_path / "s"), "--router-port", str(port), "--admin-port",
                      str(free_port())], log)
        assert proc.wait(60) == 1
    out = log.read_text()
    assert f"--router-port port {port} on 127.0.0.1 is already in use" in out
    assert "Traceback" not in out


def up_refuses(tmp_path: Path, *args: str, data_dir: str | Path | None = None) -> str:
    """Run `llmgw up` expecting a refusal before anything starts; its whole output.

    Run in ``tmp_path`` and in a session of its own: an `up` that starts after all (a bug) does
    so there, and is stopped with all it started."""
    data = str(tmp_path / "state") if data_dir is None else str(data_dir)
    proc = subprocess.Popen([LLMGW, "up", "--data-dir", data, *args], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        stop(proc, signal.SIGINT, timeout=60)
        raise AssertionError("llmgw up did not refuse: it started") from None
    assert proc.returncode != 0, out
    assert "Traceback" not in out and "llmgw is up" not in out, out
    return out


def a_catalog(tmp_path: Path, name: str, *, extra: str | None = None) -> Path:
    from tests.conftest import EXAMPLES

    catalog = tmp_path / name
    catalog.mkdir()
    for rel in ("llmgw.yaml", "nodes.yaml"):
        (catalog / rel).write_text((EXAMPLES / rel).read_text())
    (catalog / "models").mkdir()
    (catalog / "models" / "sim-chat.yaml").write_text((EXAMPLES / "models" / "sim-chat.yaml").read_text())
    if extra:
        (catalog / "models" / "sim-extra.yaml").write_text(extra)
    return catalog


@pytest.mark.parametrize(("args", "message"), [
    (["--catalog", "/nonexistent"], "error: --catalog /nonexistent: no such directory"),
    (["--catalog", ""], "error: --catalog: an empty path"),
    (["--catalog", "/etc/hostname"], "error: --catalog /etc/hostname: not a directory"),
    (["--catalog", "/tmp"], "error: --catalog /tmp: not a catalog directory (no nodes.yaml)"),
    (["--router-port", "70000"], "argument --router-port: 70000 is not a port to listen on (1-65535)"),
    (["--admin-port", "0"], "argument --admin-port: 0 is not a port to listen on (1-65535)"),
    (["--admin-port", "http"], "argument --admin-port: 'http' is not a port number"),
    (["--router-port", "18080", "--admin-port", "18080"],
     "error: --router-port and --admin-port are both 18080: each listener needs its own port"),
])
def test_an_option_up_cannot_honour_is_an_error_naming_it(tmp_path: Path, args: list[str], message: str) -> None:
    assert message in up_refuses(tmp_path, *args)
    assert not (tmp_path / "state").exists()  # refused before anything was made


def test_an_empty_or_unusable_data_dir_is_an_error_naming_it(tmp_path: Path) -> None:
    assert "error: --data-dir: an empty path" in up_refuses(tmp_path, data_dir="")
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    assert f"error: --data-dir {a_file}: not a directory" in up_refuses(tmp_path, data_dir=a_file)


def test_an_invalid_catalog_is_refused_with_its_problems_before_anything_starts(tmp_path: Path) -> None:
    catalog = a_catalog(tmp_path, "bad", extra="name: sim-extra\nsource: sim://extra\nsize_gb: -1\nprofiles: []\n")
    out = up_refuses(tmp_path, "--catalog", str(catalog))
    assert f"error: --catalog {catalog}: not a valid catalog (`llmgw validate {catalog}` shows every problem)" in out
    assert f"{catalog}/models/sim-extra.yaml:3:" in out, out
    assert not (tmp_path / "state").exists()

    no_local = a_catalog(tmp_path, "remote-only")
    nodes = (no_local / "nodes.yaml").read_text()
    (no_local / "nodes.yaml").write_text(nodes.replace("transport: local", "transport: ssh"))
    assert "nodes.yaml has no node with transport: local" in up_refuses(tmp_path, "--catalog", str(no_local))


def test_catalog_for_a_data_dir_started_from_other_files_is_an_error(tmp_path: Path) -> None:
    """The data dir's catalog once silently won over --catalog: `up` served what nobody asked for."""
    from llmgw.control.up import prepare

    first = a_catalog(tmp_path, "first")
    data = tmp_path / "state"
    prepare(data, catalog=first, router_port=18080, admin_port=18081)  # as `up --catalog first` does
    seeded = git(data / "catalog", "rev-parse", "HEAD")

    # The same files again: the same start, the data dir goes on from its own catalog.
    prepare(data, catalog=first, router_port=18080, admin_port=18081)
    prepare(data, catalog=data / "catalog", router_port=18080, admin_port=18081)
    assert git(data / "catalog", "rev-parse", "HEAD") == seeded

    other = a_catalog(tmp_path, "other", extra=NEW_MODEL)
    for catalog in (other, first):
        out = up_refuses(tmp_path, "--catalog", str(catalog), data_dir=data)
        assert f"error: --catalog {catalog}: the data dir {data} already has its catalog, {data}/catalog " \
               f"(started from {first}, with these files as they were then), and --catalog only starts a new " \
               "data dir" in out, out
        assert "add --data-dir with a new directory" in out
        (first / "models" / "sim-extra.yaml").write_text(NEW_MODEL)  # the second round: `first` was edited
    assert git(data / "catalog", "rev-parse", "HEAD") == seeded  # nothing replaced
