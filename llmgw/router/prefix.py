"""Prefix affinity: which replica has recently seen which start of a prompt (DESIGN §6).

Engines keep the KV state of prompts they computed (vLLM's and SGLang's prefix caches,
llama.cpp's slots and ``--cache-ram``), so a request whose prompt starts like one a replica
served recently costs that replica a fraction of the prefill. The router cannot see the
engines' caches; it keeps an approximation of each one: the prompts it sent there.

A prompt is the request rendered as text (chat: the tools and each message's role and content;
completions: the prompt), cut into fixed-size blocks of characters. Each block's hash is chained
onto the previous one, so block *i* stands for the whole text up to its end, and two prompts
share block *i* only if they agree on everything before it: "how many leading blocks does this
replica hold" is then a count of dictionary hits, with no tokenizer and nothing to render twice.
Only whole blocks count, so a prompt shorter than one block has no affinity at all.

Each replica's index is an LRU of block hashes with a fixed capacity: memory is bounded however
many distinct prompts arrive. A prompt's blocks are touched from the last to the first, so the
blocks shared by the most prompts (the first ones) are the last to go, as in the engines' own
caches. The index lives on the router's :class:`~llmgw.router.table.Upstream`, so a replica that
leaves the table, comes back with another engine, or fails a request loses it with its cache.

The hashes are Python's own (randomised per process): an index is never shared or stored, and
the built-in hash of a short string and a tuple is the cheapest there is. What several routers
must agree on without talking, where an unseen prompt goes first, uses a stable digest
(:attr:`PromptKey.anchor`). Nothing here does I/O.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

BLOCK_CHARS = 64     # llm-d's approximate scorer uses the same: ~16 tokens of English per block
MAX_BLOCKS = 512     # 32 KiB of prompt: beyond that, the start already tells replicas apart
ANCHOR_BLOCKS = 16   # where an unseen prompt goes is decided by its first 1 KiB
_SEP = "\x1f"        # between a message's role and content, never typed by a client


@dataclass(frozen=True, slots=True)
class PromptKey:
    """A request's prompt as the index sees it: chained block hashes, and a stable anchor."""

    hashes: tuple[int, ...]
    anchor: bytes  # digest of the first ANCHOR_BLOCKS blocks: the same in every router process


