"""bench: a bad change under llmgw's canary vs `strategy: replace`, under constant load (issue 26).

One `llmgw controller` over two real sshd nodes on loopback addresses (four simulated GPUs each)
serves two models of two simulated replicas each, identical but for their rollout policy:

    canary    strategy: canary, steps [5, 25, 50] %, 2 s each, min_requests 10 (the default checks:
              error rate at most 2 points over the stable's, p95 TTFT and ITL at most 2x the stable's)
    replace   strategy: replace: a new replica beside each old one, the old stopped once the new one
              answers: what every peer does without manual weights (the whole fleet gets the change)

Each model has its own constant load through the controller's router: ``--clients`` threads of
the real openai client, one request after another, every other one streamed. Every version
answers after a 50 ms time to first token (``--ttft 0.05``), so "slow" means something.

Each round commits the same change to both models in ONE commit, so both strategies meet it at
the same moment, under the same load and the same box (nothing to rotate: neither goes first):

    fail   the running version plus ``--fail-rate 0.3`` (30 % of requests answered 500)
    slow   the running version with ``--ttft 0.25`` (5x slower to the first token; not in --quick)
    good   a harmless change (``--max-tokens-default``), which is also what brings both models back
           to a good version before the next round

For a bad change, over the window [commit, commit + ``--window`` s] (the same window for both):
failed client requests, slow requests (answered in more than 3x the p50 latency of that model's
requests in the 3 s before the commit), and for the canary:

    rolled back   the time of the controller's ``rollout-rolled-back`` event (the analysis failed)
    left router   the first moment no request reaches the canary any more: the canary engine's own
                  request counter (``llmgw_sim_requests_total``) is read every 50 ms until it is
                  stopped; "left" is the time the first reading showing its final count came back
                  (so at most one reading, about 50 ms, after the last request it accepted); at or below 0 s after the
                  rollback, no request reached it once the analysis had failed (at 5 % of the
                  traffic the canary gets a request every few hundred ms)
    stopping      the controller's ``replica-stopping`` event of the canary

The window also gets the failures of both over the minimal window [commit, canary left]: the
shortest window in which the canary's damage is complete.

Goals (issue 26): canary has >= 10x fewer failed requests than replace over the window (ratio =
median replace failures / median canary failures; when the canary has none, met when replace has
>= 10); the canary leaves the router <= 10 s after the analysis fails (every round); a good change
under canary has 0 failed requests (every round).

    python bench/rollout_bench.py [--quick] [--rounds N] [--window S] [--clients N]

``--quick``: one round of the fail and good changes, a 15 s window (about 50 s with the fleet's
bring-up on 2 cores). The last line is one JSON object with every figure and ``met``; exit 1 when
a goal is not met.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.e2e.rollout_fleet import Controller, Load, Outcome, close, model_yaml  # noqa: E402
from tests.fixtures.sshd_fleet import SshdEnvironment  # noqa: E402

MODELS = ("canary", "replace")
POLICY = {
    "canary": ("rollout:\n  strategy: canary\n  steps: [5, 25, 50]\n  interval: 2s\n"
               "  checks: {min_requests: 10}\n"),
    "replace": "rollout:\n  strategy: replace\n",
}
BASE_TTFT, SLOW_TTFT, FAIL_RATE = 0.05, 0.25, 0.3
SLOW_FACTOR = 3.0  # a request is slow when answered in more than this many times the stable's p50
BASELINE_S = 3.0  # the stable's p50 is read over this long before each commit
GPUS_PER_NODE = 4  # 2 + 2 replicas, a canary and two replace surges fit at once
GOAL = ("canary >= 10x fewer failed client requests than replace over the same window after a bad commit; "
        "canary out of the router <= 10 s after the analysis fails; 0 failed requests for a good change")


def log(msg: str) -> None:
    print(msg, flush=True)


def args_of(version: int, *, change: str) -> list[str]:
    """Engine args of one version: ``version`` tells good versions apart (a new fingerprint each)."""
    ttft = SLOW_TTFT if change == "slow" else BASE_TTFT
    out = ["--ttft", str(ttft), "--max-tokens-default", str(16 + version)]
    return out + (["--fail-rate", str(FAIL_RATE)] if change == "fail" else [])


def files(version: int, *, change: str = "good") -> dict[str, str]:
    return {f"models/{m}.yaml": model_yaml(m, replicas=2, args=args_of(version, change=change), rollout=POLICY[m])
            for m in MODELS}


# --- the canary seen from its engine ----------------------------------------------------------------

def engine_requests(endpoint: str) -> int:
    with urllib.request.urlopen(endpoint + "/metrics", timeout=2) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("llmgw_sim_requests_total"):
                return int(float(line.rsplit(" ", 1)[1]))
    raise ValueError(f"{endpoint}/metrics has no llmgw_sim_requests_total")


@dataclass
class CanaryWatch:
    """Reads the canary engine's request counter every 50 ms from the moment it has an endpoint
    until it stops answering: when the last request reached it."""

    ctl: Controller
    model: str
    after: int  # event id before the commit
    samples: list[tuple[float, int]] = field(default_factory=list)
    replica: str | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> CanaryWatch:
        self._thread = threading.Thread(target=self._run, daemon=True, name="canary-watch")
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def _endpoint(self) -> str | None:
        ids = self.ctl.canaries(self.model, after=self.after)
        if not ids:
            return None
        self.replica = ids[0]
        return next((r["endpoint"] for r in self.ctl.replicas(self.model)
                     if r["id"] == ids[0] and r.get("endpoint") and r["state"] == "ready"), None)

    def _run(self) -> None:
        endpoint = None
        while endpoint is None and not self._stop.is_set():
            try:
                endpoint = self._endpoint()
            except (OSError, ValueError):
                pass
            self._stop.wait(0.05)
        misses = 0
        while endpoint is not None and not self._stop.is_set() and misses < 5:
            try:
                count = engine_requests(endpoint)
                # Stamped once the reading is back: the count holds every request that reached the
                # canary before this moment (a stamp taken before asking would be too early by the
                # read's own time, and a request sent meanwhile would seem to come after "left").
                self.samples.append((time.time(), count))
                misses = 0
            except (OSError, ValueError):
                misses += 1  # stopped (refused), or a reading lost on a busy box
            self._stop.wait(0.05)

    def wait_stopped(self, timeout: float) -> None:
        """Until the canary's engine no longer answers (its last count is read), or ``timeout``."""
        if self._thread is not None:
            self._thread.join(timeout)

    def left(self) -> float | None:
        """The first reading that shows the final count (None: never read, or still counting)."""
        if not self.samples:
            return None
        final = self.samples[-1][1]
        return next(t for t, n in self.samples if n == final)


