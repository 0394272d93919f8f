"""Where llmgw keeps its state by default (no imports beyond the standard library: the CLI's
start-up time depends on it)."""

from __future__ import annotations

import os
from pathlib import Path


def default_data_dir() -> Path:
    """The user's state directory (XDG), where `llmgw up` keeps its repository and database."""
    return Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "llmgw"
