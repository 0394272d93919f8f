"""Time an inventory fan-out over 16 real sshd nodes: llmgw's SSH dispatcher against Ansible ad-hoc.

Both sides ask every node's agent for its inventory, over real OpenSSH ``sshd`` processes on
127.0.0.2–17 (the test fixture's code, used as a library), in the same run:

- llmgw: ``SshDispatcher.inventory`` on all 16 nodes at once. The first fan-out includes the
  connects, the agent upload over SFTP and ``hello``; warm fan-outs are one line each way on the
  channel each node's ``serve`` agent keeps open.
- Ansible (the peer, PEERS.md): ``ansible all -m command -a "python3 <agent> inventory"`` with
  forks=16, pipelining, ControlMaster/ControlPersist and strict host key checking against the
  same known_hosts; the first run opens the control masters, warm runs reuse them. ``-m raw`` is
  timed too, as the cheapest thing Ansible can do per host.

Both sides are measured in rounds (after one cold run each), the order rotated each round; the
speedup is the median of per-round ratios. Goal: a warm fan-out at least 30x faster than
Ansible's warm ``-m command``.

    python bench/ssh_fanout_bench.py [--quick] [--nodes 16]

Ansible is installed with pip in its own virtual environment (``/tmp/llmgw-bench-ansible``,
reused when present). The last line of output is one JSON object (DESIGN §8); exit status 1
when the goal is not met (or Ansible could not be measured).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from llmgw.dispatch.base import AGENT_PATH  # noqa: E402
from llmgw.dispatch.ssh import SshDispatcher  # noqa: E402
from tests.fixtures.sshd_fleet import SshdEnvironment, SshdFleet  # noqa: E402

ANSIBLE_VENV = Path(os.environ.get("LLMGW_BENCH_ANSIBLE_VENV", "/tmp/llmgw-bench-ansible"))
GOAL = "warm fan-out >= 30x faster than Ansible ad-hoc"
TARGET_SPEEDUP = 30.0
# The system interpreter on both sides: on this machine ``python3`` on a login PATH can be a
# pyenv shim (a shell script), which would only add the same constant to both.
NODE_PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else "python3"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --- llmgw -----------------------------------------------------------------------------------


async def fanout(d: SshDispatcher, ids: list[str]) -> float:
    """Seconds for one inventory fan-out to every node at once."""
    started = time.perf_counter()
    answers = await asyncio.gather(*(d.inventory(i) for i in ids))
    assert len(answers) == len(ids)
    return time.perf_counter() - started


# --- Ansible ---------------------------------------------------------------------------------


def ensure_ansible() -> Path:
    """The ``ansible`` executable of the bench's own venv, installing ansible-core when needed."""
    exe = ANSIBLE_VENV / "bin" / "ansible"
    if exe.exists():
        return exe
    log(f"installing ansible-core into {ANSIBLE_VENV} ...")
    subprocess.run([sys.executable, "-m", "venv", str(ANSIBLE_VENV)], check=True, capture_output=True)
    subprocess.run([str(ANSIBLE_VENV / "bin" / "pip"), "install", "-q", "ansible-core"], check=True,
                   capture_output=True, timeout=600)
    return exe


def ansible_setup(fleet: SshdFleet, work: Path) -> dict[str, str]:
    """Inventory and config in ``work``; the environment that makes ansible use them."""
    lines = ["[nodes]"]
    for node in fleet:
        lines.append(f"{node.host} ansible_port={node.port} ansible_user={node.user} "
                     f"ansible_ssh_private_key_file={fleet.client_key}")
    lines += ["", "[all:vars]", f"ansible_python_interpreter={NODE_PYTHON}", ""]
    (work / "inventory.ini").write_text("\n".join(lines))
    (work / "cp").mkdir()
    (work / "ansible.cfg").write_text(f"""[defaults]
inventory = {work / 'inventory.ini'}
forks = {len(fleet)}
gathering = explicit
host_key_checking = True
interpreter_python = {NODE_PYTHON}
stdout_callback = minimal
retry_files_enabled = False
local_tmp = {work / 'tmp'}

[ssh_connection]
pipelining = True
control_path_dir = {work / 'cp'}
control_path = %(directory)s/%%h-%%p
ssh_args = -o ControlMaster=auto -o ControlPersist=60s -o UserKnownHostsFile={fleet.known_hosts} \
    -o StrictHostKeyChecking=yes -o BatchMode=yes
""")
    return {**os.environ, "ANSIBLE_CONFIG": str(work / "ansible.cfg"), "ANSIBLE_HOME": str(work / "home"),
            "ANSIBLE_NOCOLOR": "1"}


