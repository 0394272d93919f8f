"""The composition root: what builds a controller, its router and its admin listener together
into one serving process (`llmgw controller`, `llmgw up`).

It sits above the parts it composes (control, admin, router), so none of them imports it and
none needs another's wiring: the admin app depends on the control plane's façade, the control
plane on nothing above it (import-linter holds this, pyproject.toml).
"""
