"""The id bookkeeping shared by both transports, and the remote command's quoting."""

from __future__ import annotations

import asyncio
import json
import shlex

import pytest

from llmgw.dispatch.base import AgentFile, NodeTarget, decode_answer, encode_request
from llmgw.dispatch.channel import PendingCalls, split_lines
from llmgw.dispatch.sshconn import SshConnection
from llmgw.errors import AgentError, NodeUnreachable


async def test_answers_resolve_by_id_in_any_order() -> None:
    pending = PendingCalls("n1")
    (id1, f1), (id2, f2) = pending.add(), pending.add()
    pending.feed([json.dumps({"id": id2, "answer": {"x": 2}}).encode(), b"", b"not json"])
    pending.feed([json.dumps({"id": id1, "answer": {"x": 1}}).encode()])
    assert (await f1)["answer"] == {"x": 1}
    assert (await f2)["answer"] == {"x": 2}
    assert len(pending) == 0


async def test_a_late_answer_for_a_discarded_call_is_dropped() -> None:
    pending = PendingCalls("n1")
    request_id, future = pending.add()
    pending.discard(request_id)
    pending.feed([json.dumps({"id": request_id, "answer": {}}).encode()])
    assert not future.done()


async def test_fail_all_fails_waiting_and_later_calls() -> None:
    pending = PendingCalls("n1")
    _, future = pending.add()
    pending.fail_all(NodeUnreachable("n1: gone"))
    with pytest.raises(NodeUnreachable, match="gone"):
        await future
    with pytest.raises(NodeUnreachable, match="gone"):
        pending.add()


def test_split_lines_keeps_the_partial_tail() -> None:
    buffer = bytearray()
    assert split_lines(buffer, b'{"a"') == []
    assert split_lines(buffer, b':1}\n{"b"') == [b'{"a":1}']
    assert split_lines(buffer, b":2}\n") == [b'{"b":2}']
    assert buffer == b""


def test_request_and_answer_encoding() -> None:
    line = encode_request(7, "fetch", {"source": "file:///x"})
    assert line.endswith(b"\n") and json.loads(line) == {"id": 7, "verb": "fetch", "request": {"source": "file:///x"}}
    assert decode_answer("n", "fetch", {"id": 7, "answer": {"ok": 1}}) == {"ok": 1}
    with pytest.raises(AgentError, match="n: fetch: no such file"):
        decode_answer("n", "fetch", {"id": 7, "error": "no such file"})
    with pytest.raises(AgentError, match="malformed"):
        decode_answer("n", "fetch", {"id": 7, "answer": [1]})


def test_remote_command_is_fixed_tokens_each_quoted() -> None:
    agent = AgentFile(path=None, data=b"", sha256="ab" * 32)  # type: ignore[arg-type]
    hostile = "/etc/llmgw/a b.json; touch /tmp/pwned"
    conn = SshConnection(NodeTarget("n", "h", agent_config=hostile), agent, agent_dir="/opt/x y")
    assert shlex.split(conn.command()) == [
        "python3",
        f"/opt/x y/llmgw_agent-{'ab' * 6}.py",
        "--config",
        hostile,
        "serve",
    ]
    plain = SshConnection(NodeTarget("n", "h"), agent)
    assert shlex.split(plain.command()) == ["python3", f".llmgw/llmgw_agent-{'ab' * 6}.py", "serve"]


def test_pending_calls_need_a_running_loop() -> None:
    with pytest.raises(RuntimeError):
        PendingCalls("n").add()
    asyncio.run(asyncio.sleep(0))


async def test_a_call_queued_behind_a_slow_one_is_not_a_silent_node() -> None:
    pending = PendingCalls("n1")
    (first, _), (second, _) = pending.add(), pending.add()
    assert pending.queued_behind(second) and not pending.queued_behind(first)
    pending.discard(first)
    assert not pending.queued_behind(second)
