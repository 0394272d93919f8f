"""Reading request bodies (llmgw.router.parse, llmgw.jsonbody): the pure parts.

The worker's summary of a big body must mean, to the router and to the engine, exactly what the
whole body means: the members the router reads parsed alike, every other member written out
again byte for byte, the same errors for the same bad bodies, the same prompt key."""

from __future__ import annotations

import json

import pytest

from llmgw import jsonbody
from llmgw.router.app import READS
from llmgw.router.parse import BULK_BYTES, MAX_PIECES, BadBody, is_small, parse_body, summarise
from llmgw.router.prefix import prompt_key
from llmgw.tenancy.asked import asked_for

CHARS = 64 * 512


def summary_body(raw: bytes, kind: str | None = "chat") -> dict:
    s = summarise(raw, kind, READS, CHARS)
    assert s.error is None, s.error
    return s.parsed(raw).body


def written(body: dict) -> object:
    return json.loads(jsonbody.dumps(body))


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


BIG = "x" * (BULK_BYTES + 10)
BODIES = [
    {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    {"model": "m", "stream": True, "messages": [{"role": "user", "content": "é ☃ \U0001F600 \"q\" \\ \n"}] * 50,
     "max_tokens": 7, "n": 2, "temperature": 0.5, "tools": [{"type": "function", "function": {"name": "f"}}]},
    {"model": "m", "prompt": [BIG, "b", "c"], "max_tokens": "12"},  # a batch too big to come back parsed
    {"model": "m", "prompt": list(range(9000))},  # one prompt of token ids
    {"model": "m", "stream_options": {"include_usage": False, "pad": BIG}, "extra": {"deep": [[[1]]]}},
    {"model": "m", "input": [BIG] * 3, "x-unknown": None},
]


@pytest.mark.parametrize("body", BODIES)
def test_a_summarised_body_reads_and_writes_like_the_whole_one(body: dict) -> None:
    raw = json.dumps(body, ensure_ascii=False).encode()
    whole, model, stream = parse_body(raw)
    s = summarise(raw, "chat", READS, CHARS)
    got = s.parsed(raw)
    assert (got.model, got.stream) == (model, stream)
    assert written(got.body) == whole  # what the engine gets: every member, each as it came
    assert written({**got.body, "model": "other"}) == {**whole, "model": "other"}
    for name in READS:  # what the router reads: parsed alike (or, too big, as text it does not read)
        if name in whole and len(json.dumps(whole[name])) <= BULK_BYTES:
            assert got.body[name] == whole[name], name
    assert asked_for(got.body) == asked_for(whole)  # admission: the same reservation
    # Nothing the router does not read comes back as an object: one run of text.
    assert all(k in READS or k == jsonbody.REST for k in got.body)


def test_the_raw_text_of_members_is_kept_byte_for_byte() -> None:
    raw = b'{ "model" : "m",\n  "messages": [ {"role":"user", "content":"1e400 \\ud83d"} ], "n": 1.0, "x": 1e400 }'
    body = summary_body(raw)
    assert jsonbody.dumps(body) == b'{"model":"m","n":1.0,"messages": [ {"role":"user", "content":"1e400 \\ud83d"} ],' \
                                   b'"x": 1e400}'


def test_a_repeated_name_counts_once_with_its_last_value_as_json_reads_it() -> None:
    raw = b'{"model": "a", "max_tokens": 1, "messages": [], "max_tokens": 50000, "messages": [1], "model": "b"}'
    body = summary_body(raw)
    assert body["model"] == "b" and body["max_tokens"] == 50000
    assert written(body) == json.loads(raw)
    # A member read is written once, as read; one not read goes as it came (the engine reads it as json does).
    assert jsonbody.dumps(body).count(b'"max_tokens"') == 1 and jsonbody.dumps(body).count(b'"model"') == 1


@pytest.mark.parametrize("raw", [
    '{"model": "m", "\\u006dax_tokens": 5, "messages": []}'.encode(),  # an escaped name is the name
    '\ufeff{"model": "m"}'.encode("utf-8"),  # a UTF-8 byte order mark
    '{"model": "m", "messages": [{"role": "user", "content": "é"}]}'.encode("utf-16"),
    '{"model": "m", "messages": [{"role": "user", "content": "é"}]}'.encode("utf-32-le"),
])
def test_encodings_and_escapes_json_reads_are_read_alike(raw: bytes) -> None:
    body = summary_body(raw)
    assert written(body) == parse_body(raw)[0]
    if b"max_tokens" in raw or b"\\u006d" in raw:
        assert body["max_tokens"] == 5


@pytest.mark.parametrize("raw", [
    b'', b'[1, 2]', b'{"model": 7}', b'{"model": "m", "stream": "no"}', b'{"model": "m",}', b'{"model": "m"} x',
    b'{"model": "m" "n": 1}', b'{model: "m"}', b'{"model": "' + b"m" * 300 + b'"}',
    b'\xff\xfe\x00', b'{"model": "m", "x": ' + nested(70) + b"}",
    b'{"model": "m", "x": ' + nested(976) + b"}", b'{"model": "m", "x": ' + nested(100_000) + b"}", nested(100_000),
])
def test_bad_bodies_get_the_same_error_either_way(raw: bytes) -> None:
    with pytest.raises(BadBody) as inline:
        parse_body(raw)
    s = summarise(raw, "chat", READS, CHARS)
    assert s.error == (str(inline.value), inline.value.code)


def test_the_depth_limit_is_named_and_the_limit_itself_is_a_request() -> None:
    ok = b'{"model": "m", "x": ' + nested(jsonbody.MAX_DEPTH - 1) + b"}"  # the object is one level
    assert parse_body(ok)[0]["model"] == "m" and summarise(ok, None, READS, CHARS).error is None
    for depth in (jsonbody.MAX_DEPTH, 976, 100_000):
        deep = b'{"model": "m", "x": ' + nested(depth) + b"}"
        with pytest.raises(BadBody, match=r"more than 64 levels deep \(the limit\)"):
            parse_body(deep)
        error = summarise(deep, None, READS, CHARS).error
        assert error is not None and "more than 64 levels deep" in error[0]


def test_the_prompt_key_of_a_summary_is_the_whole_bodys() -> None:
    messages = [{"role": "system", "content": "You are terse. " * 200}] + \
        [{"role": "user", "content": f"question {i} " * 40} for i in range(400)]
    body = {"model": "m", "messages": messages, "tools": [{"type": "function", "function": {"name": "f"}}]}
    raw = json.dumps(body).encode()
    text = summarise(raw, "chat", READS, CHARS).prompt
    assert text is not None and len(text) == CHARS
    assert prompt_key({"prompt": text}, False) == prompt_key(body, True)
    completion = {"model": "m", "prompt": "once upon a time " * 5000}
    text = summarise(json.dumps(completion).encode(), "prompt", READS, CHARS).prompt
    assert prompt_key({"prompt": text}, False) == prompt_key(completion, False)


def test_which_bodies_are_parsed_inline() -> None:
    assert is_small(b"[" + b"1," * 4000 + b"1]")  # 8 KB: always
    assert is_small(json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 200_000}]}).encode())
    assert not is_small(b"[" + b"[]," * 10_000 + b"[]]")  # 30 KB of tiny arrays: 20,000 values
    assert not is_small(json.dumps({"model": "m", "prompt": "x" * 300_000}).encode())  # above 256 KiB


