"""Where a request's caller is kept for the handlers after the admin listener's check."""

from __future__ import annotations

from aiohttp import web

from llmgw.access.roles import Principal

PRINCIPAL: web.RequestKey[Principal] = web.RequestKey("principal", Principal)
