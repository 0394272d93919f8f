"""The router: OpenAI-compatible serving in front of the fleet (DESIGN §6).

    Router, RouterConfig     the aiohttp server; endpoint sink, catalog subscriber, usage source
    KeyRing, ApiKey          API keys stored as sha256 digests (none configured = open)
    FeedClient               a standalone router's end: follow snapshots, report usage
    catalog_from_view        the routing table's catalog from the contract's catalog view
"""

from llmgw.lazy import lazy_exports

# Resolved on first use: `llmgw validate` and the other commands import llmgw.router.main for
# its argument parser, and must not pay for aiohttp's import to print their help.
_EXPORTS = {
    "Router": "llmgw.router.app", "RouterConfig": "llmgw.router.config", "catalog_from_view": "llmgw.router.feed",
    "FeedClient": "llmgw.router.follow", "ApiKey": "llmgw.router.keys", "KeyRing": "llmgw.router.keys",
    "hash_key": "llmgw.router.keys", "RouteCatalog": "llmgw.router.routes", "RouteModel": "llmgw.router.routes",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
