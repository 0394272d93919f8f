"""Who may do what on the admin listener (issue 41): roles, the route policy, sign-in.

- :mod:`llmgw.access.roles` — pure: the roles (viewer < operator < admin), who a caller is
  (:class:`Principal`), what a route needs and whether a caller has it.
- :mod:`llmgw.access.oidc` — I/O at the edge: an OpenID Connect provider's tokens, verified
  against its published keys.
"""
