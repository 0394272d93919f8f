"""The API paths the router serves, named once for every stage that treats them differently."""

from __future__ import annotations

CHAT, COMPLETIONS, EMBEDDINGS = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"
