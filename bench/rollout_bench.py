"""bench: bad changes under llmgw's canary vs `strategy: replace`, under constant load (issues 26, 37).

One `llmgw controller` over two real sshd nodes on loopback addresses (four simulated GPUs each)
serves two models of two simulated replicas each, identical but for their rollout policy:

    canary    strategy: canary, steps [5, 25, 50] %, 2 s each, min_requests 10 (the default checks:
              error rate at most 2 points over the stable's, p95 TTFT, inter-token latency and time
              per output token at most 2x the stable's), and one acceptance prompt (a question, and
              the words the serving version answers it with)
    replace   strategy: replace: a new replica beside each old one, the old stopped once the new one
              answers: what every peer does without manual weights (the whole fleet gets the change;
              no acceptance prompts either)

Each model has its own constant load through the controller's router: ``--clients`` threads of
the real openai client, one request after another, every other one streamed, 16 tokens each. Every
version answers after a 50 ms first token and writes 200 tokens a second (``--ttft 0.05
--tokens-per-second 200``), so "slow" means something.

Each round commits the same change to both models in ONE commit, so both strategies meet it at
the same moment, under the same load and the same box:

    fail    the running version plus ``--fail-rate 0.3`` (30 % of requests answered 500)
    slow    ``--ttft 0.25``: 5x slower to the first token
    decode  ``--tokens-per-second 25``: the same first token, 8x slower between tokens (a bad kernel,
            quantisation or batch setting)
    wrong   ``--weights other``: 200 with other words for the same prompt (other weights behind the
            same name, a broken template); caught by the acceptance prompt before any client hears it
    good    a harmless change (``--max-tokens-default``), which is also what brings both models back
            to a good version before the next round

Each bad kind runs plain and ``hostile``: with, beside the load, one client sending requests every
version refuses (``{"messages": []}``, a 400, as fast as it can) and one asking for long whole
answers (300 tokens, not streamed) to each model. Their own requests are not counted. The good
change that follows a hostile run is made with the hostile clients still there: a canary must not
be rolled back, nor a legitimate client fail, because someone else sends junk.

For a bad change, over the window [commit, commit + ``--window`` s] (the same for both): failed
client requests, slow requests (answered in more than 2x the p50 of that model's requests in the 3 s
before the commit), wrong answers (a client got the words ``--weights other`` writes for its prompt,
computed as the simulator does), and for the canary when it was rolled back and when it left the
router (its engine's own request counter, read every 50 ms, stops moving).

Goals: for each bad kind, plain and hostile, the canary is rolled back every run, and its clients'
measure of that kind (failed, slow, wrong) is at least 10x below replace's (when the canary's is 0:
replace's >= 10; wrong: 0 wrong answers to the canary's clients and some to replace's); the canary
leaves the router <= 10 s after the analysis fails; every good change is promoted with 0 failed
requests (those made with the hostile clients too: at least one when a hostile run was made), and
the false-rollback rate of good changes (rolled back / runs, at least 20 runs in the full run) is 0.

    python bench/rollout_bench.py [--quick] [--rounds N] [--good N] [--window S] [--clients N] [--kinds K,…]

``--quick``: the fail change with the hostile clients, a good change (hostile clients still there),
the wrong change, a 12 s window (about 55 s here with the fleet's bring-up). The last line is one JSON object with every
figure and ``met``; exit 1 when a goal is not met.
"""

from __future__ import annotations

import argparse
import contextlib
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
QUESTION = "What is the capital of France?"
ACCEPTANCE_TOKENS = 8


def sim_text(messages: Sequence[tuple[str, str]], count: int, weights: str = "") -> str:
    """The words the simulator writes for ``messages`` and ``count`` tokens as ``weights`` (what a
    client gets, whole or streamed): the bench's ground truth for a wrong answer."""
    from llmgw.engines.sim import VOCAB, _chat_seed, _digest, _plan

    seed, _ = _chat_seed({"messages": [{"role": r, "content": c} for r, c in messages]})
    words = _plan(_digest(weights + "\0" + seed if weights else seed), count).words
    return " ".join(VOCAB[w] for w in words)


