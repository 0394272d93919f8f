"""Acceptance before traffic (issue 37), on real processes: `llmgw controller` over real sshd nodes
running simulated engines, the openai client as constant load through its router.

A change that answers 200 with the wrong words (here the simulator's --weights: other words for
the same prompt, as other weights behind the same model name would give) passes every latency
and error check. With acceptance prompts in the model's rollout, its canary is asked them before
it serves: it fails, is rolled back with the prompt, what was expected and what came in the
event, and never reaches the router (no replica-ready, no client request). A good change answers
them and is promoted. Every wait is for an event or a state.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from tests.e2e.rollout_fleet import Controller, Load, canary_policy, close, failures, model_yaml

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

CHAT = "models/chat.yaml"
QUESTION = "What is the capital of France?"


def ask(router: str) -> str:
    body = {"model": "chat", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 8, "temperature": 0}
    req = urllib.request.Request(router + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())["choices"][0]["message"]["content"]


def chat(args: list[str], expected: str | None) -> str:
    acceptance = "" if expected is None else (
        "  acceptance:\n"
        "    - name: capital\n"
        f"      messages: [{{role: user, content: {json.dumps(QUESTION)}}}]\n"
        "      max_tokens: 8\n"
        f"      expect: {{contains: [{json.dumps(expected)}]}}\n")
    return model_yaml("chat", replicas=2, args=args, rollout=canary_policy(extra=acceptance))


def test_a_change_with_the_wrong_words_is_rolled_back_before_any_client_sees_it(sshd_fleet, tmp_path: Path) -> None:
    fleet = sshd_fleet(2)
    ctl = Controller.create(tmp_path, fleet, {CHAT: chat([], None)})
    try:
        ctl.start()
        ctl.ready("chat", 2)
        good_answer = ask(ctl.router)  # what the serving version says, deterministic
        assert good_answer
        # Acceptance added: no new version (the engines are built from the same things), nothing restarts.
        ctl.commit({CHAT: chat([], good_answer)}, "chat: acceptance prompts")
        with Load(ctl.router, "chat") as load:
            load.wait_answered(20, proc=ctl.proc)
            mark = ctl.last_event_id()
            ctl.commit({CHAT: chat(["--weights", "other"], good_answer)}, "chat: other weights, same name")
            back = ctl.wait_event(("rollout-rolled-back", "rollout-promoted", "rollout-done"), "chat", after=mark)
            assert back["kind"] == "rollout-rolled-back", back
            # The event says which prompt, what was expected and what came.
            for words in ("acceptance 'capital' failed", QUESTION, f"expected it to contain {json.dumps(good_answer)}",
                          "the answer:"):
                assert words in back["message"], (words, back["message"])
            [canary] = ctl.canaries("chat", after=mark)
            failed = ctl.wait_event("replica-acceptance-failed", canary, after=mark)
            assert QUESTION in failed["message"]
            # It never served: never ready, so never in the router's list.
            assert [e for e in ctl.events(after=mark, subject=canary) if e["kind"] == "replica-ready"] == []
            load.wait_answered(40, proc=ctl.proc)

            # A good change answers the prompts and is promoted.
            mark = ctl.last_event_id()
            ctl.commit({CHAT: chat(["--max-tokens-default", "20"], good_answer)}, "chat: 20 tokens by default")
            done = ctl.wait_event(("rollout-rolled-back", "rollout-done"), "chat", after=mark)
            assert done["kind"] == "rollout-done", done
            load.wait_answered(20, proc=ctl.proc)
        assert failures(load.outcomes) == [], failures(load.outcomes)[:5]
        assert ask(ctl.router) == good_answer
    finally:
        close(ctl, fleet)
