"""Where llmgw keeps its state by default (no imports beyond the standard library: the CLI's
start-up time depends on it)."""

from __future__ import annotations

import os
from pathlib import Path


def default_data_dir() -> Path:
    """The user's state directory (XDG), where `llmgw up` keeps its repository and database."""
    return Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "llmgw"


LOCK_FILE = "llmgw.lock"  # llmgw.control.datadir's lock, probed here without importing it (the router may not)


def lock_held(directory: Path) -> bool:
    """Whether a process holds ``directory``'s controller lock (llmgw.control.datadir), now.

    A probe, never a wait: a shared non-blocking flock fails only while someone holds the
    exclusive one. Both the directory itself and its ``llmgw.lock`` file are probed, so the
    answer holds whichever of the two the controller locks. Nothing is created: a directory or
    lock file that does not exist is held by nobody.
    """
    import fcntl  # here: the module is imported at every CLI start-up

    for path, flags in ((directory, os.O_RDONLY | os.O_DIRECTORY),
                        (directory / LOCK_FILE, os.O_RDONLY | os.O_NOFOLLOW)):
        try:
            fd = os.open(path, flags | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return True
        finally:
            os.close(fd)  # closing drops the shared probe lock at once
    return False
