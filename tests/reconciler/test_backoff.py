"""next_failure(): how many failures in a row, how long until the next start, a crash loop, and
when a replica that served long enough starts its count afresh (the boundary included)."""

from __future__ import annotations

from dataclasses import replace

from llmgw.decide.replica import Backoff, ReplicaState, next_failure
from tests.reconciler.test_decide import replica

POLICY = Backoff(base=2.0, cap=120.0, reset_after=600.0, crash_loop_after=5)


def test_the_delay_doubles_up_to_its_cap_and_the_fifth_failure_is_a_crash_loop() -> None:
    r = replica("m-g1", state=ReplicaState.STARTING)
    seen = []
    for n in range(8):
        f = next_failure(replace(r, failures=n), 100.0, POLICY)
        seen.append((f.count, f.delay, f.crash_loop))
    assert seen == [(1, 2.0, False), (2, 4.0, False), (3, 8.0, False), (4, 16.0, False), (5, 32.0, True),
                    (6, 64.0, True), (7, 120.0, True), (8, 120.0, True)]


def test_a_replica_that_served_reset_after_seconds_starts_its_count_afresh() -> None:
    served = replica("m-g1", state=ReplicaState.READY, ready_since=1000.0, failures=4)
    at_boundary = next_failure(served, 1600.0, POLICY)
    assert (at_boundary.count, at_boundary.forgot, at_boundary.ran) == (1, True, 600.0)
    just_before = next_failure(served, 1599.9, POLICY)
    assert (just_before.count, just_before.forgot, just_before.crash_loop) == (5, False, True)


def test_only_time_serving_counts() -> None:
    # Starting for an hour is not serving: the count goes on.
    starting = replica("m-g1", state=ReplicaState.STARTING, ready_since=0.0, failures=2)
    f = next_failure(starting, 10_000.0, POLICY)
    assert (f.count, f.forgot, f.ran) == (3, False, 0.0)
    # A first failure has nothing to forget.
    fresh = replica("m-g1", state=ReplicaState.READY, ready_since=0.0, failures=0)
    assert next_failure(fresh, 10_000.0, POLICY).forgot is False


def test_a_node_config_change_retries_a_failed_replica_once_per_failure_and_never_in_a_crash_loop() -> None:
    """A digest that changes at every poll (a tool stamping the node's config file) must not turn
    the backoff into a start every tick: the count goes on, and a crash loop keeps its backoff."""
    from llmgw.inventory import Inventory
    from llmgw.reconciler.config import ReconcilerConfig
    from llmgw.reconciler.lifecycle import Lifecycle
    from tests.placement.fleet import node

    class Events:
        def __init__(self) -> None:
            self.kinds: list[str] = []

        def add_event(self, kind: str, subject: str, message: str) -> None:
            self.kinds.append(kind)
            assert subject and message

        def weight_digests(self) -> dict[str, str]:
            return {}  # no entry was read from the origin yet

    def fleet(digest: str) -> Inventory:
        n = node("a")
        return Inventory({"a": replace(n, report=replace(n.report, settings=digest))}, 0.0)

    events = Events()
    life = Lifecycle(None, None, events, ReconcilerConfig(), clock=lambda: 0.0)  # type: ignore[arg-type]
    failed = replace(replica("m-g1"), state=ReplicaState.FAILED, state_since=100.0, retry_at=200.0, failures=2)
    assert life._retry_if_settings_changed(failed, fleet("d1"), 110.0) == failed  # noqa: SLF001 - seen as it was
    retried = life._retry_if_settings_changed(failed, fleet("d2"), 120.0)  # noqa: SLF001
    assert (retried.retry_at, retried.failures, events.kinds) == (120.0, 2, ["replica-retry"])
    looping = replace(failed, failures=ReconcilerConfig().crash_loop_after, state_since=300.0, retry_at=400.0)
    for i, digest in enumerate(("d3", "d4", "d5")):
        assert life._retry_if_settings_changed(looping, fleet(digest), 310.0 + i) == looping  # noqa: SLF001
    assert events.kinds == ["replica-retry"]


