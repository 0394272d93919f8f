"""The router: OpenAI-compatible serving in front of the fleet (DESIGN §6).

    Router, RouterConfig     the aiohttp server; endpoint sink, catalog subscriber, usage source
    KeyRing, ApiKey          API keys stored as sha256 digests (none configured = open)
    FeedHub                  the controller's end of the watch stream for standalone routers
    FeedClient               a standalone router's end: follow snapshots, report usage
    catalog_view             the part of a catalog a router needs (and catalog_from_view, its inverse)
"""

from llmgw.router.app import Router
from llmgw.router.config import RouterConfig
from llmgw.router.feed import Fanout, FeedHub, MergedUsage, catalog_from_view, catalog_view, endpoint_from_json
from llmgw.router.follow import FeedClient
from llmgw.router.keys import ApiKey, KeyRing, hash_key
from llmgw.router.routes import RouteCatalog, RouteModel

__all__ = [
    "ApiKey", "Fanout", "FeedClient", "FeedHub", "KeyRing", "MergedUsage", "RouteCatalog", "RouteModel", "Router",
    "RouterConfig", "catalog_from_view", "catalog_view", "endpoint_from_json", "hash_key",
]