ACCEPTANCE = (
    "  acceptance:\n    - name: capital\n"
    f"      messages: [{{role: user, content: {json.dumps(QUESTION)}}}]\n"
    f"      max_tokens: {ACCEPTANCE_TOKENS}\n"
    f"      expect: {{contains: [{json.dumps(sim_text((('user', QUESTION),), ACCEPTANCE_TOKENS))}]}}\n")
POLICY = {
    "canary": ("rollout:\n  strategy: canary\n  steps: [5, 25, 50]\n  interval: 2s\n"
               "  checks: {min_requests: 10}\n" + ACCEPTANCE),
    "replace": "rollout:\n  strategy: replace\n",
}
BASE_TTFT, SLOW_TTFT, FAIL_RATE = 0.05, 0.25, 0.3
BASE_TPS, SLOW_TPS = 200, 25
LOAD_TOKENS = 16
KINDS = ("fail", "slow", "decode", "wrong")
MEASURE = {"fail": "failed", "slow": "slow", "decode": "slow", "wrong": "wrong"}
# A request is slow when answered in more than this many times the p50 before the commit: 2x, since a
# 16-token answer takes ~130 ms here and a first token 200 ms late makes it ~330 ms (2.5x; at 3x the
# slow change's harm did not count).
SLOW_FACTOR = 2.0
BASELINE_S = 3.0  # the stable's p50 is read over this long before each commit
GPUS_PER_NODE = 4  # 2 + 2 replicas, a canary and two replace surges fit at once
GOAL = ("per bad kind (fail, slow, decode, wrong), plain and with hostile clients: canary rolled back every run, "
        ">= 10x fewer failed/slow/wrong client answers than replace (wrong: 0 to the canary's clients); canary out "
        "of the router <= 10 s after the analysis fails; good changes promoted with 0 failed requests, with the "
        "hostile clients too, false rollbacks 0 (>= 20 good runs in the full run)")


def log(msg: str) -> None:
    print(msg, flush=True)


def args_of(version: int, *, change: str) -> list[str]:
    """Engine args of one version: ``version`` tells good versions apart (a new fingerprint each)."""
    ttft = SLOW_TTFT if change == "slow" else BASE_TTFT
    tps = SLOW_TPS if change == "decode" else BASE_TPS
    out = ["--ttft", str(ttft), "--tokens-per-second", str(tps), "--max-tokens-default", str(16 + version)]
    out += ["--fail-rate", str(FAIL_RATE)] if change == "fail" else []
    return out + (["--weights", "other"] if change == "wrong" else [])


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


def wrong(o: Outcome) -> bool:
    """The client got the words the bad version (``--weights other``) writes for its prompt."""
    return o.ok and bool(o.text) and o.text == sim_text(o.messages, LOAD_TOKENS, "other")


def tally(load: Load, since: float, until: float, *, slow_above: float) -> dict[str, Any]:
    window = started_in(load.snapshot(), since, until)
    return {"requests": len(window), "failed": sum(1 for o in window if not o.ok),
            "slow": sum(1 for o in window if o.ok and o.ended - o.started > slow_above),
            "wrong": sum(1 for o in window if wrong(o))}


