"""The skip guard (tests/fixtures/skips.py): a skip not on the allow-list fails a CI run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO_ROOT
from tests.fixtures.skips import ALLOWED_FILE, allowed_reasons

SUITE = '''
import pytest

def test_runs():
    pass

def test_skips_for_a_gpu():
    pytest.skip("this machine has nvidia-smi: the walkthrough declares its GPUs")

{extra}
'''


def run(tmp_path: Path, extra: str, *, ci: bool) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_suite.py").write_text(SUITE.format(extra=extra))
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "LLMGW_NO_SKIPS", "PYTEST_ADDOPTS")}
    if ci:
        env["CI"] = "true"
    env["PYTHONPATH"] = str(REPO_ROOT)
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # the suite's plugins (schemathesis, hypothesis) cost seconds each run
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", os.devnull,
                           "--rootdir", str(tmp_path), "-p", "tests.fixtures.skips", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=120, check=False)


def test_an_allowed_skip_passes_ci(tmp_path: Path) -> None:
    proc = run(tmp_path, "", ci=True)
    assert proc.returncode == 0, proc.stdout
    assert "1 passed, 1 skipped" in proc.stdout


def test_a_skip_not_on_the_list_fails_ci_and_is_named(tmp_path: Path) -> None:
    extra = "def test_needs_a_tool():\n    pytest.skip('wrk is not installed')\n"
    proc = run(tmp_path, extra, ci=True)
    assert proc.returncode == 1, proc.stdout
    assert "test_suite.py::test_needs_a_tool: wrk is not installed" in proc.stdout
    assert "test_skips_for_a_gpu" not in proc.stdout.split("skips_allowed.yaml")[-1]


def test_outside_ci_the_same_skip_is_listed_but_does_not_fail(tmp_path: Path) -> None:
    extra = "@pytest.mark.skipif(True, reason='redis-server is not installed')\ndef test_redis():\n    pass\n"
    proc = run(tmp_path, extra, ci=False)
    assert proc.returncode == 0, proc.stdout
    assert "would fail CI" in proc.stdout and "test_redis: redis-server is not installed" in proc.stdout


def test_a_module_skipped_at_collection_fails_ci(tmp_path: Path) -> None:
    proc = run(tmp_path, "pytest.importorskip('llmgw_no_such_module')", ci=True)
    assert proc.returncode == 1, proc.stdout
    assert "llmgw_no_such_module" in proc.stdout


def test_every_allowed_skip_says_why() -> None:
    assert allowed_reasons(ALLOWED_FILE)  # raises when an entry lacks `why`
