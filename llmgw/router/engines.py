"""What the router does differently per engine, in one place: an :class:`EngineProfile` per
engine name, looked up once per replica (:class:`~llmgw.router.table.Upstream`), never by
comparing names on the request path.

Engines speak the same OpenAI API; where they differ in what the router relies on, the
difference is a field here, with the failure it prevents:

- **Connection reuse.** llama-server (cpp-httplib) closes idle keep-alive connections while its
  HTTP threads are busy (seen here: 5 of 6 dropped during one long prefill). A request sent on
  one is lost in that race and may not be resent (it may have arrived), so it gets a new
  connection each time: ~0.1 ms on a LAN against prefills of 10 ms and more.
- **Usage.** The router counts usage from the engine's own report, and a stream cut short from
  the engine's running count at the last event the client got. llama.cpp reports exact counts
  in every answer's last ``timings`` unasked, and in every event when asked
  (``timings_per_token``); asked for a stream's usage event, it would move them into that event,
  which the client (who did not ask for it) would then lose. Every other engine is asked for the
  usage event and a running count in each event (``stream_options.include_usage`` and
  ``continuous_usage_stats``). Either way what the client did not ask for is taken out again on
  the way back (:mod:`llmgw.router.usage`).
- **Prompt-cache counts.** llama.cpp's ``timings`` say how much of each prompt came from its
  cache (counted per answer); vLLM's are engine-wide counters read by the load poller
  (:mod:`llmgw.router.load`), which needs nothing from the request path.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineProfile:
    """One engine's quirks, as the router sees them."""

    name: str
    reuse_connections: bool = True  # keep-alive connections to it may be used again
    # Its answers end with llama.cpp's ``timings``: usage and prompt-cache hits, given unasked; a
    # stream's running count is asked for as timings too (else as usage: llmgw.router.usage).
    timings: bool = False


LLAMA_CPP = EngineProfile("llama.cpp", reuse_connections=False, timings=True)
_KNOWN = {p.name: p for p in (LLAMA_CPP,)}


def engine_profile(name: str) -> EngineProfile:
    """The profile of the engine called ``name``; vLLM, SGLang, the simulator and any engine not
    listed behave as OpenAI's API says (the defaults). Called when a replica joins the table."""
    return _KNOWN.get(name) or EngineProfile(name)
