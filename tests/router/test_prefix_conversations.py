"""Prefix affinity on multi-turn conversations (issue 30), the pure part: a turn's key extends the
previous turn's whatever the messages carry, so the replica that served a conversation's last turn
holds the longest start of its next one and keeps it while load allows; beyond the load bound the
conversation moves once and then stays where it went. The real engines' side is in
tests/e2e/test_prefix_conversations_llamacpp.py."""

from __future__ import annotations

import random

from llmgw.contract import Endpoint
from llmgw.router.prefix import PrefixIndex, PromptKey, prompt_key
from llmgw.router.routes import RouteModel
from llmgw.router.table import EMPTY, EndpointTable, build_table, choose

PREFIX = RouteModel("m", routing="prefix")
WORDS = "river stone cloud paper green light market winter signal garden".split()


def fleet(n: int = 2) -> EndpointTable:
    return build_table([Endpoint(replica_id=f"r{i}", model="m", names=("m",), url=f"http://r{i}", engine="llama.cpp",
                                 profile="cpu", priority=0) for i in range(n)], EMPTY)


def key(messages: list[dict]) -> PromptKey:
    k = prompt_key({"model": "m", "messages": messages}, chat=True)
    assert k is not None
    return k


def send(t: EndpointTable, prompt: PromptKey) -> str:
    """What the router does per request: choose, then record the prompt on the chosen replica."""
    choice = choose(t, (PREFIX,), 0.0, random.Random(0), (), prompt)
    assert choice is not None
    up = choice[1]
    if up.prefixes is None:
        up.prefixes = PrefixIndex(16384)
    up.prefixes.record(prompt.hashes)
    return up.replica_id


def words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def test_each_turn_extends_the_previous_turns_key_whatever_the_messages_carry() -> None:
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    turns: list[list[dict]] = [[{"role": "system", "content": words(1, 80)}, {"role": "user", "content": "hi " * 30}]]
    later: list[list[dict]] = [
        [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{\"q\": \"x\"}"}}]}],
        [{"role": "tool", "tool_call_id": "c1", "content": words(2, 40)}],
        [{"role": "assistant", "content": [{"type": "text", "text": words(3, 30)}]},
         {"role": "user", "content": [{"type": "text", "text": "and then?"}]}],
    ]
    for added in later:
        turns.append(turns[-1] + added)
    keys = [prompt_key({"messages": m, "tools": tools}, chat=True) for m in turns]
    for before, after in zip(keys, keys[1:], strict=False):
        assert before is not None and after is not None
        # Every whole block of the shorter prompt is a block of the longer one.
        assert after.hashes[:len(before.hashes)] == before.hashes and len(after.hashes) > len(before.hashes)


def test_interleaved_conversations_each_stay_on_the_replica_of_their_previous_turn() -> None:
    t = fleet(2)
    shared = words(0, 200)
    # Two conversations share a chat application's system prompt, two open with their own.
    histories = [[{"role": "system", "content": s}] for s in (shared, shared, words(5, 200), words(6, 200))]
    served: dict[int, list[str]] = {c: [] for c in range(4)}
    for turn in range(6):
        for c, h in enumerate(histories):
            h.append({"role": "user", "content": f"turn {turn} " + words(100 * c + turn, 30)})
            served[c].append(send(t, key(h)))
            h.append({"role": "assistant", "content": words(1000 * c + turn, 20)})
    for c, replicas in served.items():
        assert replicas == [replicas[0]] * 6, (c, served)
    assert {r[0] for r in served.values()} == {"r0", "r1"}  # new conversations spread


def test_within_the_load_bound_a_conversation_waits_for_its_replica_beyond_it_moves_once() -> None:
    t = fleet(2)
    history: list[dict] = [{"role": "system", "content": words(7, 200)}, {"role": "user", "content": words(8, 30)}]
    home = send(t, key(history))
    other = "r1" if home == "r0" else "r0"
    ups = t.upstreams

    def next_turn(n: int) -> str:
        history.extend([{"role": "assistant", "content": words(9 + n, 20)}, {"role": "user", "content": words(n, 30)}])
        return send(t, key(history))

    ups[home].inflight = 4  # busier by the bound (4): still the replica that holds the conversation
    assert next_turn(1) == home
    ups[home].inflight = 5  # beyond it: load wins, the other replica computes the conversation ...
    assert next_turn(2) == other
    ups[home].inflight = 0
    ups[other].inflight = 1  # ... and now holds its longest start: it stays there, though busier
    assert next_turn(3) == other
    assert next_turn(4) == other


def test_a_conversation_on_a_model_with_a_canary_stays_within_the_drawn_track() -> None:
    eps = [Endpoint(replica_id=f"r{i}", model="m", names=("m",), url=f"http://r{i}", engine="llama.cpp",
                    profile="cpu", priority=0, canary=i >= 2, canary_percent=50.0) for i in range(4)]
    t = build_table(eps, EMPTY)
    history: list[dict] = [{"role": "system", "content": words(11, 200)}, {"role": "user", "content": words(12, 30)}]
    for draw, track in ((0.1, {"r2", "r3"}), (0.9, {"r0", "r1"})):
        choice = choose(t, (PREFIX,), 0.0, random.Random(0), (), key(history), draw=draw)
        assert choice is not None and choice[1].replica_id in track
        up = choice[1]
        if up.prefixes is None:
            up.prefixes = PrefixIndex(1000)
        up.prefixes.record(key(history).hashes)
    # The conversation is held on one replica of each track now; a draw picks the track first,
    # affinity then holds within it.
    history += [{"role": "assistant", "content": words(13, 20)}, {"role": "user", "content": words(14, 30)}]
    held = {u.replica_id for u in t.upstreams.values() if u.prefixes is not None}
    for draw in (0.1, 0.9):
        choice = choose(t, (PREFIX,), 0.0, random.Random(0), (), key(history), draw=draw)
        assert choice is not None and choice[1].replica_id in held
