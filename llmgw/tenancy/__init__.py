"""Tenants: who may use how much (issue 18), beside the router that asks (issue 29).

    rules        pure: buckets, budget periods, what a request takes of each limit, when it fits,
                 refusals (their text and OpenAI's x-ratelimit headers)
    asked        pure: what a request asks engines to write, the tokens it reserves for that, and
                 the completion-limit fields it is sent with
    memory       the scopes of every tenant and their counts in this router (Limiter, Ticket),
                 and LocalLimits, the limits of a router that shares them with nobody
    shared       SharedLimits: the same scopes counted in Redis for every router, degraded to
                 memory while Redis is away; it moves state, and
    script       the Lua script that applies the rules there atomically, and its arguments
    admission    the Limits protocol the router uses, whichever of the two it has
    usage        what each key used (UsageBook, filled from the router's answer tap), and the
                 outbox that keeps it until the controller's ledger has it

Imports point one way: the router imports this package, never the reverse. ``rules``,
``asked`` and ``script`` import no I/O library (an import-linter contract).
"""