def ansible_run(ansible: Path, env: dict[str, str], module: str, command: str, nodes: int) -> float:
    started = time.perf_counter()
    proc = subprocess.run([str(ansible), "all", "-m", module, "-a", command], env=env, capture_output=True,
                          text=True, timeout=300)
    elapsed = time.perf_counter() - started
    ok = proc.stdout.count("| CHANGED") + proc.stdout.count("| SUCCESS")
    if proc.returncode != 0 or ok != nodes or proc.stdout.count('"agent_version"') < nodes:
        raise RuntimeError(f"ansible -m {module} failed (rc {proc.returncode}, {ok}/{nodes} ok):\n"
                           f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return elapsed


async def compare(fleet: SshdFleet, work: Path, *, rounds: int, per_round: int, raw: bool) -> dict[str, Any]:
    """Both sides cold once, then ``rounds`` rounds, each one warm Ansible ``-m command`` run (and
    ``-m raw``) and ``per_round`` warm llmgw fan-outs, in an order rotated each round, so the box's
    load at any moment falls on both. The speedup is the median of per-round ratios."""
    ids = [node.id for node in fleet]
    ansible = ensure_ansible()
    version = subprocess.run([str(ansible), "--version"], capture_output=True, text=True,
                             timeout=60).stdout.split("\n")[0]
    env = ansible_setup(fleet, work)
    # The agent reads an empty stdin as {} and finds its node config through LLMGW_AGENT_CONFIG,
    # which each node's sshd sets, so one command line serves all 16 nodes.
    command = f"{NODE_PYTHON} {AGENT_PATH} inventory"
    d = SshDispatcher(fleet.targets(), client_key=fleet.client_key, known_hosts=fleet.known_hosts,
                      agent_dir=str(work / "agent-home"), python=NODE_PYTHON, connect_timeout=20, call_timeout=30)
    async with d:
        started = time.perf_counter()
        first = await asyncio.gather(*(d.inventory(i) for i in ids))
        llmgw_first = time.perf_counter() - started
        assert all(len(inv["gpus"]) == 2 for inv in first), "every node reports its two declared GPUs"
        ansible_first = await asyncio.to_thread(ansible_run, ansible, env, "command", command, len(fleet))
        log(f"cold: llmgw {llmgw_first:.3f} s, ansible {ansible_first:.3f} s")

        async def llmgw_round() -> float:
            return statistics.median([await fanout(d, ids) for _ in range(per_round)])

        sides: dict[str, Any] = {
            "llmgw": llmgw_round,
            "ansible": lambda: asyncio.to_thread(ansible_run, ansible, env, "command", command, len(fleet)),
        }
        if raw:
            sides["ansible_raw"] = lambda: asyncio.to_thread(ansible_run, ansible, env, "raw",
                                                             command + " </dev/null", len(fleet))
        times: dict[str, list[float]] = {name: [] for name in sides}
        names = list(sides)
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                times[name].append(await sides[name]())
            log(f"round {r + 1}/{rounds}: " + ", ".join(f"{n} {t[-1]:.4f} s" for n, t in times.items()))
        round_trips = []
        for _ in range(per_round):
            t0 = time.perf_counter()
            await d.hello(ids[0])
            round_trips.append(time.perf_counter() - t0)
        uploads = sum(d.stats(i).uploads for i in ids)
        sessions = sum(d.stats(i).agent_starts for i in ids)
    out: dict[str, Any] = {
        "rounds": rounds,
        "statistic": "median over rounds (order rotated each round); llmgw per round: median of its fan-outs; "
                     "speedup: median of per-round ratios",
        "llmgw_first_s": round(llmgw_first, 4),
        "llmgw_warm_median_s": round(statistics.median(times["llmgw"]), 5),
        "llmgw_fanouts_per_round": per_round,
        "llmgw_round_trip_median_ms": round(statistics.median(round_trips) * 1000, 3),
        "llmgw_uploads": uploads,
        "llmgw_ssh_sessions": sessions,
        "ansible_version": version,
        "ansible_first_s": round(ansible_first, 3),
        "ansible_warm_median_s": round(statistics.median(times["ansible"]), 3),
        "ansible_warm_rounds_s": [round(t, 3) for t in times["ansible"]],
        "speedup": round(statistics.median(a / m for a, m in zip(times["ansible"], times["llmgw"], strict=True)), 1),
    }
    if raw:
        out["ansible_raw_warm_median_s"] = round(statistics.median(times["ansible_raw"]), 3)
        out["speedup_vs_raw"] = round(statistics.median(
            a / m for a, m in zip(times["ansible_raw"], times["llmgw"], strict=True)), 1)
    return out


# --- main ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds, no -m raw (under a minute on 2 cores, once "
                                                              "Ansible is installed)")
    parser.add_argument("--nodes", type=int, default=16)
    args = parser.parse_args(argv)
    rounds, per_round, raw = (3, 7, False) if args.quick else (5, 20, True)

    report: dict[str, Any] = {"bench": "ssh_fanout", "nodes": args.nodes, "quick": args.quick}
    work = Path(tempfile.mkdtemp(prefix="llmgw-ssh-fanout-"))
    env = SshdEnvironment(work / "sshd", worker=0)
    try:
        started = time.perf_counter()
        fleet = env.fleet(args.nodes)
        report["fleet_start_s"] = round(time.perf_counter() - started, 3)
        log(f"{args.nodes} sshd nodes on {fleet[0].host}..{fleet[-1].host} port {fleet[0].port} "
            f"in {report['fleet_start_s']}s")
        try:
            report.update(asyncio.run(compare(fleet, work, rounds=rounds, per_round=per_round, raw=raw)))
        except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
            # Not measured is not met: the speedup stays None.
            report["ansible_error"] = str(exc)[-1000:]
            report["speedup"] = None
    finally:
        env.close()
        shutil.rmtree(work, ignore_errors=True)

    report["goal"] = GOAL
    report["met"] = bool(report["speedup"] and report["speedup"] >= TARGET_SPEEDUP)
    print(json.dumps(report))
    return 0 if report["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
