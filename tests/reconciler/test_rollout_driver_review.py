"""RolloutDriver on a real store: what an adversarial review found (each test failed before its fix).

Each docstring names the finding and how it was seen; the test asserts what should happen.
"""

from __future__ import annotations

from dataclasses import replace as dc_replace

from llmgw.catalog import Catalog
from llmgw.decide.replica import ReplicaState
from llmgw.decide.rollout import Phase, model_version
from llmgw.decide.tick import CanaryWant, Decisions, decide
from llmgw.reconciler.rollouts import RolloutDriver
from llmgw.state import Store
from tests.placement.fleet import inventory, node
from tests.reconciler.test_decide import replica as make_replica
from tests.reconciler.test_rollout_decide import NEW, scaled
from tests.reconciler.test_rollout_driver import OLD, TARGET, driver, fleet, run_canary


def test_a_git_revert_during_promotion_stops_promoting_the_reverted_version(store: Store) -> None:
    """HIGH. A canary passed and the model is promoting (some replicas already on the new
    version). The operator finds a problem and `git revert`s. Expected: the revert takes the model
    back to the old version, as `llmgw rollout abort` does (serving = previous). Today _begin aborts
    the rollout as "superseded" but leaves ``serving`` at the reverted version, then starts a NEW
    canary rollout from the reverted version to the old one: the tick keeps replacing the old
    replicas with the version being reverted while the revert itself is judged step by step."""
    d = run_canary(store, 0.0, 0.0)  # good canary: promoted, serving = TARGET
    assert d.rollout("m").phase == Phase.PROMOTING
    # Mid-promotion: one old replica already replaced by the promoted canary (it runs TARGET).
    reps = fleet(make_replica("m-g1", OLD), make_replica("m-g3", TARGET, gpu=2))
    d.plan(Catalog(models=(TARGET,), revision="b" * 40), reps, dict, now=100.0)
    assert d.rollout("m").phase == Phase.PROMOTING
    # git revert: the catalog goes back to OLD.
    plan = d.plan(Catalog(models=(OLD,), revision="c" * 40), reps, dict, now=101.0)
    running = plan.catalog.model("m")
    assert model_version(running) == model_version(OLD), (
        f"after a revert the tick still runs the reverted version: rollout {d.rollout('m').phase.value} "
        f"({d.rollout('m').reason!r}), stable version {d.rollout('m').stable}, serving={model_version(running)} "
        f"== TARGET {model_version(TARGET)}")


def test_a_corrupt_record_of_a_rolled_back_model_does_not_push_the_rolled_back_version(store: Store) -> None:
    """MEDIUM. A canary was rolled back at 30 % errors (the model kept on OLD while git says
    TARGET). The controller's rollout record is then unreadable (the case load() handles: "the
    model is taken as serving what the catalog says"). On restart the driver sees OLD replicas,
    git at TARGET, no record, and starts a *replace* rollout to TARGET "without analysis":
    the version just rolled back for failing 30 % of requests replaces every replica, even though
    the model's policy is canary. Expected: at least the model's own policy (a canary)."""
    d = run_canary(store, 0.3, 0.0)
    assert d.rollout("m").phase == Phase.ROLLED_BACK
    records = store.rollout_records()
    records["m"] = {**records["m"], "serving": {"not": "a model"}}
    store.save_rollout_records(records)
    d2 = driver(store)
    stable = fleet(make_replica("m-g1", OLD), make_replica("m-g2", OLD, gpu=1))
    plan = d2.plan(Catalog(models=(TARGET,), revision="b" * 40), stable, dict, now=500.0)
    r = d2.rollout("m")
    assert r is None or r.phase != Phase.PROMOTING, (
        f"rolled-back version promoted after an unreadable record: {r.phase.value}, {r.reason!r}; "
        f"the tick runs {model_version(plan.catalog.model('m'))} (TARGET {model_version(TARGET)})")


