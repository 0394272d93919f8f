"""A simulated engine as a real process, for tests and benchmarks of what sits above engines.

The router, the reconciler and the benchmarks need an engine that answers over real HTTP on a
real port, without GPUs; :class:`SimProcess` runs :mod:`llmgw.engines.sim` as a subprocess
(not in-process, so its event loop never competes with the code under test)::

    with SimProcess("sim-chat", "--tokens-per-second", "50") as sim:
        ... sim.endpoint ...   # http://127.0.0.1:<free port>

Constructing one starts nothing; :meth:`SimProcess.start` does, and returns once the port
accepts connections (the model may still be "loading" if ``--startup-delay`` was given).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

import llmgw

PACKAGE_ROOT = str(Path(llmgw.__file__).resolve().parent.parent)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class SimProcess:
    """One ``python -m llmgw.engines.sim`` process on ``host``:``port`` (a free port by default)."""

    def __init__(self, model: str, *args: str, host: str = "127.0.0.1", port: int | None = None) -> None:
        self.model = model
        self.args = args
        self.host = host
        self.port = port
        self._proc: subprocess.Popen[bytes] | None = None
        self._stderr: IO[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise RuntimeError("the simulator is not running")
        return self._proc.pid

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "llmgw.engines.sim", "--model", self.model, "--host", self.host,
                "--port", str(self.port), *self.args]

    def start(self, *, timeout: float = 60.0) -> SimProcess:  # a bound, not a speed: a busy machine
        """Start the process and wait until its port accepts connections; raises RuntimeError
        (with the process's stderr) if it exits or does not listen within ``timeout``."""
        if self.port is None:
            self.port = free_port(self.host)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
        self._stderr = tempfile.TemporaryFile()
        self._proc = subprocess.Popen(self.argv(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=self._stderr, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                break
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.02)
        output = self._read_stderr()
        self.stop()
        raise RuntimeError(f"simulator did not start listening on {self.endpoint}: {output}")

    def terminate(self) -> None:
        """Send SIGTERM (what the agent's ``stop`` sends) without waiting."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        if self._proc is None:
            raise RuntimeError("the simulator was never started")
        return self._proc.wait(timeout)

    def stop(self, *, timeout: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout``; idempotent."""
        if self._proc is not None:
            self.terminate()
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None

    def _read_stderr(self) -> str:
        if self._stderr is None:
            return ""
        self._stderr.seek(0)
        return self._stderr.read().decode("utf-8", "replace")[-4000:]

    def __enter__(self) -> SimProcess:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.stop()


class LlamaServers:
    """``count`` real ``llama-server`` processes of one model on free ports, each with one slot
    and ``threads`` threads (``extra`` args added), healthy once constructed; ``close()`` stops them.
    For tests and benchmarks where a real engine's caching matters (tests/e2e, bench/prefix_bench)."""

    def __init__(self, binary: Path, gguf: Path, logs: Path, *, count: int = 2, threads: int = 1,
                 extra: tuple[str, ...] = (), timeout: float = 60.0) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.urls: list[str] = []
        try:
            for _ in range(count):
                port = free_port()
                with (logs / f"llama-{port}.log").open("w") as log:
                    self.procs.append(subprocess.Popen(
                        [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                         "--threads", str(threads), "-np", "1", *extra], stdout=subprocess.DEVNULL, stderr=log))
                self.urls.append(f"http://127.0.0.1:{port}")
            deadline = time.monotonic() + timeout
            for url, proc in zip(self.urls, self.procs, strict=True):
                while not _healthy(url):
                    if proc.poll() is not None:
                        raise RuntimeError(f"llama-server exited ({proc.returncode}); its log is in {logs}")
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"llama-server did not become healthy in {timeout:g} s")
                    time.sleep(0.2)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


def _healthy(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False
