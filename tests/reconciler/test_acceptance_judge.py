"""Acceptance prompts judged (issue 37), without I/O: what each expectation accepts and refuses,
what is sent, and the words of a finding."""

from __future__ import annotations

import json

from llmgw.catalog.model import Acceptance
from llmgw.decide.acceptance import FINDING, answer_text, finding, judge, request_of

CAPITAL = Acceptance(name="capital", messages=(("user", "What is the capital of France?"),), contains=("Paris",))


def test_each_expectation_accepts_what_it_should_and_names_what_is_wrong() -> None:
    assert judge(CAPITAL, "The capital of France is paris.", 0.1) is None  # case-insensitive
    assert judge(CAPITAL, "Lyon", 0.1) == 'expected it to contain "Paris"'
    no_refusal = Acceptance(name="n", prompt="x", not_contains=("as an ai",))
    assert judge(no_refusal, "As an AI, I cannot", 0.1) == 'expected it not to contain "as an ai"'
    shape = Acceptance(name="m", prompt="x", matches=r"^\d{4}-\d{2}-\d{2}$")
    assert judge(shape, "2026-12-05", 0.1) is None and judge(shape, "Dec 5", 0.1) is not None
    schema = json.dumps({"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}})
    js = Acceptance(name="j", prompt="x", json_schema=schema)
    assert judge(js, '{"city": "Paris"}', 0.1) is None
    assert judge(js, "Paris", 0.1) == "expected JSON"
    assert "'city' is a required property" in (judge(js, '{"town": "Paris"}', 0.1) or "")
    slow = Acceptance(name="s", prompt="x", contains=("a",), latency=1.0)
    assert judge(slow, "a", 0.5) is None and judge(slow, "a", 2.5) == "expected it within 1 s, it took 2.50 s"


def test_what_is_sent_is_deterministic_and_a_finding_quotes_prompt_and_answer() -> None:
    path, body = request_of(CAPITAL, "chat", "chat")
    assert path == "/v1/chat/completions" and body["temperature"] == 0 and body["seed"] == 0
    assert body["messages"] == [{"role": "user", "content": "What is the capital of France?"}]
    path, body = request_of(Acceptance(name="p", prompt="Once", max_tokens=4), "base", "completion")
    assert (path, body["prompt"], body["max_tokens"]) == ("/v1/completions", "Once", 4)
    assert answer_text({"choices": [{"message": {"content": "hi"}}]}) == "hi"
    assert answer_text({"choices": [{"text": "hi"}]}) == "hi" and answer_text({"choices": []}) is None
    words = finding(CAPITAL, 'expected it to contain "Paris"', "x" * 1000)
    assert words.startswith(FINDING + "'capital' failed: asked \"What is the capital of France?\"")
    assert words.endswith('…"') and len(words) < 500  # the answer quoted, cut