# --- one change ------------------------------------------------------------------------------------

def started_in(outcomes: Sequence[Outcome], since: float, until: float) -> list[Outcome]:
    return [o for o in outcomes if since <= o.started <= until]


def p50(outcomes: Sequence[Outcome]) -> float:
    ok = [o.ended - o.started for o in outcomes if o.ok]
    return statistics.median(ok) if ok else float("nan")


def tally(load: Load, since: float, until: float, *, slow_above: float) -> dict[str, Any]:
    window = started_in(load.snapshot(), since, until)
    return {"requests": len(window), "failed": sum(1 for o in window if not o.ok),
            "slow": sum(1 for o in window if o.ok and o.ended - o.started > slow_above)}


def bad_change(ctl: Controller, loads: dict[str, Load], *, version: int, change: str,
               window: float) -> dict[str, Any]:
    """Commit ``change`` to both models at once; figures over [commit, commit + window]."""
    slow_above = {m: SLOW_FACTOR * p50(started_in(loads[m].snapshot(), time.time() - BASELINE_S, time.time()))
                  for m in MODELS}
    mark = ctl.last_event_id()
    committed = time.time()
    watch = CanaryWatch(ctl, "canary", mark).start()
    try:
        ctl.commit(dict(files(version, change=change)), f"both models: {change} change (round {version})")
        back = ctl.wait_event(("rollout-rolled-back", "rollout-promoted", "rollout-done"), "canary", after=mark,
                              timeout=window + 60)
        rest = committed + window - time.time()
        if rest > 0:
            time.sleep(rest)  # the window is the same length for both, whenever the canary is done
        if watch.replica is not None and back["kind"] == "rollout-rolled-back":
            ctl.wait_event("replica-stopping", watch.replica, after=mark, timeout=60)
        watch.wait_stopped(30)  # until the canary's engine stops answering
    finally:
        watch.close()
    until = committed + window
    left = watch.left()
    stopping = next((e["time"] for e in ctl.events(after=mark, subject=watch.replica or "-")
                     if e["kind"] == "replica-stopping"), None)
    out: dict[str, Any] = {
        "change": change, "window_s": window,
        "canary_outcome": back["kind"], "canary_reason": back["message"],
        "canary_replica": watch.replica,
        "rollback_to_left_s": round(left - back["time"], 3) if left is not None else None,
        "rollback_to_stopping_s": round(stopping - back["time"], 3) if stopping is not None else None,
        "commit_to_rollback_s": round(back["time"] - committed, 3),
        "commit_to_left_s": round(left - committed, 3) if left is not None else None,
        "canary_requests_served": watch.samples[-1][1] if watch.samples else None,
    }
    if left is not None:
        # A failure the canary model's clients met after no request reached the canary any more is
        # not the canary's: listed whole, since the goal counts it all the same.
        out["canary_model_failures_after_left"] = [
            {"started_after_left_s": round(o.started - left, 3), "lasted_s": round(o.ended - o.started, 3),
             "error": o.error} for o in started_in(loads["canary"].snapshot(), left, until) if not o.ok]
    for m in MODELS:
        t = tally(loads[m], committed, until, slow_above=slow_above[m])
        out[m] = {**t, "slow_above_ms": round(slow_above[m] * 1000, 1)}
        if left is not None:
            out[m]["failed_until_canary_left"] = tally(loads[m], committed, left, slow_above=slow_above[m])["failed"]
    return out


