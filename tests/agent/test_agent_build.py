"""The node's single agent file is built from llmgw/agent/parts (DESIGN §4, issue 29).

A node runs one standard-library file that the controller uploads and checks by hash; the agent is
written as modules. These tests hold the two together: the committed file is exactly what the
build makes from the parts (nobody edits one without the other), the build is deterministic (the
hash a node reports only moves when the code does), the file the dispatcher uploads is that build,
and the built file runs with nothing around it but python3.
"""

from __future__ import annotations

import ast
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from llmgw.agent import build
from llmgw.dispatch.base import AGENT_PATH, local_agent
from tests.agent.helpers import AGENT, Node

# Imports a node may lack, each only inside a try that turns ImportError into a clear fetch failure.
OPTIONAL_IMPORTS = frozenset({"huggingface_hub"})


def test_committed_agent_file_is_what_the_parts_build() -> None:
    assert AGENT.read_text(encoding="utf-8") == build.build(), (
        "llmgw/agent/llmgw_agent.py differs from llmgw/agent/parts: edit the parts, then python -m llmgw.agent.build"
    )


def test_two_builds_give_the_same_bytes(tmp_path: Path) -> None:
    # A copy of the parts in another directory: the output depends on their text, not where they are.
    copy = tmp_path / "parts"
    shutil.copytree(build.PARTS_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    first = build.build().encode("utf-8")
    second = build.build(copy).encode("utf-8")
    assert hashlib.sha256(first).hexdigest() == hashlib.sha256(second).hexdigest()


def test_the_controller_uploads_the_built_file() -> None:
    assert AGENT_PATH == build.OUTPUT
    shipped = local_agent()
    built = build.build().encode("utf-8")
    assert shipped.data == built
    assert shipped.sha256 == hashlib.sha256(built).hexdigest()
    assert shipped.remote_name == f"llmgw_agent-{hashlib.sha256(built).hexdigest()[:12]}.py"


def test_build_check_flag_agrees_with_the_committed_file() -> None:
    result = subprocess.run([sys.executable, "-m", "llmgw.agent.build", "--check"], capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr


def _imports(tree: ast.AST) -> list[tuple[str, ast.Import | ast.ImportFrom]]:
    found: list[tuple[str, ast.Import | ast.ImportFrom]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name.split(".")[0], node) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"line {node.lineno}: a relative import cannot work in a single file"
            found.append(((node.module or "").split(".")[0], node))
    return found


def _guarded_by_import_error(tree: ast.Module, target: ast.AST) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(target is inner for stmt in node.body for inner in ast.walk(stmt)):
            names = [h.type for h in node.handlers if h.type is not None]
            if any(isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError") for n in names):
                return True
    return False


def test_built_file_imports_only_the_standard_library() -> None:
    tree = ast.parse(build.build())
    assert not any(module == "llmgw" for module, _ in _imports(tree)), "the node has no llmgw package"
    for module, node in _imports(tree):
        if module in sys.stdlib_module_names:
            continue
        assert module in OPTIONAL_IMPORTS, f"line {node.lineno}: {module!r} is not in the standard library"
        assert _guarded_by_import_error(tree, node), f"line {node.lineno}: {module!r} needs an ImportError guard"
    top = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert all(module in sys.stdlib_module_names or module == "__future__" for n in top for module, _ in _imports(n))


def test_a_part_importing_a_third_party_package_fails_the_build(tmp_path: Path) -> None:
    copy = tmp_path / "parts"
    shutil.copytree(build.PARTS_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    spawn = copy / "spawn.py"
    spawn.write_text(spawn.read_text(encoding="utf-8").replace("import os\n", "import os\n\nimport yaml\n", 1),
                     encoding="utf-8")
    with pytest.raises(build.BuildError, match=r"spawn\.py:\d+: imports 'yaml', which is not in the standard library"):
        build.build(copy)


def test_built_file_runs_alone_in_an_empty_directory(node: Node, tmp_path_factory: pytest.TempPathFactory) -> None:
    # No llmgw package, no tests, no PYTHONPATH, -I ignores the user's site: what a node has.
    empty = tmp_path_factory.mktemp("alone")
    alone = empty / "llmgw_agent.py"
    alone.write_text(build.build(), encoding="utf-8")
    env = {k: v for k, v in node.env().items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    result = subprocess.run([sys.executable, "-I", str(alone), "--config", str(node.config), "hello"], input=b"{}",
                            capture_output=True, cwd=empty, timeout=60, check=False, env=env)
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()
    answer = json.loads(result.stdout)
    assert answer["agent_sha256"] == hashlib.sha256(alone.read_bytes()).hexdigest() == local_agent().sha256