def test_dumps_keeps_a_lone_surrogate_as_its_escape() -> None:
    assert jsonbody.dumps({"a": "\ud83d", "b": "é"}) == b'{"a":"\\ud83d","b":"\\u00e9"}'
    assert jsonbody.dumps({"a": "é"}) == '{"a":"é"}'.encode()


def test_whatever_the_shape_the_summary_is_a_few_objects() -> None:
    """What comes back to the router is unpickled on its event loop: it must be small in objects
    however the body is cut (members up to the router's limit; a member read repeated between each
    of them), and past that limit it is a refusal naming it, not a parse."""
    many = b'{"model": "m", ' + b", ".join(b'"a%d": [%d]' % (i, i) for i in range(9_990)) + b"}"
    cut = b'{"model": "m", ' + b", ".join(b'"a%d": 1, "n": %d' % (i, i % 100 + 1) for i in range(4_990)) + b"}"
    for raw in (many, cut):
        s = summarise(raw, "chat", READS, CHARS)
        assert s.error is None and len(s.rest) <= MAX_PIECES and len(s.read) + len(s.big) <= len(READS)
        body = s.parsed(raw).body
        assert written(body) == json.loads(raw)
    assert summary_body(cut)["n"] == 4_989 % 100 + 1  # the last "n", as json reads it
    too_many = b'{"model": "m", ' + b", ".join(b'"a%d": [%d]' % (i, i) for i in range(200_000)) + b"}"
    assert summarise(too_many, "chat", READS, CHARS).error[1] == "too_many_members"