def good_change(ctl: Controller, loads: dict[str, Load], *, version: int) -> dict[str, Any]:
    """Commit a good version to both; wait until both rollouts are done; the canary's failures."""
    mark = ctl.last_event_id()
    committed = time.time()
    ctl.commit(dict(files(version)), f"both models: a good change (version {version})")
    ends = {m: ctl.wait_event(("rollout-done", "rollout-rolled-back", "rollout-aborted"), m, after=mark, timeout=120)
            for m in MODELS}
    ctl.ready("canary", 2)
    ctl.ready("replace", 2)
    loads["canary"].wait_answered(10, proc=ctl.proc)  # the new version serves
    done = time.time()
    kinds = [e["kind"] for e in ctl.events(after=mark, subject="canary") if e["kind"].startswith("rollout-")]
    return {"canary_rollout": kinds, "canary_outcome": ends["canary"]["kind"],
            "canary_rollout_s": round(ends["canary"]["time"] - committed, 2),
            "canary_failed": sum(1 for o in started_in(loads["canary"].snapshot(), committed, done) if not o.ok),
            "canary_requests": len(started_in(loads["canary"].snapshot(), committed, done)),
            "replace_outcome": ends["replace"]["kind"]}


# --- the run --------------------------------------------------------------------------------------

def run(work: Path, *, rounds: int, window: float, clients: int, slow: bool) -> dict[str, Any]:
    env = SshdEnvironment(work / "sshd", worker=0)
    gpus = [{"index": i, "class": "sim", "memory_gb": 24} for i in range(GPUS_PER_NODE)]
    fleet = env.fleet(2, agent_extra={"gpus": gpus})
    ctl: Controller | None = None
    began = time.time()
    try:
        ctl = Controller.create(work, fleet, files(0), gpus=GPUS_PER_NODE)
        ctl.start()
        for m in MODELS:
            ctl.ready(m, 2)
        log(f"fleet up in {time.time() - began:.1f} s: 2 nodes, 2 x 2 sim replicas")
        loads = {m: Load(ctl.router, m, clients=clients, pause=0.0, max_tokens=4) for m in MODELS}
        for load in loads.values():
            load.__enter__()
        try:
            for load in loads.values():
                load.wait_answered(20, proc=ctl.proc)
            time.sleep(BASELINE_S)  # a baseline of the stable version for "slow"
            bad: list[dict[str, Any]] = []
            good: list[dict[str, Any]] = []
            version = 0
            for r in range(rounds):
                for change in ("fail", "slow") if slow else ("fail",):
                    res = bad_change(ctl, loads, version=version, change=change, window=window)
                    res["round"] = r + 1
                    bad.append(res)
                    log(describe_bad(res))
                    version += 1
                    g = good_change(ctl, loads, version=version)
                    g["round"] = r + 1
                    good.append(g)
                    log(f"round {r + 1} good change (v{version}): canary {' > '.join(g['canary_rollout'])} in "
                        f"{g['canary_rollout_s']} s, {g['canary_failed']} failed of {g['canary_requests']}; "
                        f"replace {g['replace_outcome']}")
                    time.sleep(BASELINE_S)
        finally:
            for load in loads.values():
                load.__exit__(None, None, None)
        errors = sorted({o.error or "" for load in loads.values() for o in load.snapshot() if not o.ok})
        return {"bad": bad, "good": good, "error_kinds": [e[:160] for e in errors[:5]],
                "elapsed_s": round(time.time() - began, 1)}
    finally:
        if ctl is not None and ctl.proc is not None and ctl.proc.poll() is not None:
            print(f"controller exited {ctl.proc.returncode}; log: {work}/controller{ctl.lives}.log", file=sys.stderr)
        close(ctl, fleet)
        env.close()