class Hostile:
    """Per model: one client sending requests every version refuses (``{"messages": []}``: a 400)
    as fast as it can, and one asking for long whole answers (300 tokens, not streamed)."""

    def __init__(self, router: str, models: Sequence[str]) -> None:
        self.router, self.models = router, models
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.sent = {"refused": 0, "long": 0}

    def __enter__(self) -> Hostile:
        for m in self.models:
            for target in (self._junk, self._long):
                t = threading.Thread(target=target, args=(m,), daemon=True, name=f"hostile-{m}")
                t.start()
                self._threads.append(t)
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)

    def _post(self, body: dict[str, Any]) -> None:
        req = urllib.request.Request(self.router + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                r.read()
        except (OSError, ValueError):
            pass  # a 400 (urllib raises it), or the router busy: either way the client goes on

    def _junk(self, model: str) -> None:
        while not self._stop.is_set():
            self._post({"model": model, "messages": []})
            self.sent["refused"] += 1

    def _long(self, model: str) -> None:
        while not self._stop.is_set():
            self._post({"model": model, "messages": [{"role": "user", "content": "Write at length."}],
                        "max_tokens": 300})
            self.sent["long"] += 1


def bad_change(ctl: Controller, loads: dict[str, Load], *, version: int, change: str,
               window: float) -> dict[str, Any]:
    """Commit ``change`` to both models at once; figures over [commit, commit + window]. A wrong
    change's canary never serves (its acceptance prompt fails first): nothing to watch leave."""
    slow_above = {m: SLOW_FACTOR * p50(started_in(loads[m].snapshot(), time.time() - BASELINE_S, time.time()))
                  for m in MODELS}
    mark = ctl.last_event_id()
    committed = time.time()
    watch = CanaryWatch(ctl, "canary", mark).start()
    try:
        ctl.commit(dict(files(version, change=change)), f"both models: {change} change (round {version})")
        back = ctl.wait_event(("rollout-rolled-back", "rollout-promoted", "rollout-done"), "canary", after=mark,
                              timeout=window + 60)
        if change == "wrong":
            watch.close()  # its canary never served (acceptance failed first): no endpoint to watch
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


def good_change(ctl: Controller, loads: dict[str, Load], *, version: int, hostile: bool = False) -> dict[str, Any]:
    """Commit a good version to both; wait until both rollouts are done; the canary's failures.
    ``hostile`` only records that the hostile clients were sending meanwhile (the caller runs them)."""
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
            "canary_reason": ends["canary"]["message"][:300],
            "canary_rollout_s": round(ends["canary"]["time"] - committed, 2),
            "canary_failed": sum(1 for o in started_in(loads["canary"].snapshot(), committed, done) if not o.ok),
            "canary_requests": len(started_in(loads["canary"].snapshot(), committed, done)),
            "replace_outcome": ends["replace"]["kind"], "hostile": hostile}


# --- the run --------------------------------------------------------------------------------------

def schedule(*, quick: bool, rounds: int, kinds: Sequence[str] = KINDS) -> list[tuple[str, bool]]:
    """(kind, hostile) of each bad change, in order."""
    if quick:
        return [("fail", True), ("wrong", False)]
    return [(k, h) for _ in range(rounds) for k in kinds for h in (False, True)]


def run(work: Path, *, rounds: int, window: float, clients: int, quick: bool, goods: int,
        kinds: Sequence[str] = KINDS) -> dict[str, Any]:
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
        loads = {m: Load(ctl.router, m, clients=clients, pause=0.0, max_tokens=LOAD_TOKENS) for m in MODELS}
        for load in loads.values():
            load.__enter__()
        try:
            for load in loads.values():
                load.wait_answered(20, proc=ctl.proc)
            time.sleep(BASELINE_S)  # a baseline of the stable version for "slow"
            bad: list[dict[str, Any]] = []
            good: list[dict[str, Any]] = []
            version = 0

            def good_one(label: str, *, hostile: bool = False) -> None:
                nonlocal version
                version += 1
                g = good_change(ctl, loads, version=version, hostile=hostile)
                g["after"] = label
                good.append(g)
                log(f"good change {len(good)} (v{version}{', hostile clients' if hostile else ''}): canary "
                    f"{' > '.join(g['canary_rollout'])} in {g['canary_rollout_s']} s, {g['canary_failed']} failed "
                    f"of {g['canary_requests']}; replace {g['replace_outcome']}")

            plan = schedule(quick=quick, rounds=rounds, kinds=kinds)
            for n, (change, hostile) in enumerate(plan, start=1):
                with Hostile(ctl.router, MODELS) if hostile else contextlib.nullcontext() as h:
                    if hostile:
                        time.sleep(BASELINE_S)  # the baseline for "slow" with the hostile clients in it
                    res = bad_change(ctl, loads, version=version, change=change, window=window)
                    res["round"], res["hostile"] = n, hostile
                    res["hostile_sent"] = dict(h.sent) if h is not None else None
                    bad.append(res)
                    log(describe_bad(res))
                    if n < len(plan) or len(good) < goods:  # back to a good version before the next change,
                        # with the hostile clients still sending when they were
                        good_one(f"{change}{' hostile' if hostile else ''}", hostile=hostile)
                time.sleep(BASELINE_S)  # the next change's baseline for "slow", without hostile clients
            while len(good) < goods:  # the false-rollback rate wants many runs of a good change
                good_one("good")
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
    return (f"{r['round']}: {r['change']} change{' (hostile clients)' if r['hostile'] else ''}, {r['window_s']:g} s "
            f"window: canary {c['failed']} failed / {c['slow']} slow / {c['wrong']} wrong of {c['requests']} "
            f"(slow > {c['slow_above_ms']} ms); replace {p['failed']} failed / {p['slow']} slow / {p['wrong']} wrong "
            f"of {p['requests']} "
            f"(slow > {p['slow_above_ms']} ms); canary {r['canary_outcome']} {r['commit_to_rollback_s']} s after "
            f"the commit, left the router {r['rollback_to_left_s']} s after (stopping "
            f"{r['rollback_to_stopping_s']} s after), {r['canary_requests_served']} requests reached it; "
            f"until it left: canary {c.get('failed_until_canary_left')} failed, replace "
            f"{p.get('failed_until_canary_left')}\n    reason: {r['canary_reason']}")


