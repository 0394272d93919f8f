"""A serving process's output cannot block or abort it (llmgw.stdio), on real pipes."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import textwrap

import pytest

from llmgw.stdio import Pump


def fill(write_fd: int) -> int:
    """Fill the pipe through a non-blocking open file of our own (the pump's stays blocking)."""
    filler = os.open(f"/proc/self/fd/{write_fd}", os.O_WRONLY | os.O_NONBLOCK)
    n = 0
    for size in (65536, 1):
        try:
            while True:
                n += os.write(filler, b"x" * size)
        except BlockingIOError:
            pass
    os.close(filler)
    return n


def read_until(fd: int, end: bytes) -> bytes:
    seen = b""
    while not seen.endswith(end):
        ready, _, _ = select.select([fd], [], [], 30)
        assert ready, f"nothing more to read after {seen[-300:]!r}"
        chunk = os.read(fd, 65536)
        assert chunk, f"the pipe closed after {seen[-300:]!r}"
        seen += chunk
    return seen


@pytest.mark.timeout(30)
def test_writes_to_a_full_pipe_return_at_once_and_what_did_not_fit_is_noted_in_place() -> None:
    r, w = os.pipe()
    filled = fill(w)
    pump = Pump(w, limit=1000)
    pump.put(b"a" * 600)
    pump.put(b"b" * 600)  # over the limit while nobody reads: dropped
    pump.put(b"b" * 500)
    pump.put(b"c" * 100 + b"\n")  # room again: kept, after the note
    assert not pump.drain(0.2)  # still waiting for the reader
    out = read_until(r, b"c" * 100 + b"\n")
    assert out[:filled] == b"x" * filled
    note = b"[llmgw: 2 writes (1100 bytes) of output dropped here: nothing was reading it]\n"
    assert out[filled:] == b"a" * 600 + note + b"c" * 100 + b"\n"
    assert pump.drain(10) and pump.failed is None
    os.close(r)
    os.close(w)


@pytest.mark.timeout(30)
def test_a_pipe_whose_reader_left_is_given_up_and_writes_never_raise() -> None:
    r, w = os.pipe()
    os.close(r)
    pump = Pump(w)
    pump.put(b"stopping\n")
    assert pump.drain(10)
    assert isinstance(pump.failed, BrokenPipeError)
    pump.put(b"stopped\n")  # nothing to do, nothing raised
    assert pump.drain(0)
    os.close(w)


CHILD = textwrap.dedent("""
    import logging, sys
    from rich.console import Console
    from llmgw.stdio import guard
    guard()
    logging.basicConfig(level="INFO", format="%(message)s")
    console = Console()
    for i in range({lines}):
        console.print(f"out {{i}}")
        logging.getLogger("t").info("err %d", i)
    console.print("done")
""")


def run_child(lines: int, **kwargs: object) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD.format(lines=lines)], **kwargs)  # type: ignore[call-overload]


@pytest.mark.timeout(60)
def test_a_guarded_process_writing_to_a_closed_pipe_ends_normally() -> None:
    r, w = os.pipe()
    os.close(r)
    child = run_child(1000, stdout=w, stderr=w)
    os.close(w)
    # rich would raise SystemExit(1) on the BrokenPipeError, Python's exit flush would make it 120.
    assert child.wait(30) == 0


@pytest.mark.timeout(60)
def test_a_guarded_process_writing_to_a_full_pipe_finishes_and_exits() -> None:
    r, w = os.pipe()
    fill(w)
    child = run_child(20000, stdout=w, stderr=w)  # ~300 KB, far more than a pipe holds
    os.close(w)
    assert child.wait(30) == 0  # unguarded, it blocks in its first write for as long as nobody reads
    os.close(r)


@pytest.mark.timeout(60)
def test_stdout_and_stderr_on_one_pipe_keep_their_order() -> None:
    child = subprocess.run([sys.executable, "-c", CHILD.format(lines=200)], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, timeout=30, check=True)
    expected = "".join(f"out {i}\nerr {i}\n" for i in range(200)) + "done\n"
    assert child.stdout.decode() == expected
