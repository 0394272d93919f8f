"""The router's knobs, with the defaults an operator gets when they set none."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RouterConfig:
    body_limit: int = 32 * 1024 * 1024  # bytes; larger bodies are 413 (images in chat can be big)
    # Processes parsing big request bodies off the event loop (llmgw.router.parse), and so big bodies
    # parsed at once; 0 parses every body on the loop (one 30 MB body held it for ~1 s).
    parse_workers: int = 1
    buffered_limit: int = 1024 * 1024 * 1024  # bytes of bodies held by all requests in flight; beyond, 503
    # Bytes of bodies one API key (or client address, on an open router) may hold in flight; beyond,
    # 429. 0: a quarter of buffered_limit, at least body_limit. One key filling the total made every
    # other tenant's request a 503.
    key_buffered_limit: int = 0
    key_parse_bodies: int = 2           # big bodies one key may have waiting for or in the parser; beyond, 429

    @property
    def key_buffered(self) -> int:
        return self.key_buffered_limit or max(self.buffered_limit // 4, self.body_limit)
    # Seconds a client has to send its whole body once the head is in: a slow upload holds a
    # connection and a handler, and the listener's idle timeout stops counting once a head is read.
    body_timeout: float = 30.0
    connect_timeout: float = 5.0        # seconds to open a connection to an engine
    # Seconds without a byte from the engine: before the first (headers, or a streamed first token;
    # a non-streamed answer arrives whole, so this bounds its whole generation) and between chunks.
    first_byte_timeout: float = 600.0
    hold_timeout: float = 180.0         # how long a request waits for a replica to be woken
    max_held: int = 1024                # requests waiting at once; beyond, 503 at once
    retries: int = 1                    # other replicas tried after a failure before the first byte
    cooldown: float = 5.0               # seconds a failed replica is skipped while others remain
    load_interval: float = 1.0          # seconds between reads of each engine's queue depth
    max_idle: int = 512                 # idle keep-alive connections kept per replica
    # Below the engines' own idle timeout (uvicorn's, which vLLM uses, is 5 s), so the router
    # never sends a request on a connection the engine is closing.
    keepalive_timeout: float = 4.0
    retry_after: int = 5                # seconds, in Retry-After when waiting helps
    wake_linger: float = 15.0
    drain_timeout: float = 10.0         # on close, seconds in-flight requests get to finish
    # Models with `routing: prefix` (llmgw.router.prefix). Requests in flight (per unit of weight)
    # by which a replica holding the prompt's start may exceed the least loaded one and still get
    # it: above, load wins. 4 is a few prefills of queueing, far less than recomputing a long prefix.
    prefix_imbalance: int = 4
    prefix_block_chars: int = 64        # characters per hashed block of a prompt
    # Blocks remembered per replica (LRU): 16,384 × 64 characters is ~1 MiB of text, ~250k tokens,
    # more than a small GPU's KV cache holds; ~1.5 MB of router memory per replica.
    prefix_index_blocks: int = 16384
    # Tenants' limits counted in this Redis (redis://[:password@]host:port/db), shared by every
    # router given the same URL; empty: each router counts on its own (llmgw.tenancy.shared).
    limits_redis: str = ""
    # How many routers share the limits, the controller's own included: while Redis is away each
    # grants 1/limits_routers of a budget's rest. 0: the most routers the controller has heard
    # from at once since it started (one count for every router, never one per moment).
    limits_routers: int = 0