def med(xs: Sequence[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return round(statistics.median(vals), 3) if vals else None


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    """Per kind and variant ("fail", "fail hostile", …): medians, the ratio on the kind's measure and
    whether the canary was rolled back every run; the good changes' failures and false rollbacks."""
    out: dict[str, Any] = {}
    for change in KINDS:
        for hostile in (False, True):
            rs = [r for r in res["bad"] if r["change"] == change and bool(r.get("hostile")) == hostile]
            if not rs:
                continue
            key = MEASURE[change]
            s: dict[str, Any] = {"runs": len(rs), "measure": key}
            for m in MODELS:
                for field_ in ("failed", "slow", "wrong", "requests"):
                    s[f"{m}_{field_}"] = med([r[m][field_] for r in rs])
                s[f"{m}_failed_until_left"] = med([r[m].get("failed_until_canary_left") for r in rs])
            s.update({
                "rollback_to_left_s": med([r["rollback_to_left_s"] for r in rs]),
                "rollback_to_left_s_max": max((r["rollback_to_left_s"] for r in rs
                                               if r["rollback_to_left_s"] is not None), default=None),
                "commit_to_rollback_s": med([r["commit_to_rollback_s"] for r in rs]),
                "rolled_back_every_run": all(r["canary_outcome"] == "rollout-rolled-back" for r in rs),
                "reasons": sorted({r["canary_reason"][:200] for r in rs}),
            })
            cv, rv = float(s[f"canary_{key}"] or 0), float(s[f"replace_{key}"] or 0)
            s["ratio"] = round(rv / cv, 2) if cv else None
            if key == "wrong":
                s["rule"] = f"canary's clients got {cv:g} wrong answers (must be 0), replace's {rv:g} (must be > 0)"
                s["met"] = cv == 0 and rv > 0
            else:
                s["rule"] = (f"median replace {key} / median canary {key} = {rv:g} / {cv:g}" if cv else
                             f"canary median {key} is 0: met when replace median {key} ({rv:g}) >= 10")
                s["met"] = rv >= 10 * max(cv, 1.0)
            out[change + (" hostile" if hostile else "")] = s
    good = res["good"]
    out["good_runs"] = len(good)
    out["good_canary_failed"] = [g["canary_failed"] for g in good]
    out["good_rolled_back"] = [g["canary_reason"] for g in good if g["canary_outcome"] == "rollout-rolled-back"]
    out["false_rollback_rate"] = round(len(out["good_rolled_back"]) / len(good), 4) if good else None
    out["good_promoted_every_run"] = all(g["canary_outcome"] == "rollout-done" for g in good)
    hostile = [g for g in good if g.get("hostile")]
    out["good_hostile_runs"] = len(hostile)
    # A good change made while the hostile clients sent junk and long answers: promoted, 0 failed.
    out["good_hostile_met"] = bool(hostile) and all(g["canary_outcome"] == "rollout-done" and g["canary_failed"] == 0
                                                    for g in hostile)
    return out


def within(summary: dict[str, Any], seconds: float) -> bool:
    """Every run's canary left the router at most ``seconds`` after its analysis failed."""
    worst = summary["rollback_to_left_s_max"]
    return worst is not None and float(worst) <= seconds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fail (hostile) and wrong changes, a 12 s window")
    p.add_argument("--rounds", type=int, default=None, help="rounds of every kind, plain and hostile (default 1)")
    p.add_argument("--good", type=int, default=None, help="good changes at least (default 20, quick 1)")
    p.add_argument("--window", type=float, default=None, help="seconds after a bad commit counted (default 20, "
                                                              "quick 12)")
    p.add_argument("--clients", type=int, default=4, help="client threads per model")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"bad kinds to run (default {','.join(KINDS)})")
    a = p.parse_args(argv)
    kinds = [k for k in a.kinds.split(",") if k]
    if unknown := sorted(set(kinds) - set(KINDS)):
        p.error(f"--kinds: unknown {', '.join(unknown)} (known: {', '.join(KINDS)})")
    rounds = a.rounds or 1
    goods = a.good if a.good is not None else (1 if a.quick else 20)
    window = a.window or (12.0 if a.quick else 20.0)
    with tempfile.TemporaryDirectory(prefix="llmgw-rollout-bench-") as tmp:
        res = run(Path(tmp), rounds=rounds, window=window, clients=a.clients, quick=a.quick, goods=goods,
                  kinds=kinds)
    s = summarize(res)
    checks: dict[str, bool] = {}
    for name, k in s.items():
        if not isinstance(k, dict):
            continue
        log(f"{name}, medians of {k['runs']}: {k['rule']}; failed canary {k['canary_failed']:g} vs replace "
            f"{k['replace_failed']:g}, slow {k['canary_slow']:g} vs {k['replace_slow']:g}, wrong "
            f"{k['canary_wrong']:g} vs {k['replace_wrong']:g}; rolled back {k['commit_to_rollback_s']} s after the "
            f"commit, out of the router {k['rollback_to_left_s']} s later (max {k['rollback_to_left_s_max']})")
        checks[f"{name}: canary rolled back every run"] = k["rolled_back_every_run"]
        checks[f"{name}: {k['rule']}"] = k["met"]
        if not name.startswith("wrong"):  # a wrong change's canary never served: nothing to leave
            checks[f"{name}: canary out of the router <= 10 s after the analysis failed (every run)"] = within(k, 10.0)
    checks["good: 0 failed requests under canary (every run)"] = all(n == 0 for n in s["good_canary_failed"])
    checks[f"good: promoted every run ({s['good_runs']} runs, false rollbacks {len(s['good_rolled_back'])})"] = \
        s["good_promoted_every_run"]
    if any(r.get("hostile") for r in res["bad"]):
        checks[f"good with hostile clients: promoted with 0 failed requests ({s['good_hostile_runs']} runs)"] = \
            s["good_hostile_met"]
    for name, ok in checks.items():
        log(f"  {'ok  ' if ok else 'FAIL'} {name}")
    fail = s.get("fail hostile") or s.get("fail") or {}
    out = {"bench": "rollout", "metric": fail.get("ratio"), "quick": a.quick, "rounds": rounds, "window_s": window,
           "clients_per_model": a.clients, **s, "runs": res["bad"], "good_changes": res["good"],
           "error_kinds": res["error_kinds"], "elapsed_s": res["elapsed_s"], "checks": checks, "goal": GOAL,
           "met": bool(checks) and all(checks.values())}
    print(json.dumps(out, default=str))
    return 0 if out["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
