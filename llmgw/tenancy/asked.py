"""What a request asks engines to generate, read as the most generous engine reads it, and the
tokens it reserves from its tenant's limits for that (issue 18; the fields as issue 24 found them).

Pure: a parsed body (and its size) in, numbers out. :mod:`llmgw.tenancy.rules` decides whether a
reservation fits; the router sends the body with :func:`capped_fields` so that no engine writes
more than was reserved.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple

from llmgw.jsonbody import RawJSON

DEFAULT_COMPLETION_TOKENS = 256  # reserved when a request sets no max_tokens


def prompt_estimate(body: bytes | int) -> int:
    """Prompt tokens reserved for a body, before the engine counts them: never fewer than a
    tokenizer may find, or requests in flight together overshoot a budget (what is reserved
    beyond the real count is given back when the request settles). ASCII: a token per 2 bytes
    (short words, "a a a", are that; a token-id list, "0,0,0", has at most that many ids; an
    escaped character, 6 or 12 bytes, is at most 4 byte tokens). Raw non-ASCII text: a token a
    byte (byte-fallback tokenizers). Given only a size (a body not read yet), the ASCII figure:
    the least any body of that size is reserved."""
    if type(body) is int:
        return (body + 1) // 2
    assert isinstance(body, bytes)
    return (len(body) + 1) // 2 if body.isascii() else len(body)


MAX_RESERVATION = 2 ** 31  # a "max_tokens" beyond any context is reserved as this much
# Every field an engine reads as the completion limit of a request, and how it reads them: vLLM and
# SGLang take ``max_completion_tokens or max_tokens`` (so a 0 falls through to the other), llama.cpp
# takes ``n_predict``, then ``max_completion_tokens``, then ``max_tokens``, and reads -1 as
# "unlimited"; the completions endpoints of vLLM and SGLang read ``max_tokens`` alone. Which one
# wins differs, so a request reserves the largest of them, and the body is sent with each of them
# set to that (``capped_fields``): a request naming 1 in one field and 50,000 in another reserved 1
# and was served 50,000.
COMPLETION_FIELDS = ("max_completion_tokens", "max_tokens", "n_predict")
# Answers per prompt: OpenAI's and vLLM's ``n``, ``best_of`` (generated, then the best n returned),
# llama.cpp's ``n_cmpl`` (read before its alias ``n``). Each answer may write the whole limit.
ANSWER_FIELDS = ("n", "best_of", "n_cmpl")
# OpenAI's own bound on n. Beyond it a request is refused (400) rather than reserved as if it
# asked for fewer answers than the engine will write.
MAX_ANSWERS = 128


class BadLimitField(ValueError):
    """A completion-limit or answer-count field no engine would read as a count (a 400)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class Asked(NamedTuple):
    """What a request asks engines to generate, read as the most generous engine reads it."""

    completion: int | None  # the largest completion limit set; None: none set, or "unlimited"
    answers: int            # answers per prompt times prompts (each may write ``completion``)
    fields: tuple[str, ...]  # the completion-limit fields present in the body


def asked_for(body: Mapping[str, object]) -> Asked:
    """The request's completion limit and answer count; :class:`BadLimitField` when a field holds
    something that is not a count (engines disagree on what such a value means)."""
    completion: int | None = None
    fields: tuple[str, ...] = ()
    for f in COMPLETION_FIELDS:
        if f not in body:
            continue
        fields += (f,)
        v = body[f]
        if v is None:
            continue  # llama.cpp would look at a null before the next field: rewritten like the rest
        n = v if type(v) is int else _count(v)
        if n is None:
            raise BadLimitField(f, f"`{f}` must be a whole number of tokens, not {_shown(v)}.")
        # 0: vLLM's and SGLang's ``or`` reads it as unset, falling through: not a limit.
        # Negative: llama.cpp's "unlimited" (-1); vLLM and SGLang refuse it. Neither caps anything.
        if n > 0:
            completion = n if completion is None else max(completion, n)
    answers = 1
    for f in ANSWER_FIELDS:
        v = body.get(f)
        if v is None:
            continue
        n = _count(v)
        if n is None or not 1 <= n <= MAX_ANSWERS:
            raise BadLimitField(f, f"`{f}` must be a whole number from 1 to {MAX_ANSWERS}, not {_shown(v)}: "
                                   "each answer is reserved from the tenant's limits.")
        if n > answers:
            answers = n
    prompt = body.get("prompt")
    if prompt is not None:
        answers *= _prompts(prompt)
    return Asked(completion, answers, fields)


def _prompts(prompt: object) -> int:
    """Prompts in a completions request: a list of strings or of token lists is a batch, each
    prompt answered on its own (vLLM, SGLang and llama.cpp alike)."""
    if type(prompt) is RawJSON:  # a big body's prompt, left as text: counted where it was parsed
        return prompt.prompts
    if type(prompt) is list and prompt and type(prompt[0]) in (str, list):
        return len(prompt)
    return 1


def _shown(v: object) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def reservation(body: Mapping[str, object], raw: bytes | int) -> int:
    """Tokens a request reserves: its completion limit (the largest of every field an engine
    reads, a number or a numeric string; :data:`DEFAULT_COMPLETION_TOKENS` when none is set),
    times its answers and prompts, plus the prompt estimate. :class:`BadLimitField` as :func:`asked_for`."""
    return reserve_for(asked_for(body), raw)


def reserve_for(a: Asked, raw: bytes | int) -> int:
    """As :func:`reservation`; ``raw``: the body (or its size: see :func:`prompt_estimate`)."""
    completion = DEFAULT_COMPLETION_TOKENS if a.completion is None else a.completion
    return min(MAX_RESERVATION, min(completion, MAX_RESERVATION) * a.answers + prompt_estimate(raw))


# What each endpoint's engines read as the completion limit (see COMPLETION_FIELDS): every one is
# sent, whatever the body named, so no engine finds a field the router did not reserve for.
# ``max_completion_tokens`` is a chat field (vLLM's and SGLang's completions do not read it).
CHAT_LIMIT_FIELDS = ("max_tokens", "max_completion_tokens", "n_predict")
COMPLETIONS_LIMIT_FIELDS = ("max_tokens", "n_predict")


def capped_fields(a: Asked, *, chat: bool, cap_unasked: bool) -> dict[str, int] | None:
    """The completion-limit fields to send so that no engine writes more than was reserved: every
    field the endpoint's engines read (and any other the body named), each set to the reserved
    limit, whatever the body said (an engine reads whichever it prefers, and a field the router
    did not look at would be a limit nobody reserved: vLLM reads ``max_completion_tokens or
    max_tokens``, llama.cpp ``n_predict`` first). A request that names no field is sent as it
    came unless ``cap_unasked`` (a tenant with a budget: unasked, an engine writes up to its
    context, many reservations past the budget); then None."""
    if a.completion is None and not a.fields and not cap_unasked:
        return None
    limit = DEFAULT_COMPLETION_TOKENS if a.completion is None else a.completion
    fields = dict.fromkeys(CHAT_LIMIT_FIELDS if chat else COMPLETIONS_LIMIT_FIELDS, limit)
    for f in a.fields:
        fields.setdefault(f, limit)
    return fields


def _count(v: object) -> int | None:
    if type(v) is bool:
        return None
    if type(v) is int:
        return v
    if type(v) is float and math.isfinite(v):
        return int(v)
    if type(v) is str:
        try:
            return int(v.strip())
        except ValueError:
            return None
    return None


