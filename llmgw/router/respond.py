"""Answers the router gives itself, in the OpenAI error format clients already parse.

Every failure is ``{"error": {"message", "type", "param", "code"}}`` with a message that says
why — which model, which fallbacks were tried, what the upstream did — because the person
reading it is debugging a client against a fleet they cannot see. Types and codes follow
OpenAI's where one exists (``invalid_api_key``, ``model_not_found``), so SDKs map them to the
right exception class.
"""

from __future__ import annotations

import json
import math

from aiohttp import web

JSON = "application/json"


def error(status: int, message: str, *, kind: str = "invalid_request_error", code: str | None = None,
          retry_after: int | None = None) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return web.Response(status=status, body=json.dumps(body).encode(), content_type=JSON, headers=headers)


def unauthorized(message: str) -> web.Response:
    return error(401, message, code="invalid_api_key")


def forbidden(message: str) -> web.Response:
    return error(403, message, kind="permission_error", code="model_not_allowed")


def not_found(name: str) -> web.Response:
    return error(404, f"The model `{name}` does not exist: it is neither a model nor an alias in the catalog.",
                 code="model_not_found")


def bad_request(message: str, code: str = "invalid_request") -> web.Response:
    return error(400, message, code=code)


def too_large(limit: int) -> web.Response:
    return error(413, f"The request body is larger than this router accepts ({limit} bytes).",
                 code="request_too_large")


def body_timeout(seconds: float) -> web.Response:
    resp = error(408, f"The request body did not arrive within {seconds:g} s.", code="request_timeout")
    resp.force_close()  # the rest of the body may still come; the connection cannot be reused
    return resp


def unavailable(message: str, retry_after: int) -> web.Response:
    return error(503, message, kind="service_unavailable", code="no_ready_replica", retry_after=retry_after)


def upstream_failed(message: str, *, timeout: bool, retry_after: int) -> web.Response:
    if timeout:
        return error(504, message, kind="upstream_error", code="upstream_timeout", retry_after=retry_after)
    return error(502, message, kind="upstream_error", code="upstream_failed", retry_after=retry_after)


def json_response(data: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=json.dumps(data).encode(), content_type=JSON)


# The error type and code of a 429 per limit: OpenAI's rate limits are "requests" or "tokens" with
# ``rate_limit_exceeded``; a spent budget is not a rate (waiting a minute does not help) and says so.
LIMIT_ERRORS = {"requests": ("requests", "rate_limit_exceeded"), "concurrent": ("requests", "rate_limit_exceeded"),
                "tokens": ("tokens", "rate_limit_exceeded"), "budget": ("budget", "budget_exceeded")}


def rate_limited(message: str, retry_after: float, headers: dict[str, str], kind: str = "requests") -> web.Response:
    """429 as OpenAI answers it: ``rate_limit_exceeded``, Retry-After (whole seconds, at least 1) and
    ``retry-after-ms``, which the openai SDKs wait for before retrying, and the x-ratelimit-* headers."""
    etype, code = LIMIT_ERRORS.get(kind, LIMIT_ERRORS["requests"])
    resp = error(429, message, kind=etype, code=code, retry_after=max(1, math.ceil(retry_after)))
    resp.headers["retry-after-ms"] = str(max(1, math.ceil(retry_after * 1000)))
    if retry_after > 60:
        # The openai SDKs retry at once when Retry-After is over a minute (they wait at most 60 s):
        # a spent budget would be asked again for nothing, max_retries times.
        resp.headers["x-should-retry"] = "false"
    resp.headers.update(headers)
    return resp
