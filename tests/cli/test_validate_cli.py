"""`llmgw validate` as an operator and a pre-commit hook use it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.catalog.corpus import BIG, SMALL, write_catalog
from tests.conftest import EXAMPLES, REPO_ROOT, git


def test_examples_validate_clean(run_cli) -> None:
    code, out = run_cli("validate", str(EXAMPLES))
    assert code == 0, out
    assert "8 models, 6 nodes, valid" in out


def test_problems_are_file_line_col_relative_to_the_given_path(tmp_path: Path, run_cli) -> None:
    write_catalog(tmp_path, {"models/big.yaml": BIG.replace("[small]", "[qwen-7b]")})
    code, out = run_cli("validate", str(tmp_path))
    assert code == 1
    assert out.splitlines() == [
        f'{tmp_path}/models/big.yaml:4:13: fallback "qwen-7b" is not in the catalog',
        "✗ 1 problem in 1 file",
    ]


def test_json_output_lists_every_problem(tmp_path: Path, run_cli) -> None:
    write_catalog(tmp_path, {
        "models/big.yaml": BIG.replace("engine: vllm", "engine: vlm"),
        "models/small.yaml": SMALL.replace("min: 1", "min: 5"),
    })
    code, out = run_cli("validate", str(tmp_path), "-o", "json")
    assert code == 1
    data = json.loads(out)
    assert data["ok"] is False
    assert [(p["file"], p["line"]) for p in data["problems"]] == [
        (f"{tmp_path}/models/big.yaml", 7),
        (f"{tmp_path}/models/small.yaml", 6),
    ]


def test_rev_reads_the_commit_not_the_working_tree(tmp_path: Path, run_cli) -> None:
    repo = tmp_path / "repo"
    write_catalog(repo / "catalog")
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "valid catalog")
    good = git(repo, "rev-parse", "HEAD")
    # Break the committed catalog in a second commit, then "fix" it only on disk.
    (repo / "catalog/models/big.yaml").write_text(BIG.replace("[small]", "[ghost]"))
    git(repo, "commit", "-qam", "point big at a ghost")
    (repo / "catalog/models/big.yaml").write_text(BIG)

    code, out = run_cli("validate", str(repo / "catalog"))
    assert code == 0, out  # the working tree is fine
    code, out = run_cli("validate", str(repo / "catalog"), "--rev", "HEAD")
    assert code == 1
    assert 'models/big.yaml:4:13: fallback "ghost" is not in the catalog' in out
    code, out = run_cli("validate", str(repo / "catalog"), "--rev", good, "-o", "json")
    assert code == 0, out
    assert json.loads(out)["revision"] == good


def test_unknown_revision_and_missing_directory_are_errors_not_tracebacks(tmp_path: Path, run_cli) -> None:
    code, out = run_cli("validate", str(tmp_path / "nope"))
    assert code == 1 and "not a directory" in out
    write_catalog(tmp_path)
    git(tmp_path, "init", "-q")
    code, out = run_cli("validate", str(tmp_path), "--rev", "deadbeef")
    assert code == 1 and "cannot read 'deadbeef'" in out


def test_console_script_runs_as_a_pre_commit_hook_would(tmp_path: Path) -> None:
    """The installed `llmgw` entry point, from the catalog repo's root, with no arguments."""
    write_catalog(tmp_path, {"models/small.yaml": SMALL.replace("gpus: 1", "gpus: one")})
    exe = Path(sys.executable).parent / "llmgw"
    proc = subprocess.run([str(exe), "validate"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "COLUMNS": "200"}, check=False)
    assert proc.returncode == 1
    assert 'models/small.yaml:12:5: profiles[0].gpus: expected an integer, got string "one"' in proc.stdout
    assert "Traceback" not in proc.stderr


def test_pre_commit_hook_is_declared() -> None:
    import yaml

    hooks = yaml.safe_load((REPO_ROOT / ".pre-commit-hooks.yaml").read_text())
    assert [h["id"] for h in hooks] == ["llmgw-validate"]
    assert hooks[0]["entry"].startswith("llmgw validate")