def describe_bad(r: dict[str, Any]) -> str:
    c, p = r["canary"], r["replace"]
    return (f"round {r['round']} {r['change']} change, {r['window_s']:g} s window: "
            f"canary {c['failed']} failed / {c['slow']} slow of {c['requests']} "
            f"(slow > {c['slow_above_ms']} ms); replace {p['failed']} failed / {p['slow']} slow of {p['requests']} "
            f"(slow > {p['slow_above_ms']} ms); canary {r['canary_outcome']} {r['commit_to_rollback_s']} s after "
            f"the commit, left the router {r['rollback_to_left_s']} s after (stopping "
            f"{r['rollback_to_stopping_s']} s after), {r['canary_requests_served']} requests reached it; "
            f"until it left: canary {c.get('failed_until_canary_left')} failed, replace "
            f"{p.get('failed_until_canary_left')}\n    reason: {r['canary_reason']}")


def med(xs: Sequence[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return round(statistics.median(vals), 3) if vals else None


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for change in ("fail", "slow"):
        rs = [r for r in res["bad"] if r["change"] == change]
        if not rs:
            continue
        s = {
            "runs": len(rs),
            "canary_failed": med([r["canary"]["failed"] for r in rs]),
            "replace_failed": med([r["replace"]["failed"] for r in rs]),
            "canary_slow": med([r["canary"]["slow"] for r in rs]),
            "replace_slow": med([r["replace"]["slow"] for r in rs]),
            "canary_requests": med([r["canary"]["requests"] for r in rs]),
            "replace_requests": med([r["replace"]["requests"] for r in rs]),
            "canary_failed_until_left": med([r["canary"].get("failed_until_canary_left") for r in rs]),
            "replace_failed_until_left": med([r["replace"].get("failed_until_canary_left") for r in rs]),
            "rollback_to_left_s": med([r["rollback_to_left_s"] for r in rs]),
            "rollback_to_left_s_max": max((r["rollback_to_left_s"] for r in rs if r["rollback_to_left_s"] is not None),
                                          default=None),
            "rollback_to_stopping_s": med([r["rollback_to_stopping_s"] for r in rs]),
            "commit_to_rollback_s": med([r["commit_to_rollback_s"] for r in rs]),
            "rolled_back_every_run": all(r["canary_outcome"] == "rollout-rolled-back" for r in rs),
        }
        # The goal's measure: failures for a failing change, slow requests for a slow one.
        key = "failed" if change == "fail" else "slow"
        cv, rv = float(s[f"canary_{key}"] or 0), float(s[f"replace_{key}"] or 0)
        s[f"{key}_ratio"] = round(rv / cv, 2) if cv else None
        s[f"{key}_ratio_rule"] = (f"median replace {key} / median canary {key} = {rv:g} / {cv:g}" if cv else
                                  f"canary median {key} is 0: met when replace median {key} ({rv:g}) >= 10")
        s[f"{key}_10x"] = rv >= 10 * max(cv, 1.0)
        out[change] = s
    out["good_canary_failed"] = [g["canary_failed"] for g in res["good"]]
    out["good_promoted_every_run"] = all(g["canary_outcome"] == "rollout-done" for g in res["good"])
    return out


def within(summary: dict[str, Any], seconds: float) -> bool:
    """Every run's canary left the router at most ``seconds`` after its analysis failed."""
    worst = summary["rollback_to_left_s_max"]
    return worst is not None and float(worst) <= seconds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one round, fail and good changes, a 15 s window")
    p.add_argument("--rounds", type=int, default=None, help="rounds (default 3, quick 1)")
    p.add_argument("--window", type=float, default=None, help="seconds after a bad commit counted (default 20, "
                                                              "quick 15)")
    p.add_argument("--clients", type=int, default=4, help="client threads per model")
    a = p.parse_args(argv)
    rounds = a.rounds or (1 if a.quick else 3)
    window = a.window or (15.0 if a.quick else 20.0)
    with tempfile.TemporaryDirectory(prefix="llmgw-rollout-bench-") as tmp:
        res = run(Path(tmp), rounds=rounds, window=window, clients=a.clients, slow=not a.quick)
    s = summarize(res)
    f = s["fail"]
    log(f"fail change, medians of {f['runs']}: canary {f['canary_failed']:g} failed vs replace "
        f"{f['replace_failed']:g} ({f['failed_ratio_rule']}); until the canary left: canary "
        f"{f['canary_failed_until_left']} vs replace {f['replace_failed_until_left']}; slow: canary "
        f"{f['canary_slow']:g} vs replace {f['replace_slow']:g}; analysis failed {f['commit_to_rollback_s']} s after "
        f"the commit, canary out of the router {f['rollback_to_left_s']} s later (max {f['rollback_to_left_s_max']}),"
        f" stopping {f['rollback_to_stopping_s']} s later")
    if "slow" in s:
        w = s["slow"]
        log(f"slow change, medians of {w['runs']}: slow canary {w['canary_slow']:g} vs replace {w['replace_slow']:g} "
            f"({w['slow_ratio_rule']}); failed canary {w['canary_failed']:g} vs replace {w['replace_failed']:g}; "
            f"canary out of the router {w['rollback_to_left_s']} s after the analysis failed")
    checks = {
        "fail: canary >= 10x fewer failed requests than replace": f["failed_10x"],
        "fail: canary rolled back every run": f["rolled_back_every_run"],
        "fail: canary out of the router <= 10 s after the analysis failed (every run)": within(f, 10.0),
        "good: 0 failed requests under canary (every run)": all(n == 0 for n in s["good_canary_failed"]),
        "good: promoted every run": s["good_promoted_every_run"],
    }
    if "slow" in s:
        checks["slow: canary rolled back every run"] = s["slow"]["rolled_back_every_run"]
        checks["slow: canary out of the router <= 10 s after the analysis failed (every run)"] = within(s["slow"], 10.0)
    for name, ok in checks.items():
        log(f"  {'ok  ' if ok else 'FAIL'} {name}")
    out = {"bench": "rollout", "metric": f["failed_ratio"],
           "quick": a.quick, "rounds": rounds, "window_s": window, "clients_per_model": a.clients,
           **{k: v for k, v in s.items()}, "runs": res["bad"], "good_runs": res["good"],
           "error_kinds": res["error_kinds"], "elapsed_s": res["elapsed_s"], "checks": checks, "goal": GOAL,
           "met": all(checks.values())}
    print(json.dumps(out, default=str))
    return 0 if out["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