def test_a_replica_whose_port_another_process_listens_on_is_started_again() -> None:
    """Two agents of one machine picked one port before either engine bound it, and both engines
    bound it (SO_REUSEPORT): the kernel shared the connections, and a vLLM model was answered by
    llama.cpp. A replica whose engine's port has another listener is started again elsewhere."""
    from llmgw.inventory import EngineRecord, Inventory
    from llmgw.reconciler.config import ReconcilerConfig
    from llmgw.reconciler.lifecycle import Lifecycle
    from tests.placement.fleet import node

    class Events:
        def __init__(self) -> None:
            self.said: list[tuple[str, str, str]] = []

        def add_event(self, kind: str, subject: str, message: str) -> None:
            self.said.append((kind, subject, message))

        def weight_digests(self) -> dict[str, str]:
            return {}

    from llmgw.decide.replica import ShardStatus

    shard = ShardStatus("a", 0, (0,), "m-g1", pid=4242, port=39001, endpoint="http://127.0.0.1:39001", state="started")
    ready = replica("m-g1", state=ReplicaState.READY, shards=(shard,))

    def fleet(shared: int | None) -> Inventory:
        n = node("a")
        engine = EngineRecord(replica_id=shard.agent_id, pid=4242, port=39001, endpoint="http://127.0.0.1:39001",
                              engine="vllm", alive=True, port_shared_with=shared)
        return Inventory({"a": replace(n, report=replace(n.report, engines=(engine,)))}, 0.0)

    events = Events()
    life = Lifecycle(None, None, events, ReconcilerConfig(), clock=lambda: 0.0)  # type: ignore[arg-type]
    assert life.observe(ready, fleet(0), 10.0) == ready
    assert life.observe(ready, fleet(None), 10.0) == ready  # not told (the agent could not read its processes)
    failed = life.observe(ready, fleet(1), 10.0)
    assert failed.state == ReplicaState.FAILED
    assert "port 39001 on a is shared with 1 socket(s) of another process" in (failed.error or "")
    assert [(k, s) for k, s, _m in events.said] == [("replica-failed", "m-g1")]


def test_an_engine_is_not_taken_for_gone_on_a_report_from_before_it_started() -> None:
    """A node whose poll failed keeps its last report, which may be from before the engine
    started: the poll's own time said fresh, and a loading engine was failed as gone (its node
    answered again, and it was stopped) because one SSH call timed out. Gone means the node said
    so in an answer asked for after the engine started."""
    from llmgw.inventory import Inventory
    from llmgw.reconciler.config import ReconcilerConfig
    from llmgw.reconciler.lifecycle import Lifecycle
    from tests.placement.fleet import node

    class Events:
        def add_event(self, kind: str, subject: str, message: str) -> None:
            pass

        def weight_digests(self) -> dict[str, str]:
            return {}

    from llmgw.decide.replica import ShardStatus

    shard = ShardStatus("a", 0, (0,), "m-g1", pid=4242, port=39001, endpoint="http://127.0.0.1:39001", state="started")
    starting = replace(replica("m-g1", state=ReplicaState.STARTING, shards=(shard,)), state_since=100.0)
    before = node("a")  # its report lists no engine: asked at 50, before the start at 100
    life = Lifecycle(None, None, Events(), ReconcilerConfig(), clock=lambda: 0.0)  # type: ignore[arg-type]
    timed_out = replace(before, last_seen=50.0, unreachable_since=120.0)
    assert life.observe(starting, Inventory({"a": timed_out}, 130.0), 130.0) == starting
    # Answered (and asked) before the start, polled since without an answer recorded yet: not gone.
    assert life.observe(starting, Inventory({"a": replace(before, last_seen=50.0)}, 130.0), 130.0) == starting
    # Asked after the start, and it knows no such engine: gone.
    gone = life.observe(starting, Inventory({"a": replace(before, last_seen=110.0)}, 130.0), 130.0)
    assert gone.state == ReplicaState.FAILED and "is gone (pid 4242)" in (gone.error or "")