def prompt_key(body: Mapping[str, Any], chat: bool, block_chars: int = BLOCK_CHARS,
               max_blocks: int = MAX_BLOCKS) -> PromptKey | None:
    """The key of a chat or completions request body, or None when it has less than one block
    of text (or a shape no engine would take: that is the engine's answer to give)."""
    limit = block_chars * max_blocks
    text = render_chat(body, limit) if chat else render_prompt(body)
    n = min(len(text) // block_chars, max_blocks)
    if n == 0:
        return None
    return PromptKey(chain_hashes(text, n, block_chars),
                     hashlib.blake2b(text[:min(n, ANCHOR_BLOCKS) * block_chars].encode("utf-8", "surrogatepass"),
                                     digest_size=8).digest())


CONVERSATION_CHARS = 1024  # of a conversation's opening, what names it


def conversation_draw(body: Mapping[str, Any], chat: bool) -> float | None:
    """A number in [0, 1) that a conversation keeps over its turns (None: nothing to name it by):
    a hash of its opening, the messages up to and with the first user message (a chat) or the
    prompt's start, so each turn of a conversation draws the same canary track and a canary's
    share is a share of conversations (seen: each turn drew afresh, hopping between versions
    and their prefix caches). The same in every router process (a keyed digest, not hash())."""
    if chat:
        messages = body.get("messages")
        if type(messages) is not list:
            return None
        opening = []
        for m in messages:
            if type(m) is not dict:
                return None
            opening.append(m)
            if m.get("role") == "user":
                break
        text = render_chat({"messages": opening}, CONVERSATION_CHARS)[:CONVERSATION_CHARS]
    else:
        text = render_prompt(body)[:CONVERSATION_CHARS]
    if not text:
        return None
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2 ** 64


def chain_hashes(text: str, n: int, block_chars: int) -> tuple[int, ...]:
    """Hashes of the first ``n`` blocks of ``text``, each chained onto the one before."""
    out = []
    h = 0
    for i in range(0, n * block_chars, block_chars):
        h = hash((h, text[i:i + block_chars]))
        out.append(h)
    return tuple(out)


def render_chat(body: Mapping[str, Any], limit: int = BLOCK_CHARS * MAX_BLOCKS) -> str:
    """The chat request's text in the order an engine's chat template puts it: tools, then each
    message's role and content. An approximation of the template, not the template: two requests
    render alike exactly when they would start alike on the engine, which is all that matters.
    Stops once ``limit`` characters are rendered: only the start is ever hashed."""
    messages = body.get("messages")
    if type(messages) is not list:
        return ""
    parts: list[str] = []
    size = 0
    tools = body.get("tools")
    if tools:
        try:  # in the client's own key order: one client sends its tools the same way each time
            parts.append(json.dumps(tools, separators=(",", ":")))
            size += len(parts[-1])
        except (TypeError, ValueError, RecursionError):
            pass
    for m in messages:
        if size >= limit:
            break
        first = len(parts)
        if type(m) is not dict:
            break  # the engine refuses it; what came before is still a prefix
        role = m.get("role")
        parts.append(role if type(role) is str else "")
        content = m.get("content")
        if type(content) is str:
            parts.append(content)
        elif type(content) is list:
            parts.append(_SEP.join(_part_text(p) for p in content[:MAX_BLOCKS * 4]))
        calls = m.get("tool_calls")
        if calls:
            try:
                parts.append(json.dumps(calls, separators=(",", ":")))
            except (TypeError, ValueError, RecursionError):
                pass
        size += sum(len(p) + 1 for p in parts[first:])
    return _SEP.join(parts)


def _part_text(part: Any) -> str:
    if type(part) is not dict:
        return ""
    text = part.get("text")
    if type(text) is str:
        return text
    image = part.get("image_url")  # the same image at the same place is the same prefix
    if type(image) is dict and type(image.get("url")) is str:
        return image["url"]
    return ""


def render_prompt(body: Mapping[str, Any]) -> str:
    """A completions request's prompt: the string, the first of a list (a batch goes to one
    replica), or token ids written out."""
    prompt = body.get("prompt")
    if type(prompt) is list and prompt:
        if all(type(t) is int for t in prompt[:MAX_BLOCKS * 4]):
            return " ".join(map(str, prompt[:MAX_BLOCKS * 16]))
        prompt = prompt[0]
    if type(prompt) is list:
        return " ".join(str(t) for t in prompt[:MAX_BLOCKS * 16] if type(t) is int)
    return prompt if type(prompt) is str else ""


class PrefixIndex:
    """The block hashes one replica was recently sent, least recently used first out."""

    __slots__ = ("capacity", "_blocks")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("a prefix index holds at least one block")
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of ``hashes`` this replica holds."""
        blocks = self._blocks
        n = 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n

    def record(self, hashes: Sequence[int]) -> int:
        """Note that ``hashes`` were sent here; returns how many leading ones were already held."""
        held = self.match(hashes)
        blocks = self._blocks
        for h in reversed(hashes):  # the first block ends most recent: the last to be evicted
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)
        return held

    def clear(self) -> None:
        self._blocks.clear()


def rendezvous(anchor: bytes, replica_id: str, weight: float) -> float:
    """Weighted highest-random-weight score of a replica for an anchor: the highest wins.

    Stable across processes, so routers that share no state still send a new prompt to the same
    replica; adding or removing a replica moves only the prompts that scored highest on it.
    """
    digest = hashlib.blake2b(anchor + replica_id.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    u = (int.from_bytes(digest, "big") + 1) / (2 ** 64 + 2)  # in (0, 1)
    return -weight / math.log(u)
