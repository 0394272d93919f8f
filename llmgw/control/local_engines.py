"""The engines this machine has, for `llmgw up`'s local node: found where the project builds them
(scripts/build-llama-server, scripts/build-vllm-cpu), then on PATH.

Each comes with the directories an engine needs visible in the sandbox (DESIGN §4): its install
directory as a whole, so the shared libraries beside a binary and a venv's packages come with it
(seen: llama-server exposed alone exited 127 on its libllama.so, the reason buried at the end of
a 2,777-character message).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class FoundEngine:
    name: str  # the node's engine name (llama.cpp, vllm, sglang)
    executable: Path
    exposes: tuple[Path, ...]  # read-only in the sandbox
    env: tuple[tuple[str, str], ...] = ()  # what the node sets for it (engine_env)
    where: str = ""  # how it was found, in words


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llmgw"


def _newest(pattern: str, root: Path) -> Path | None:
    found = sorted(p for p in root.glob(pattern) if os.access(p, os.X_OK))
    return found[-1] if found else None


def _venv_root(executable: Path) -> list[Path]:
    """A venv's root and the Python it was made from (its pyvenv.cfg ``home``): a venv's python is
    a link to the base interpreter, which the sandbox must see too."""
    root = executable.resolve().parent.parent
    cfg = root / "pyvenv.cfg"
    out = [root]
    if cfg.is_file():
        for line in cfg.read_text(errors="replace").splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "home" and value.strip():
                out.append(Path(value.strip()).resolve().parent)
    return out


def _find(env: str, built: Path | None, command: str, script: str, root: Path) -> tuple[Path, str] | None:
    """An engine's executable and how it was found: named by ``env``, else built by ``script``
    into ``root``, else ``command`` on PATH."""
    named = os.environ.get(env)
    if named and Path(named).is_file():
        return Path(named), env
    if built is not None:
        return built, f"built by {script} in {root}"
    on_path = shutil.which(command)
    return (Path(on_path), "on PATH") if on_path else None


def llama_server() -> FoundEngine | None:
    root = Path(os.environ.get("LLMGW_LLAMA_CACHE") or cache_root() / "llama-server")
    found = _find("LLMGW_LLAMA_SERVER", _newest("*/bin/llama-server", root), "llama-server",
                  "scripts/build-llama-server", root)
    if found is None:
        return None
    exe, where = found
    return FoundEngine("llama.cpp", exe, install_prefix(exe), where=where)


def install_prefix(exe: Path) -> tuple[Path, ...]:
    """Where a binary's libraries are: <prefix>/bin/x with <prefix>/lib (the build's layout, and
    /usr/local's) exposes the prefix; never a system directory as a whole (those are visible)."""
    real = exe.resolve()
    prefix = real.parent.parent if real.parent.name == "bin" else real.parent
    return () if str(prefix) in ("/", "/usr", "/bin") else (prefix,)


def vllm() -> FoundEngine | None:
    root = Path(os.environ.get("LLMGW_VLLM_CACHE") or cache_root() / "vllm-cpu")
    # Only a build the script finished (it writes BUILT last): a stage or a half-built tree is not vLLM.
    built = next((exe for exe in sorted(root.glob("*/bin/vllm"), reverse=True)
                  if (exe.parent.parent / "BUILT").exists() and os.access(exe, os.X_OK)), None)
    found = _find("LLMGW_VLLM", built, "vllm", "scripts/build-vllm-cpu", root)
    if found is None:
        return None
    exe, where = found
    # The build's launcher sits in <build>/bin beside <build>/venv; a pip-installed vllm in its venv's bin.
    build = exe.resolve().parent.parent
    exposes = [build]
    venv = build / "venv" / "bin" / "python"
    exposes += _venv_root(venv) if venv.exists() else _venv_root(exe)
    # A small KV cache on the CPU: vLLM takes VLLM_CPU_KVCACHE_SPACE GiB up front (default 4).
    env_vars = (("VLLM_CPU_KVCACHE_SPACE", "1"),) if "vllm-cpu" in str(build) else ()
    return FoundEngine("vllm", exe, tuple(dict.fromkeys(p for p in exposes if str(p) not in ("/", "/usr"))),
                       env_vars, where)


def found_engines() -> dict[str, FoundEngine]:
    return {e.name: e for e in (llama_server(), vllm()) if e is not None}


def nvidia_gpus() -> int:
    """GPUs `nvidia-smi` reports here (0 where it is missing or does not answer in 10 s)."""
    import subprocess

    exe = shutil.which("nvidia-smi")
    if exe is None:
        return 0
    try:
        proc = subprocess.run([exe, "--query-gpu=index", "--format=csv,noheader"], capture_output=True,
                              stdin=subprocess.DEVNULL, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in proc.stdout.decode(errors="replace").splitlines() if line.strip()) \
        if proc.returncode == 0 else 0
