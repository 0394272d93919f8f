"""Shared fixtures: real git repositories, and (from tests.fixtures) real sshd nodes."""

from __future__ import annotations

import asyncio
import inspect
import io
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from rich.console import Console

from llmgw.cli.main import main

pytest_plugins = ["tests.fixtures.sshd", "tests.fixtures.skips"]

REPO_ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = REPO_ROOT / "examples" / "catalog"

GIT_ENV = {
    "GIT_AUTHOR_NAME": "Test Operator",
    "GIT_AUTHOR_EMAIL": "operator@example.com",
    "GIT_COMMITTER_NAME": "Test Operator",
    "GIT_COMMITTER_EMAIL": "operator@example.com",
    "GIT_CONFIG_NOSYSTEM": "1",
    "HOME": "/nonexistent",
}


def git(cwd: Path, *args: str, env: dict[str, str] | None = None) -> str:
    """Run real git as a person would; returns stdout, raises with stderr on failure."""
    import os

    full_env = {**os.environ, **GIT_ENV, **(env or {})}
    proc = subprocess.run(
        ["git", *args], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=30, check=False
    )
    if proc.returncode != 0:
        raise AssertionError(f"git {' '.join(args)} failed: {proc.stderr}")
    return proc.stdout.strip()


def commit_files(repo: Path, files: dict[str, str | None], message: str, *, author: str | None = None) -> str:
    """Write (None: delete) files in a work tree and commit them as a person would; the new sha."""
    for rel, content in files.items():
        path = repo / rel
        if content is None:
            path.unlink()
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(content)
    git(repo, "add", "-A")
    extra = ["--author", author] if author else []
    git(repo, "commit", "-q", "--allow-empty", *extra, "-m", message)
    return git(repo, "rev-parse", "HEAD")


@pytest.fixture
def run_cli() -> Callable[..., tuple[int, str]]:
    """Run `llmgw ARGS` in-process, rendering rich output into a string."""

    def run(*args: str) -> tuple[int, str]:
        buf = io.StringIO()
        console = Console(file=buf, width=200, color_system=None, highlight=False, soft_wrap=True)
        code = main(list(args), console=console)
        return code, buf.getvalue()

    return run


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """Run ``async def`` tests in a fresh event loop (no pytest-asyncio needed)."""
    if not inspect.iscoroutinefunction(pyfuncitem.obj):
        return None
    names = pyfuncitem._fixtureinfo.argnames
    asyncio.run(pyfuncitem.obj(**{name: pyfuncitem.funcargs[name] for name in names}))
    return True
