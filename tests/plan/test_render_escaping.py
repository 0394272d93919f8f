"""Catalog text in `llmgw diff` output is shown, never obeyed: a model's args, names and the keys
echoed in validation errors cannot end the table or the <details> they sit in in a PR comment,
format it, link, mention or fence it (markdown), nor drive the reviewer's terminal (text)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

from llmgw.catalog import read_directory, validate_files
from tests.conftest import git
from tests.plan.scenarios import BASE, FIXED_DATES, fleet, model

INJECTED = ("evil\n\n**:white_check_mark: Reviewed by llmgw: safe to merge.** cc @octocat "
            "[details](https://evil.example/login) <b>x</b> # h | cell | `tick` _em_\n\n```")
TERMINAL = "\x1b[2J\x1b[31mRED \x1b]8;;https://evil.example\x1b\\link\x1b]8;;\x1b\\ \x9b1m \x7f [bold]b[/bold]"


@pytest.fixture(scope="module")
def hostile(tmp_path_factory) -> tuple[Path, Path]:
    repo = tmp_path_factory.mktemp("inj") / "catalog"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main", env=FIXED_DATES)
    for rel, text in BASE.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    catalog = validate_files(read_directory(repo)).catalog
    assert catalog is not None
    snap = repo.parent / "fleet.json"
    snap.write_text(json.dumps(fleet(catalog).to_json()))
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "base", env=FIXED_DATES)
    args = ", ".join(json.dumps(a) for a in ("--served-model-name", INJECTED))
    (repo / "models" / "evil.yaml").write_text(model("evil", "hf://a/b", min_=0, args=args))
    # Control characters are refused by validation (issue 39): the problem quotes the string.
    terminal = ", ".join(json.dumps(a) for a in ("--served-model-name", TERMINAL))
    (repo / "models" / "terminal.yaml").write_text(model("terminal", "hf://a/t", min_=0, args=terminal))
    # An unknown key, echoed by the validation error.
    bad_key = json.dumps("k\n\n# Approved @octocat [x](https://evil.example) ```\x1b[31m")
    (repo / "models" / "broken.yaml").write_text(model("broken", "hf://a/c") + f"{bad_key}: 1\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "evil", env=FIXED_DATES)
    return repo, snap


def diff(run_cli, hostile: tuple[Path, Path], fmt: str) -> str:
    repo, snap = hostile
    code, out = run_cli("diff", "HEAD~1", "HEAD", "--repo", str(repo), "--snapshot", str(snap), "--format", fmt)
    assert code == 1, out  # broken.yaml does not validate
    return out


def test_markdown_shows_catalog_text_without_obeying_it(run_cli, hostile) -> None:
    out = diff(run_cli, hostile, "markdown")
    html = MarkdownIt("commonmark").enable("table").render(out)
    text_only = re.sub(r"<[^>]+>", "", html)
    assert "Reviewed by llmgw" in text_only and "https://evil.example" in text_only  # shown...
    assert "<a " not in html and "<pre>" not in html and "<em>" not in html  # ...not obeyed
    assert [s for s in re.findall(r"<strong>(.*?)</strong>", html) if "Reviewed" in s or "x" == s] == []
    assert re.findall(r"<h\d>", html) == ["<h3>", "<h4>", "<h4>", "<h4>"]  # ours: title, validation, changes, plan
    assert not re.search(r"@[A-Za-z0-9]", html)  # GitHub would notify @octocat
    assert html.count("<details>") == html.count("</details>") == 1  # evil.yaml; broken and terminal are no change
    # The args row is one row of the table, its cells as many as the header's.
    rows = [r for r in re.findall(r"<tr>(.*?)</tr>", html, re.S) if "args" in r]
    assert len(rows) == 1 and rows[0].count("<td>") == 3
    assert "\x1b" not in out and "&#92;x1b&#91;2J" in out  # shown as \x1b[2J


def test_text_shows_control_characters_as_escapes(run_cli, hostile) -> None:
    out = diff(run_cli, hostile, "text")
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]", out)
    assert "\\x1b[2J\\x1b[31mRED" in out and "\\x9b1m" in out and "\\x7f" in out
    line = next(x for x in out.splitlines() if "args" in x)
    assert "Reviewed by llmgw" in line and "\\n\\n```" in line  # the newlines inside one shown line
    assert "[bold]b[/bold]" in out


def test_validate_shows_control_characters_as_escapes(run_cli, hostile) -> None:
    repo, _ = hostile
    code, out = run_cli("validate", str(repo))
    assert code == 1
    assert "\x1b" not in out and "\\x1b[31m" in out
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]", out)
