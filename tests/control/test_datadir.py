"""One process per data dir: a second process is refused, naming the data dir and who holds it,
and a dead holder (kill -9 included) leaves nothing to clean up."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from llmgw.control.datadir import DataDirInUse, held_by_a_process, hold_data_dir, release_data_dir, succeed

TRY = ("import sys\nfrom llmgw.control.datadir import hold_data_dir, DataDirInUse\n"
       "try:\n    hold_data_dir(sys.argv[1])\nexcept DataDirInUse as exc:\n    print(exc)\n    sys.exit(1)\n"
       "print('held', flush=True)\nsys.stdin.read()\n")


def other_process(data: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", TRY, str(data)], input="", capture_output=True, text=True,
                          timeout=60, check=False)


def test_a_second_process_is_refused_with_the_data_dir_and_the_pid(tmp_path: Path) -> None:
    data = tmp_path / "data"
    fd = hold_data_dir(data)
    try:
        assert hold_data_dir(data) == fd  # this process again (the controller after the command line)
        out = other_process(data)
        assert out.returncode == 1, out.stderr
        assert f"data dir {data} is in use by another llmgw process (pid {os.getpid()})" in out.stdout
    finally:
        release_data_dir(data)
    assert other_process(data).returncode == 0


def test_a_holder_killed_with_sigkill_leaves_the_data_dir_free(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with subprocess.Popen([sys.executable, "-c", TRY, str(data)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True) as holder:
        try:
            assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
            assert f"(pid {holder.pid})" in other_process(data).stdout
        finally:
            holder.send_signal(signal.SIGKILL)
            holder.wait(30)
    assert other_process(data).returncode == 0  # no stale lock: the kernel dropped it


def test_a_lock_file_that_is_a_symlink_is_not_followed(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    target = tmp_path / "elsewhere"
    target.write_text("precious\n")
    (data / "llmgw.lock").symlink_to(target)
    with pytest.raises(Exception, match="cannot create its lock file") as err:
        hold_data_dir(data)
    assert not isinstance(err.value, DataDirInUse)
    assert target.read_text() == "precious\n"


def test_a_restart_on_the_same_data_dir_names_the_instance_it_replaces_and_a_copy_does_not(tmp_path: Path) -> None:
    data, copy = tmp_path / "data", tmp_path / "copy"
    hold_data_dir(data)
    try:
        assert succeed(data, "first") is None  # nothing ran here before
        assert succeed(data, "second") == "first"  # the lock is ours: "first" has ended
        shutil.copytree(data, copy, ignore=shutil.ignore_patterns("llmgw.lock"))
    finally:
        release_data_dir(data)
    hold_data_dir(copy)
    try:
        # A copy (a restored backup, one started by mistake) cannot know whether "second" still
        # runs: it names nobody, and the nodes fence it while "second" renews its leases.
        assert succeed(copy, "third") is None
        assert succeed(copy, "fourth") == "third"
    finally:
        release_data_dir(copy)
    with pytest.raises(RuntimeError, match="without the data dir's lock"):
        succeed(data, "fifth")


@pytest.mark.parametrize("how", ["unlinked", "renamed over"])
def test_removing_or_replacing_the_pid_file_does_not_let_a_second_process_in(tmp_path: Path, how: str) -> None:
    # An operator "cleaning a stale lock", or an rsync restore into the live data dir: the lock is
    # the directory's own, so the second process is refused all the same (it had run on the live
    # data dir, and the restart shortcut had handed it the live controller's nodes at once).
    data = tmp_path / "data"
    hold_data_dir(data)
    try:
        if how == "unlinked":
            (data / "llmgw.lock").unlink()
        else:
            (tmp_path / "restored").write_text("1\n")  # a backup's pid file, naming some old process
            (tmp_path / "restored").rename(data / "llmgw.lock")
        out = other_process(data)
        assert out.returncode == 1, out.stdout + out.stderr
        # The pid file is gone or replaced; the kernel still knows whom to name.
        assert f"data dir {data} is in use by another llmgw process (pid {os.getpid()})" in out.stdout
        assert held_by_a_process(data)
        assert succeed(data, "first") is None  # this process still holds it
    finally:
        release_data_dir(data)
    assert not held_by_a_process(data)
    assert other_process(data).returncode == 0


def test_held_by_a_process_tells_a_live_holder_from_a_dead_one(tmp_path: Path) -> None:
    data = tmp_path / "data"
    assert not held_by_a_process(data)  # no data dir at all
    assert not held_by_a_process(tmp_path / "a-file-not-a-dir.txt")
    with subprocess.Popen([sys.executable, "-c", TRY, str(data)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True) as holder:
        try:
            assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
            assert held_by_a_process(data)
            assert held_by_a_process(data / "llmgw.lock")  # named by its pid file, as the CLI knows it
        finally:
            holder.send_signal(signal.SIGKILL)
            holder.wait(30)
    assert not held_by_a_process(data)  # the kernel dropped it with the process
    assert other_process(data).returncode == 0  # and probing never took it
