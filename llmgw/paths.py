"""Where llmgw keeps its state by default (no imports beyond the standard library: the CLI's
start-up time depends on it)."""

from __future__ import annotations

import os
from pathlib import Path


def default_data_dir() -> Path:
    """The user's state directory (XDG), where `llmgw up` keeps its repository and database."""
    return Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "llmgw"



def lock_held(directory: Path) -> bool:
    """Whether a process holds the controller lock of the data dir ``directory`` now: the flock on
    the directory itself that llmgw.control.datadir takes. Here, not there, because the router
    (which reads admin.url too) may not import llmgw.control; datadir's ``held_by_a_process``
    asks this.

    A probe, never a wait: a shared non-blocking flock fails only while someone holds the
    exclusive one. A directory that does not exist is held by nobody.
    """
    import fcntl  # here: this module is imported at every CLI start-up

    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops the shared probe lock at once
    return False