def test_a_new_version_that_fits_nowhere_is_not_promoted_without_analysis(store: Store) -> None:
    """MEDIUM. A canary change whose new version cannot be placed anywhere (here: 4 GPUs per
    replica on a fleet of 2-GPU nodes; in life a GPU class typo or gpus: 1 -> 2 on a full fleet).
    decide() reports no_canary_room "the new version does not fit even in a stable replica's place"
    and RolloutDriver.decided() treats every no_canary_room alike: "replaced without analysis",
    PROMOTING, serving = the unplaceable version. README promises that only for "a model with a
    single replica and no room". From then on the model's running spec is one that cannot run: any
    old replica lost is never replaced (the model shrinks), and status says promoting forever
    instead of "rolled back: the canary could not be placed"."""
    d = driver(store)
    from dataclasses import replace as dc_replace
    huge = scaled(dc_replace(NEW, profiles=(dc_replace(NEW.profiles[0], gpus=4),)), 2)
    stable = fleet(make_replica("m-g1", OLD), make_replica("m-g2", OLD, gpu=1))
    inv = inventory(node("a", gpus=2))
    d.plan(Catalog(models=(OLD,)), stable, dict, now=0.0)
    plan = d.plan(Catalog(models=(huge,)), stable, dict, now=1.0)
    assert set(plan.canaries) == {"m"}
    dec = decide(plan.catalog, inv, list(stable.values()), last_used={}, demand={}, now=1.0,
                 canaries=plan.canaries, canary_notes=plan.notes)
    assert dec.no_canary_room == {"m": "the new version does not fit even in a stable replica's place"}
    d.decided(dec, {}, now=1.0)
    r = d.rollout("m")
    serving = model_version(d.records["m"].serving)
    assert r.phase != Phase.PROMOTING and serving == model_version(OLD), (
        f"an unplaceable version was promoted: {r.phase.value} ({r.reason!r}); serving is now the new version "
        f"({serving == model_version(huge)})")
    # What that costs: an old replica lost afterwards is replaced by nothing.
    plan = d.plan(Catalog(models=(huge,)), fleet(make_replica("m-g1", OLD)), dict, now=2.0)
    dec = decide(plan.catalog, inv, [make_replica("m-g1", OLD)], last_used={}, demand={}, now=2.0,
                 canaries=plan.canaries, canary_notes=plan.notes)
    assert dec.create, "the model lost a replica and nothing can replace it"


def test_scaling_to_zero_mid_canary_leaves_the_unjudged_canary_with_all_traffic() -> None:
    """MEDIUM. A model with scaling.min 0 and idle_after (the scale-from-zero models of the
    README) in the canary phase at a quiet hour: _scale excludes the canary and idles the stable
    replica out (count 1 > min 0, no inflight); the canary is never idled. From then on the router's
    split has an empty stable track and sends EVERY request to the unjudged canary, no held
    request ever wakes a stable replica (the canary is ready), and judge() waits for stable
    requests forever. Expected: a model with a canary keeps a stable replica (or the canary goes)."""
    from dataclasses import replace as dc_replace

    from llmgw.catalog import Scaling
    old = dc_replace(scaled(OLD, 1), scaling=Scaling(min=0, max=2, idle_after=60.0, target_inflight=4))
    new = dc_replace(old, profiles=NEW.profiles)
    stable = make_replica("m-g1", old)
    canary = make_replica("m-g2", new, gpu=1, canary=True)
    dec = decide(Catalog(models=(old,)), inventory(node("a", gpus=4)), [stable, canary],
                 last_used={"m-g1": 0.0, "m-g2": 0.0}, demand={}, now=1000.0,
                 canaries={"m": CanaryWant(spec=new)})
    stopped = dict(dec.stop)
    assert not ("m-g1" in stopped and "m-g2" not in stopped), (
        f"the only stable replica stopped ({stopped.get('m-g1')!r}) while the canary stays: the canary "
        "alone serves the model")


def test_llmgw_diff_does_not_announce_a_rollout_the_controller_will_not_start(store: Store) -> None:
    """MEDIUM (diff tells an untruth). A canary of TARGET was rolled back: git says TARGET, the
    replicas run OLD. The next commit changes only the model's scaling (not its engines). README:
    only "the next commit that changes this model's engines starts a new rollout", and the
    controller indeed keeps it rolled back. `llmgw diff` (plan_rollouts) compares the head's
    engines with the running replicas' fingerprints and announces a canary rollout with its steps
    and "at least" duration, which never happens."""
    from llmgw.plan.rollouts import plan_rollouts

    d = run_canary(store, 0.3, 0.0)
    assert d.rollout("m").phase == Phase.ROLLED_BACK
    head = scaled(NEW, 3)  # same engines as TARGET, one more replica
    reps = [make_replica("m-g1", OLD), make_replica("m-g2", OLD, gpu=1)]
    plan = d.plan(Catalog(models=(head,), revision="d" * 40), fleet(*reps), dict, now=900.0)
    assert d.rollout("m").phase == Phase.ROLLED_BACK and plan.canaries == {}  # the controller: nothing starts
    shown = plan_rollouts(Catalog(models=(TARGET,)), Catalog(models=(head,)), inventory(node("a", gpus=8)),
                          reps, now=900.0)
    assert shown == (), f"llmgw diff announces: {[p.text() for p in shown]}"


