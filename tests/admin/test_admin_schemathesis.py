"""schemathesis against the admin API's OpenAPI document, on a controller of its own.

Its own module (and so its own controller): the fuzzer may remove models, cordon nodes
and push commits, which must not leak into the other admin tests.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.admin.conftest import TOKEN, Running

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # ~30 s on a busy box: the default 60 s is near


def test_schemathesis_finds_no_server_error_or_schema_violation(running: Running, tmp_path: Path) -> None:
    exe = Path(sys.executable).parent / "schemathesis"
    proc = subprocess.run(
        [str(exe), "run", running.url + "/api/v1/openapi.json", "-H", f"Authorization: Bearer {TOKEN}",
         "--checks", "not_a_server_error,status_code_conformance,content_type_conformance,"
         "response_schema_conformance", "--phases", "examples,coverage,fuzzing", "--max-examples", "15",
         "--exclude-path", "/api/v1/hooks/git", "--exclude-path", "/api/v1/router/watch",
         "--request-timeout", "20", "--workers", "1",
         "--generation-deterministic", "--no-color"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]


