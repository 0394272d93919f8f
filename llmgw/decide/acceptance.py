"""Acceptance (issue 37): what a new replica must answer before any client is sent to it. Pure.

A change can answer 200 with the wrong words (a broken chat template, other weights behind the
same name, a broken tokenizer) and pass any latency or error analysis. The model's
``rollout.acceptance`` prompts are asked of every new replica once it serves, with deterministic
settings, and the answers judged here; the lifecycle (llmgw.reconciler.lifecycle) asks and
applies: a replica that fails is not ready, and a canary that fails is rolled back, the prompt,
what was expected and what came in the event.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema

from llmgw.catalog.model import Acceptance, Task

SEED = 0  # with temperature 0: the same answer every time, where the engine is deterministic
SHOWN = 300  # characters of an answer an event quotes
FINDING = "acceptance "  # how a failed acceptance prompt's words begin (a replica's error)


def request_of(a: Acceptance, model_name: str, task: Task) -> tuple[str, dict[str, Any]]:
    """The path and body to send: a chat for ``messages``, a completion for ``prompt``."""
    settings = {"model": model_name, "max_tokens": a.max_tokens, "temperature": 0, "seed": SEED, "stream": False}
    if a.messages:
        return "/v1/chat/completions", {**settings, "messages": [{"role": r, "content": c} for r, c in a.messages]}
    del task  # a completion prompt is a completion whatever the model's task
    return "/v1/completions", {**settings, "prompt": a.prompt or ""}


def answer_text(body: Any) -> str | None:
    """The text of an OpenAI answer (chat or completion), None when it has none."""
    try:
        choice = body["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
    except (KeyError, IndexError, TypeError):
        return None
    return text if isinstance(text, str) else None


def judge(a: Acceptance, answer: str, seconds: float) -> str | None:
    """None when ``answer`` (which took ``seconds``) is what ``a`` expects, else what is wrong."""
    lowered = answer.lower()
    missing = [c for c in a.contains if c.lower() not in lowered]
    if missing:
        return f"expected it to contain {_list(missing)}"
    present = [c for c in a.not_contains if c.lower() in lowered]
    if present:
        return f"expected it not to contain {_list(present)}"
    if a.matches is not None and re.search(a.matches, answer) is None:
        return f"expected it to match /{a.matches}/"
    if a.json_schema is not None:
        try:
            value = json.loads(answer)
        except ValueError:
            return "expected JSON"
        schema = json.loads(a.json_schema)
        error = jsonschema.exceptions.best_match(jsonschema.validators.validator_for(schema)(schema).iter_errors(value))
        if error is not None:
            return f"expected JSON valid against its schema: {error.message}"
    if a.latency is not None and seconds > a.latency:
        return f"expected it within {a.latency:g} s, it took {seconds:.2f} s"
    return None


def finding(a: Acceptance, problem: str, answer: str | None) -> str:
    """The words of a failed acceptance prompt for an event and a rollback's reason."""
    asked = a.messages[-1][1] if a.messages else (a.prompt or "")
    got = "no answer" if answer is None else json.dumps(answer[:SHOWN] + ("…" if len(answer) > SHOWN else ""),
                                                        ensure_ascii=False)
    return f"{FINDING}{a.name!r} failed: asked {json.dumps(asked[:SHOWN])}, {problem}; the answer: {got}"


def _list(items: list[str]) -> str:
    return ", ".join(json.dumps(i) for i in items)