def test_a_quick_fix_is_not_rolled_back_for_the_failures_of_the_canary_it_supersedes(store: Store) -> None:
    """LOW-MEDIUM (two quick commits). Commit B's canary fails to start (its second failure
    recorded by the lifecycle at the end of a tick); the author pushes fix C before the next tick.
    The next plan aborts B's rollout ("superseded"), starts A->C, and _advance picks 'the' canary as
    the first live canary replica of the model: B's, FAILED with 2 failures. C is rolled back at
    once with B's error, and stays rolled back until yet another commit or an operator's promote."""
    d = driver(store)
    stable = [make_replica("m-g1", OLD), make_replica("m-g2", OLD, gpu=1)]
    d.plan(Catalog(models=(OLD,)), fleet(*stable), dict, now=0.0)
    d.plan(Catalog(models=(TARGET,), revision="b" * 40), fleet(*stable), dict, now=1.0)
    d.decided(Decisions(), {"m": "m-g3"}, now=1.0)
    b_canary = make_replica("m-g3", TARGET, gpu=2, canary=True, state=ReplicaState.FAILED)
    b_canary = dc_replace(b_canary, failures=2, error="exited with code 1: unknown flag --new")
    from dataclasses import replace as _r
    fix = scaled(_r(NEW, profiles=(_r(NEW.profiles[0], args=("--fixed",)),)), 2)
    d.plan(Catalog(models=(fix,), revision="c" * 40), fleet(*stable, b_canary), dict, now=5.0)
    r = d.rollout("m")
    assert r.target == model_version(fix)
    assert r.phase == Phase.CANARY, f"the fix was {r.phase.value}: {r.reason!r}"


def test_an_operators_abort_of_a_promotion_with_no_previous_version_stops_it(store: Store) -> None:
    """LOW-MEDIUM. A promotion the driver started on first sight (no record: a controller upgraded
    from before rollouts were kept, or the unreadable record above) has no ``previous``. `llmgw
    rollout abort` answers "aborted" (API 200, event rollout-aborted), but abort() leaves
    ``serving`` at the new version, so the next plan finds git == serving, drops the record, and the
    tick goes on replacing every replica: the abort silently did nothing."""
    from tests.reconciler.test_rollout_decide import REPLACE
    d = driver(store)
    old, target = scaled(OLD, 2, REPLACE), scaled(TARGET, 2, REPLACE)
    stable = fleet(make_replica("m-g1", old), make_replica("m-g2", old, gpu=1))
    d.plan(Catalog(models=(target,), revision="b" * 40), stable, dict, now=1.0)
    assert d.rollout("m").phase == Phase.PROMOTING  # "the version its replicas run is not known: replaced"
    from llmgw.reconciler.rollouts import RolloutError
    try:
        shown = d.abort("m", "alice")
    except RolloutError:
        return  # an honest refusal ("the version before is not known") is a fine answer too
    assert shown.phase == Phase.ABORTED
    plan = d.plan(Catalog(models=(target,), revision="b" * 40), stable, dict, now=2.0)
    assert model_version(plan.catalog.model("m")) != model_version(target), (
        f"aborted, yet the tick still rolls out the new version (rollout now {d.rollout('m')})")


def test_a_rollout_record_that_is_not_json_does_not_stop_the_controller(store: Store) -> None:
    """LOW-MEDIUM (a corrupt rollout record). RolloutDriver.load() promises "a record this llmgw
    cannot read must not stop the controller" and catches KeyError/TypeError/ValueError around
    ModelRecord.from_json, but Store.rollout_records() json.loads every row *before* that, outside
    the try: one row that is not JSON (a torn write restored from backup, a hand edit) raises
    JSONDecodeError out of load(), i.e. out of the reconciler's start."""
    d = run_canary(store, 0.0, 0.0)
    d.save()
    store.db.execute("INSERT INTO rollouts(model, record) VALUES(?, ?)", ("other", "{not json"))
    fresh = RolloutDriver(store, clock=lambda: 0.0)
    fresh.load()  # raises json.JSONDecodeError today
    assert "m" in fresh.records


def test_a_router_rotating_its_process_id_does_not_push_out_the_readings_of_the_others() -> None:
    """Each report under a new process id: kept in a bounded memory, but the least recently read go
    first, so a router read at every tick keeps its last reading (else its next one would count its
    whole life again: a canary's figures doubled by one hostile router)."""
    from llmgw.contract import ReplicaStats
    from llmgw.reconciler.rollouts import MAX_SOURCES, StatsMeter

    meter = StatsMeter()
    honest = ReplicaStats(requests=10)
    meter.fold({"honest": {"r1": honest}}, ["r1"])
    for i in range(MAX_SOURCES + 50):
        meter.fold({"honest": {"r1": honest}, f"rotating-{i}": {"r1": ReplicaStats()}}, ["r1"])
    assert meter.total("r1").requests == 10  # counted once, not again after an eviction
    assert meter.forgotten == 51  # 1,051 processes read, 1,000 remembered
