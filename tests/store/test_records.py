"""Every record the controller keeps comes back as it was written, from either store, to the same
store and to another opened on the same data after (a restarted controller, or a standby)."""

from __future__ import annotations

import threading

from llmgw.catalog import Problem
from llmgw.decide.replica import Replica, ReplicaState, ShardStatus
from llmgw.placement.types import Placement, Shard
from llmgw.store.protocol import Store
from llmgw.store.records import Applied, History, PendingPrune, Rejection, Rewrite
from tests.store.conftest import Backend


def replica(rid: str, *, generation: int = 1, nodes: tuple[str, ...] = ("n1",)) -> Replica:
    shards = tuple(Shard(n, rank, (rank,), rank == 0) for rank, n in enumerate(nodes))
    return Replica(
        id=rid, model="chat", profile="cpu",
        placement=Placement("chat", "cpu", shards, memory_gb=1.5, size_gb=0.25, weights="sha256-abc"),
        generation=generation, fingerprint="f" * 16, state=ReplicaState.READY,
        shards=tuple(ShardStatus(n, rank, (rank,), f"{rid}-r{rank}", pid=100 + rank, port=9000 + rank,
                                 endpoint=f"http://10.0.0.{rank + 1}:{9000 + rank}", state="started")
                     for rank, n in enumerate(nodes)),
        created_at=1.5, state_since=2.25, ready_since=3.0, error="once: ünïcode ✓", failures=2, retry_at=None,
        replaces="old-1", stop_reason=None, adopted=True, revision="c" * 40, canary=True,
    )


REJECTION = Rejection("d" * 40, "Ann <ann@example.com>", "A broken model", 12.5,
                      (Problem("models/x.yaml", 3, 7, "unknown key 'foo'"), Problem("llmgw.yaml", 1, 1, "bad")))
PENDING = PendingPrune("b" * 40, "Bob", "Remove all", ("removes 3 of 3 models", "stops 2 ready replicas"))
REWRITE = Rewrite(History.FORCE_PUSH, "e" * 40, "f" * 40, 99.0)


def write_everything(store: Store) -> None:
    store.set_applied(Applied("a" * 40, 12.5, "https://git.example.com/catalog.git main"))
    store.set_pending(PENDING)
    store.set_rejected(REJECTION)
    store.set_judged("d" * 40)
    store.set_rewrite(REWRITE)
    store.save_replicas([replica("chat-g2", generation=2, nodes=("n1", "n2")), replica("chat-g1")])
    store.save_rollout_records({"chat": {"stable": {"fingerprint": "f" * 16}, "rollout": {"phase": "canary",
                                                                                          "weight": 0.25}}})
    store.set_node_state("n1", "cordoned")
    store.set_node_state("n2", "draining")
    store.set_controller_id("ctl-a-1234")
    store.next_generation(above=6)


def assert_everything(store: Store) -> None:
    assert store.applied() == Applied("a" * 40, 12.5, "https://git.example.com/catalog.git main")
    assert store.pending() == PENDING
    assert store.rejected() == REJECTION
    assert store.judged() == "d" * 40
    assert store.rewrite() == REWRITE
    assert store.replicas() == [replica("chat-g1"), replica("chat-g2", generation=2, nodes=("n1", "n2"))]  # by id
    assert store.rollout_records() == {"chat": {"stable": {"fingerprint": "f" * 16},
                                                "rollout": {"phase": "canary", "weight": 0.25}}}
    assert store.node_states() == {"n1": "cordoned", "n2": "draining"}
    assert store.controller_id() == "ctl-a-1234"
    assert store.generation() == 7


def test_a_fresh_store_holds_nothing(store: Store) -> None:
    assert (store.applied(), store.pending(), store.rejected(), store.judged(), store.rewrite()) == (None,) * 5
    assert store.replicas() == [] and store.rollout_records() == {} and store.node_states() == {}
    assert store.controller_id() is None and store.generation() == 0
    assert store.events() == [] and store.usage(0, 2 ** 40) == []


def test_every_record_round_trips_and_survives_a_restart(backend: Backend) -> None:
    first = backend.open()
    write_everything(first)
    assert_everything(first)
    first.close()
    assert_everything(backend.open())


def test_a_second_store_on_the_same_data_reads_what_the_first_wrote(backend: Backend) -> None:
    """Two controllers on one store (PostgreSQL) or a restart overlapping its predecessor (SQLite)."""
    a, b = backend.open(), backend.open()
    write_everything(a)
    assert_everything(b)


def test_a_cleared_record_is_gone_and_a_save_replaces_the_whole_set(store: Store) -> None:
    write_everything(store)
    store.set_pending(None)
    store.set_rejected(None)
    store.set_judged(None)
    store.set_rewrite(None)
    store.set_node_state("n1", None)
    store.set_node_state("n2", "cordoned")
    store.save_replicas([replica("chat-g9", generation=9)])
    store.save_rollout_records({})
    assert (store.pending(), store.rejected(), store.judged(), store.rewrite()) == (None,) * 4
    assert store.node_states() == {"n2": "cordoned"}
    assert [r.id for r in store.replicas()] == ["chat-g9"] and store.rollout_records() == {}
    store.save_replicas([])
    assert store.replicas() == []


def test_a_torn_rollout_row_is_left_out_not_fatal(backend: Backend, store: Store) -> None:
    store.save_rollout_records({"chat": {"phase": "stable"}})
    backend.sql("INSERT INTO rollouts(model, record) VALUES(?, ?)", ("other", "{not json"))
    assert store.rollout_records() == {"chat": {"phase": "stable"}}


def test_generations_only_grow_and_never_repeat_across_threads_and_stores(backend: Backend) -> None:
    a, b = backend.open(), backend.open()
    assert [a.next_generation() for _ in range(3)] == [1, 2, 3]
    assert b.next_generation(above=10) == 11 and a.next_generation(above=2) == 12 and a.generation() == 12
    got: list[int] = []
    lock = threading.Lock()

    def take(store: Store) -> None:
        for _ in range(20):
            g = store.next_generation()
            with lock:
                got.append(g)

    threads = [threading.Thread(target=take, args=(s,)) for s in (a, a, b, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(got) == list(range(13, 93))  # 80 generations, none twice, none skipped


def test_api_keys_are_added_once_revoked_by_replacement_and_read_back_by_another_opener(backend: Backend) -> None:
    first = backend.open()
    entry = {"name": "team-a", "sha256": "ab" * 32, "models": ["chat"], "created_at": 1.5}
    assert first.add_api_key(entry)
    assert not first.add_api_key({**entry, "sha256": "cd" * 32})  # a name is made once
    assert not first.replace_api_key("ghost", {"name": "ghost", "revoked_at": 2.0})
    second = backend.open()  # a standby, or the same controller restarted
    assert second.api_keys() == [entry]
    assert second.replace_api_key("team-a", {"name": "team-a", "revoked_at": 2.0})
    assert first.api_keys() == [{"name": "team-a", "revoked_at": 2.0}]
