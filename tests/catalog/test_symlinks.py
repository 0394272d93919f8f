"""Review tools never follow a symlink out of the repository (issue 13).

A pull request that adds `models/x.yaml -> /home/runner/.token` must not get that file
printed by `llmgw validate` or by the `llmgw diff --format markdown` comment CI posts: the
entry is reported as a symlink at line 1, and neither its target nor the target's path shows.
"""

from __future__ import annotations

import html
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.catalog.corpus import SMALL, write_catalog
from tests.conftest import git

LEAK = "hunter2-LEAK-7c1e"
# Shaped so that, if it were followed, every layer would quote it: a schema error on the
# engine, an unknown key, and (read as a model) a name the diff would show as added.
SECRET = f"""\
name: {LEAK}
source: hf://org/{LEAK}
size_gb: 1
{LEAK}: token
profiles:
  - name: gpu
    engine: {LEAK}
    gpus: 1
"""
SECRETS_DIR = "runner-secrets"

RunCli = Callable[..., tuple[int, str]]


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    """A file outside the repository, as a token on a CI runner would be."""
    path = tmp_path / SECRETS_DIR / "token.yaml"
    path.parent.mkdir()
    path.write_text(SECRET)
    return path


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A valid catalog committed on main and tagged `base`."""
    path = write_catalog(tmp_path / "repo")
    git(path, "init", "-q", "-b", "main")
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", "Base catalog")
    git(path, "tag", "base")
    return path


def commit_all(repo: Path, message: str) -> None:
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)


def assert_refused(out: str, rel: str, *, what: str = "is a symbolic link") -> None:
    """``rel`` refused at line 1 in text, markdown or JSON output, with nothing of the target shown."""
    # Markdown escapes catalog text as HTML entities: what a reader of the comment sees is the
    # unescaped text, so that is what must name the file and must not hold the secret.
    out = html.unescape(out).replace("\u2060", "")
    assert LEAK not in out, out
    assert SECRETS_DIR not in out, out  # the link's target path is not printed either
    if out.startswith("{"):
        problems = json.loads(out)["problems"]
        assert any(p["file"] == rel and p["line"] == 1 and what in p["message"] for p in problems), out
    else:
        assert f"{rel}:1:1" in out and what in out, out


def run_every_way(run_cli: RunCli, repo: Path, rel: str) -> None:
    """The working tree (`validate DIR`) and the commit (`validate --rev`, `diff` in each format)."""
    code, out = run_cli("validate", str(repo))
    assert code == 1
    assert_refused(out, f"{repo}/{rel}")
    code, out = run_cli("validate", str(repo), "-o", "json")
    assert code == 1
    assert [(p["file"], p["line"]) for p in json.loads(out)["problems"]] == [(f"{repo}/{rel}", 1)]
    assert_refused(out, f"{repo}/{rel}")
    code, out = run_cli("validate", str(repo), "--rev", "HEAD")
    assert code == 1
    assert_refused(out, f"{repo}/{rel}")
    for fmt in ("markdown", "json", "text"):
        code, out = run_cli("diff", "base", "HEAD", "--repo", str(repo), "--format", fmt)
        assert code == 1, out
        assert_refused(out, rel)
    data = json.loads(run_cli("diff", "base", "HEAD", "--repo", str(repo), "--format", "json")[1])
    assert [(p["file"], p["line"]) for p in data["problems"]] == [(rel, 1)]
    # The refused file counts as unchanged, so the plan does not show a model removed.
    assert data["changes"] == []


def refused_in_tree_commit_and_diff(run_cli: RunCli, repo: Path, rel: str, *, rev_args: tuple[str, ...] = ()) -> str:
    """``rel`` refused by `validate DIR`, `validate --rev HEAD` and `diff` (markdown, json); the
    working tree's output is returned for the caller's own checks."""
    code, tree_out = run_cli("validate", str(repo))
    assert code == 1
    assert_refused(tree_out, f"{repo}/{rel}")
    code, out = run_cli("validate", str(repo), "--rev", "HEAD", *rev_args)
    assert code == 1
    assert_refused(out, f"{repo}/{rel}")
    for fmt in ("markdown", "json"):
        code, out = run_cli("diff", "base", "HEAD", "--repo", str(repo), "--format", fmt)
        assert code == 1, out
        assert_refused(out, rel)
    return tree_out


def test_model_file_symlinked_to_a_secret_outside(run_cli: RunCli, repo: Path, secret: Path) -> None:
    (repo / "models/x.yaml").symlink_to(secret)
    commit_all(repo, "Add x")
    run_every_way(run_cli, repo, "models/x.yaml")


def test_relative_target_climbing_out_of_the_repository(run_cli: RunCli, repo: Path, secret: Path) -> None:
    # Git stores no `..` path of its own, but a link's target may be one.
    (repo / "models/x.yaml").symlink_to(Path("../..") / SECRETS_DIR / secret.name)
    assert (repo / "models/x.yaml").resolve() == secret
    commit_all(repo, "Add x")
    run_every_way(run_cli, repo, "models/x.yaml")


def test_nodes_file_symlinked_outside(run_cli: RunCli, repo: Path, secret: Path) -> None:
    (repo / "nodes.yaml").unlink()
    (repo / "nodes.yaml").symlink_to(secret)
    commit_all(repo, "Nodes from elsewhere")
    out = refused_in_tree_commit_and_diff(run_cli, repo, "nodes.yaml")
    assert "missing" not in out  # refused, not silently absent


def test_models_directory_symlinked_outside(run_cli: RunCli, repo: Path, secret: Path) -> None:
    git(repo, "rm", "-q", "-r", "models")
    (repo / "models").symlink_to(secret.parent)
    commit_all(repo, "Models from elsewhere")
    refused_in_tree_commit_and_diff(run_cli, repo, "models", rev_args=("-o", "json"))
    data = json.loads(run_cli("diff", "base", "HEAD", "--repo", str(repo), "--format", "json")[1])
    # Every model under the broken directory counts as unchanged, not as removed.
    assert data["changes"] == []


def test_symlink_inside_the_repository_is_refused_too(run_cli: RunCli, repo: Path) -> None:
    # Harmless today, but one rule (no symlinks at all) is simpler to trust than "links that
    # stay inside", and the next commit can re-point an in-repo link at anything.
    (repo / "models/tiny.yaml").symlink_to("small.yaml")
    (repo / "copy.yaml").write_text((repo / "nodes.yaml").read_text())
    (repo / "nodes.yaml").unlink()
    (repo / "nodes.yaml").symlink_to("copy.yaml")
    commit_all(repo, "Links inside")
    code, out = run_cli("validate", str(repo))
    assert code == 1
    assert f"{repo}/models/tiny.yaml:1:1: is a symbolic link" in out
    assert f"{repo}/nodes.yaml:1:1: is a symbolic link" in out
    code, out = run_cli("diff", "base", "HEAD", "--repo", str(repo), "--format", "json")
    assert code == 1
    assert sorted((p["file"], p["line"]) for p in json.loads(out)["problems"]) == [
        ("models/tiny.yaml", 1), ("nodes.yaml", 1)]


@pytest.mark.timeout(20)
def test_fifo_in_models_is_an_error_and_does_not_hang(tmp_path: Path, repo: Path) -> None:
    """Through the installed console script, so a hang is a killed process, not a stuck test."""
    os.mkfifo(repo / "models/pipe.yaml")
    exe = str(Path(sys.executable).parent / "llmgw")
    env = {**os.environ, "COLUMNS": "200"}
    for argv in ([exe, "validate", str(repo)], [exe, "diff", "base", "--repo", str(repo), "--format", "markdown"]):
        proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=10, env=env, check=False)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert "Traceback" not in proc.stderr
        seen = html.unescape(proc.stdout)  # the markdown comment as its reader sees it
        assert "models/pipe.yaml:1:1" in seen and "is a named pipe (FIFO)" in seen


@pytest.mark.timeout(20)
def test_symlink_to_a_fifo_is_refused_without_opening_it(run_cli: RunCli, tmp_path: Path, repo: Path) -> None:
    os.mkfifo(tmp_path / "pipe")
    (repo / "models/x.yaml").symlink_to(tmp_path / "pipe")
    code, out = run_cli("validate", str(repo))
    assert code == 1
    assert f"{repo}/models/x.yaml:1:1: is a symbolic link" in out


def test_catalog_directory_that_is_a_symlink_out_is_not_read(run_cli: RunCli, repo: Path, secret: Path) -> None:
    # `--repo catalog` where the pull request made `catalog` a link to a directory elsewhere.
    write_catalog(secret.parent, {"models/small.yaml": SMALL.replace("small", LEAK)})
    (repo / "catalog").symlink_to(secret.parent)
    commit_all(repo, "Catalog from elsewhere")
    code, out = run_cli("diff", "base", "--repo", str(repo / "catalog"), "--format", "markdown")
    assert code == 1
    assert LEAK not in out and "resolves outside the repository" in out
    code, out = run_cli("validate", str(repo / "catalog"), "--rev", "HEAD")
    assert code == 1
    assert LEAK not in out and "resolves outside the repository" in out


def test_committed_catalog_directory_symlink_is_named(run_cli: RunCli, tmp_path: Path, secret: Path) -> None:
    """A commit whose catalog subdirectory is a link, judged from a clone where it is a real one."""
    repo = tmp_path / "mono"
    repo.mkdir()
    (repo / "catalog").symlink_to(secret.parent)
    git(repo, "init", "-q", "-b", "main")
    commit_all(repo, "Catalog as a link")
    (repo / "catalog").unlink()
    write_catalog(repo / "catalog")
    code, out = run_cli("validate", str(repo / "catalog"), "--rev", "HEAD")
    assert code == 1
    assert "catalog is a symbolic link" in out
    assert LEAK not in out and SECRETS_DIR not in out
