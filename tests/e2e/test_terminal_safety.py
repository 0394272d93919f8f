"""Nothing reaches the operator's terminal raw (issue 39): escape sequences from a commit's subject, a
catalog's strings, an engine's error or a node's report are shown as escapes by `llmgw status`,
`events`, `replicas` and `nodes`, and in the controller's log; validation refuses control
characters in any catalog string, at its file:line."""

from __future__ import annotations

import argparse
import io
import json
import subprocess
from pathlib import Path

import pytest
from rich.console import Console

from llmgw.catalog import RawFile, validate_files
from tests.conftest import git
from tests.e2e.processes import LLMGW, free_port, start, stop, wait_for

ESC = "\x1b"
OSC8_LINK = f"{ESC}]8;;https://evil.example/{ESC}\\click here{ESC}]8;;{ESC}\\"
ERASE = f"{ESC}[2K{ESC}[1A"
TITLE = f"{ESC}]0;pwned\x07"


def raw(name: str, text: str) -> RawFile:
    data = text.encode()
    return RawFile(name, data, len(data))


def test_validation_refuses_a_control_character_in_any_catalog_string_at_its_line() -> None:
    files = {"nodes.yaml": raw("nodes.yaml", "nodes:\n  - id: n1\n    address: 10.0.0.1\n"),
             "models/m.yaml": raw("models/m.yaml", "name: m\nsource: sim://m\nsize_gb: 1\nprofiles:\n"
                                  "  - name: p\n    engine: sim\n    gpus: 0\n"
                                  f"    args: [\"--x\", \"{ERASE.replace(ESC, chr(92) + 'e')}\"]\n")}
    result = validate_files(files)
    assert not result.ok
    [p] = [p for p in result.problems if "control character" in p.message]
    assert (p.file, p.line) == ("models/m.yaml", 8) and "U+001B" in p.message
    # A prompt's line breaks and tabs are text, not control: allowed.
    files["models/m.yaml"] = raw("models/m.yaml", "name: m\nsource: sim://m\nsize_gb: 1\nprofiles:\n"
                                 "  - name: p\n    engine: sim\n    gpus: 0\n    args: [\"a\\tb\\nc\"]\n")
    assert validate_files(files).ok


def render(command, data: object, **args: object) -> str:  # noqa: ANN001
    class Canned:
        def request(self, *_a: object, **_k: object) -> object:
            return data

    out = io.StringIO()
    ns = argparse.Namespace(output="table", follow=False, limit=100, interval=1.0, **args)
    command(ns, Canned(), Console(file=out, width=200, force_terminal=True, highlight=False))  # as make_console
    return out.getvalue()


def test_nodes_and_events_show_a_node_and_an_engine_text_as_escapes() -> None:
    from llmgw.cli.fleet import events, nodes

    node = {"id": "n1", "state": "ready", "gpu_free": 1, "gpu_total": 1, "gpu_classes": [f"h100{TITLE}"],
            "disk_free_gb": 1.0, "disk_total_gb": 2.0, "replicas": 0, "agent_version": f"1{ERASE}",
            "confinement": None, "last_seen_seconds_ago": 1.0, "unhealthy_gpus": [], "error": None}
    text = render(nodes, [node])
    assert "\x07" not in text and "]0;pwned" not in text.replace("\\x1b]0;pwned", "")
    assert "\\x1b]0;pwned\\x07" in text and "\\x1b[2K" in text
    event = {"id": 1, "time": 0.0, "kind": "replica-failed", "subject": "m-g1",
             "message": f"engine on n1 exited with code 1: unknown flag {ERASE}{OSC8_LINK}"}
    text = render(events, [event])
    assert "\\x1b]8;;https://evil.example/" in text
    assert f"{ESC}]8" not in text and f"{ESC}[2K" not in text


@pytest.mark.slow
def test_a_rejected_commits_subject_reaches_status_and_the_log_as_escapes(tmp_path: Path) -> None:
    data = tmp_path / "state"
    args = ["up", "--data-dir", str(data), "--router-port", str(free_port()), "--admin-port", str(free_port())]
    up = start(args, tmp_path / "up.log")
    try:
        wait_for(lambda: "Ctrl-C stops everything" in (tmp_path / "up.log").read_text(), 60, "llmgw up", up)
        repo = data / "catalog"
        (repo / "models" / "evil.yaml").write_text(
            "name: evil\nsource: sim://evil\nsize_gb: 0.1\nprofiles:\n  - {name: sim, engine: sim, gpus: 0, "
            f"pool: local, args: [\"{ERASE.replace(ESC, chr(92) + 'e')}\"]}}\n")
        git(repo, "add", "-A")
        git(repo, "commit", "-qm", f"Harmless {OSC8_LINK} {ERASE}")

        def status() -> str | None:
            done = subprocess.run([LLMGW, "status", "--data-dir", str(data)], capture_output=True, text=True,
                                  timeout=60, check=False, env={"COLUMNS": "200", "FORCE_COLOR": "1"})
            return done.stdout if "rejected" in done.stdout else None

        text = wait_for(status, 30, "the commit rejected", up)
        assert "control character U+001B" in text
        assert "\\x1b]8;;https://evil.example/" in text and "\\x1b[2K" in text
        assert f"{ESC}]8" not in text and f"{ESC}[2K" not in text  # colour codes only: no link, no erase
        events = subprocess.run([LLMGW, "events", "--data-dir", str(data)], capture_output=True, text=True,
                                timeout=60, check=False, env={"COLUMNS": "200"}).stdout
        assert ESC not in events
        assert json.loads(subprocess.run([LLMGW, "status", "-o", "json", "--data-dir", str(data)], capture_output=True,
                                         text=True, timeout=60, check=True).stdout)["sync"]["rejected"]
    finally:
        assert stop(up, timeout=60) == 0
    assert f"{ESC}]8" not in (tmp_path / "up.log").read_text()
