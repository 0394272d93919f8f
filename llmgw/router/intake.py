"""Intake: a generation request's body read and parsed, within bounds, before anything else is
decided about it. A body too large, too slow, in an encoding the router does not read, or that
would take more of the router's memory than its sender's share is refused here; a big body is
parsed off the event loop (:mod:`llmgw.router.parse`).
"""

from __future__ import annotations

import asyncio

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from llmgw.router import respond
from llmgw.router.config import RouterConfig
from llmgw.router.keys import ApiKey
from llmgw.router.parse import (
    BadBody,
    BodyParser,
    BodyTooLarge,
    Buffers,
    BuffersFull,
    Hold,
    Parsed,
    ParserBusy,
    TooManyBodies,
    read_body,
)
from llmgw.router.paths import CHAT, COMPLETIONS
from llmgw.router.prefix import MAX_BLOCKS
from llmgw.serving import body_encoding_refused
from llmgw.tenancy.asked import ANSWER_FIELDS, COMPLETION_FIELDS

# Every top-level member of a request body the router reads or writes: a big body parsed in the
# worker comes back with these parsed and every other member as text (llmgw.router.parse). A
# member read or set here and missing from this list would be invisible, or written twice.
READS = frozenset({"model", "stream", "stream_options", "prompt", *COMPLETION_FIELDS, *ANSWER_FIELDS})
_PROMPT_KIND = {CHAT: "chat", COMPLETIONS: "prompt"}  # which prompt text the worker renders


class Intake:
    def __init__(self, config: RouterConfig) -> None:
        self._config = config
        # Bytes of request bodies held by requests in flight, in all and per key (or client address)
        self.buffers = Buffers(limit=config.buffered_limit, share=config.key_buffered)
        self.parser = BodyParser(reads=READS, workers=config.parse_workers, wait=config.body_timeout,
                                 prompt_chars=config.prefix_block_chars * MAX_BLOCKS,
                                 per_sender=config.key_parse_bodies)

    def refuse_early(self, request: web.Request, length: int | None) -> web.Response | None:
        """What the request's head alone says is refused: a declared length (``length``) over the
        limit, an encoded body."""
        limit = self._config.body_limit
        if length is not None and length > limit:
            return respond.too_large(limit)
        refused_encoding = body_encoding_refused(request)
        if refused_encoding is not None:
            return respond.error(415, refused_encoding, code="unsupported_content_encoding")
        return None

    def hold(self, request: web.Request, key: ApiKey | None) -> Hold:
        """The body's bytes, counted against the buffered limit as they are read: a total over
        every request in flight, not only a cap per request (32 MB each times a thousand slow
        uploads is 32 GB of a router's memory), and a share of it per key. Counted from the
        Content-Length up front, so concurrent uploads cannot all pass. Release it when the
        request is done."""
        return Hold(self.buffers, key.name if key is not None else f"address {request.remote}")

    async def take(self, request: web.Request, hold: Hold, length: int | None,
                   path: str) -> tuple[bytes, Parsed] | web.Response:
        """The body (of the declared ``length``, if any) as sent and parsed for ``path``, or the
        refusal. One coroutine for both: each await of another costs every request."""
        config = self._config
        limit = config.body_limit
        try:
            hold.cover(length or 0)
            async with asyncio.timeout(config.body_timeout):
                raw = await read_body(request.content, limit, hold)
        except BodyTooLarge:
            return respond.too_large(limit)
        except TimeoutError:
            return respond.body_timeout(config.body_timeout)
        except BuffersFull as exc:
            if exc.share:  # this key's own share: its to slow down, nobody else's
                return respond.rate_limited(str(exc), config.retry_after, {})
            return respond.unavailable(str(exc), config.retry_after)
        except RequestPayloadError as exc:  # a broken chunked body: the client's, never a 500
            return respond.bad_request(f"The request body could not be read: {exc}")
        try:
            return raw, await self.parser.parse(raw, _PROMPT_KIND.get(path), hold.who)
        except BadBody as exc:
            return respond.bad_request(str(exc), exc.code)
        except TooManyBodies as exc:
            return respond.rate_limited(str(exc), config.retry_after, {})
        except ParserBusy as exc:
            return respond.unavailable(str(exc), config.retry_after)

    async def close(self) -> None:
        await self.parser.close()
