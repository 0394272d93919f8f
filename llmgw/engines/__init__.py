"""Inference engines as llmgw sees them: how to start one, how to ask it how it is.

- :mod:`llmgw.engines.argv` — pure: the argument list for (model, profile, shard), with the
  agent's ``{port}``/``{weights}``/``{host}`` placeholders; :func:`served_name`.
- :mod:`llmgw.engines.health` — I/O at the edge: ``/health``, a one-token readiness probe,
  and load (running, waiting, KV-cache use) read from each engine's ``/metrics``.
- :mod:`llmgw.engines.sim` — the built-in OpenAI-compatible simulator (``engine: sim``).
- :mod:`llmgw.engines.testing` — the simulator as a subprocess, for tests and benchmarks.

Nothing is imported here: ``python -m llmgw.engines.sim`` loads this package first, and the
simulator should start without paying for the catalog or prometheus_client.
"""
