"""`llmgw diff` that cannot run still writes a document of the format asked for: CI posts the markdown
as a pull request comment (never an empty one), scripts read the JSON."""

from __future__ import annotations

import copy
import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw.catalog import read_directory, validate_files
from llmgw.plan.render import MARKDOWN_LIMIT, render_error_markdown
from tests.conftest import git
from tests.plan.scenarios import BASE, FIXED_DATES, fleet


def test_an_error_is_a_markdown_comment_the_message_cannot_break_out_of() -> None:
    message = "models/x.yaml: ```` is not a name"
    text = render_error_markdown(message)
    assert text == f"### :x: llmgw diff could not run\n\n`````text\n{message}\n`````\n"
    huge = render_error_markdown("x" * (2 * MARKDOWN_LIMIT))
    assert len(huge) <= MARKDOWN_LIMIT and huge.endswith("\n…\n```\n")


def test_each_format_says_what_went_wrong(run_cli, tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    code, out = run_cli("diff", "--repo", str(missing), "--format", "markdown")
    assert code == 1 and out.startswith("### :x: llmgw diff could not run\n\n```text\n") and str(missing) in out
    code, out = run_cli("diff", "--repo", str(missing), "--format", "json")
    assert code == 1 and str(missing) in json.loads(out)["error"]
    code, out = run_cli("diff", "--repo", str(missing))
    assert code == 1 and out.startswith("error: ") and str(missing) in out


@pytest.fixture(scope="module")
def planned(tmp_path_factory) -> tuple[Path, dict]:
    """A committed catalog and the fleet that runs it, as `llmgw inventory export` writes it."""
    repo = tmp_path_factory.mktemp("snap") / "catalog"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main", env=FIXED_DATES)
    for rel, text in BASE.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "base", env=FIXED_DATES)
    catalog = validate_files(read_directory(repo)).catalog
    assert catalog is not None
    return repo, fleet(catalog).to_json()


def _paths(x: object, p: tuple = ()) -> Iterator[tuple]:
    yield p
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _paths(v, (*p, k))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _paths(v, (*p, i))


@pytest.mark.slow
@pytest.mark.timeout(600)  # ~700 runs of diff, each reading git: a minute alone, more on a busy box
def test_a_malformed_snapshot_is_an_error_naming_the_file_never_a_traceback(run_cli, planned, tmp_path: Path) -> None:
    """Every value (leaf or container) of a real snapshot replaced by each hostile one in turn."""
    repo, base = planned
    snap = tmp_path / "fleet.json"
    code, out = run_cli("diff", "HEAD", "HEAD", "--repo", str(repo), "--snapshot", str(snap))
    assert code == 1 and f"--snapshot {snap}: cannot read it" in out
    for text in ("", "   \n", "{", "[1]"):
        snap.write_text(text)
        code, out = run_cli("diff", "HEAD", "HEAD", "--repo", str(repo), "--snapshot", str(snap))
        assert code == 1 and f"--snapshot {snap}: " in out, (text, out)
    tried = 0
    for path in list(_paths(base))[1:]:
        for value in ("```\n## injected @octocat", 5, None, [], {}, -1.5, True):
            data = copy.deepcopy(base)
            *parents, last = path
            at = data
            for k in parents:
                at = at[k]
            at[last] = value
            snap.write_text(json.dumps(data))
            try:
                code, out = run_cli("diff", "HEAD", "HEAD", "--repo", str(repo), "--snapshot", str(snap),
                                    "--format", "markdown")
            except Exception as exc:  # noqa: BLE001 - the point: report which value escaped as a traceback
                pytest.fail(f"{'/'.join(map(str, path))} = {value!r}: {type(exc).__name__}: {exc}")
            tried += 1
            if code == 1:
                assert "llmgw diff could not run" in out and f"--snapshot {snap}: " in out, out
            else:
                assert code in (0, 2), out  # a value the plan takes (an unknown extra, a null error)
    assert tried > 500


def test_a_controller_url_from_the_environment_is_named_not_published(run_cli, planned, admin_server,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """In CI $LLMGW_ADMIN_URL is a secret and the comment is public: messages name the variable."""
    repo, _ = planned
    server = admin_server("the-right-token")
    monkeypatch.setenv("LLMGW_ADMIN_URL", server.url)
    monkeypatch.setenv("LLMGW_ADMIN_TOKEN", "a-wrong-token")
    for fmt in ("markdown", "text", "json"):
        code, out = run_cli("diff", "HEAD", "HEAD", "--repo", str(repo), "--format", fmt)
        assert code == 1 and "the controller at $LLMGW_ADMIN_URL refused the admin token" in out, out
        assert server.url.split("://")[1] not in out
    httpd_gone = f"http://127.0.0.1:{_closed_port()}"
    monkeypatch.setenv("LLMGW_ADMIN_URL", httpd_gone + "/")
    code, out = run_cli("diff", "HEAD", "HEAD", "--repo", str(repo), "--format", "markdown")
    assert code == 1 and "cannot reach the controller at $LLMGW_ADMIN_URL" in out and "127.0.0.1" not in out, out
    # Named with a flag, the address is the reader's own: it is shown.
    code, out = run_cli("diff", "HEAD", "HEAD", "--repo", str(repo), "--url", httpd_gone, "--token", "t")
    assert code == 1 and f"cannot reach the controller at {httpd_gone}" in out


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
