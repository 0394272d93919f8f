"""Where the command's output goes when it is piped: data on stdout, errors on stderr, and a reader
that leaves early (`| head -1`) ends the command quietly."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.conftest import REPO_ROOT

LLMGW = str(REPO_ROOT / ".venv" / "bin" / "llmgw")


def test_a_reader_that_left_ends_the_command_quietly() -> None:
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first byte: every write is EPIPE
    try:
        proc = subprocess.run([LLMGW, "validate", str(REPO_ROOT / "examples" / "catalog"), "-o", "json"],
                              stdout=write, stderr=subprocess.PIPE, text=True, timeout=120, check=False)
    finally:
        os.close(write)
    assert proc.stderr == ""  # no BrokenPipeError traceback, no "Exception ignored" at exit
    assert proc.returncode == 141  # as `git log | head`: killed by SIGPIPE, 128 + 13


def test_errors_go_to_stderr(tmp_path: Path) -> None:
    proc = subprocess.run([LLMGW, "validate", str(tmp_path / "nowhere")], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr.startswith("error: ") and "nowhere" in proc.stderr
