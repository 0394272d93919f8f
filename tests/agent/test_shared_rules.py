"""The rules the stdlib agent and the controller both apply (issue 40): each defined once where
it can be imported, and tied by a test where the agent, a single file on every node, must hold
its own copy. A change to one side that the other does not follow fails here, not on a node."""

from __future__ import annotations

import posixpath
from types import ModuleType
from typing import get_args

from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.catalog import cache_name
from llmgw.catalog.model import Engine
from llmgw.catalog.semantic import default_env_allow, source_problem
from llmgw.engines.argv import source_file_name

SEGMENT = st.text(alphabet=st.sampled_from("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-"),
                  min_size=1, max_size=24).filter(lambda s: s not in (".", ".."))


def test_the_cache_name_is_the_sha256_of_the_source_text_forever() -> None:
    # Pinned: a change of the formula would orphan every cache entry on every node.
    assert cache_name("hf://org/model@main") == \
        "llmgw-876d9f0a51cc47a918346c30ab36317f7f93503a90f7595889862dfd194a0481"


@settings(max_examples=200, deadline=None)
@given(st.text(min_size=1, max_size=200))
def test_the_built_agent_names_a_cache_entry_as_the_controller_does(agent_module: ModuleType, source: str) -> None:
    try:
        source.encode("utf-8")
    except UnicodeError:
        return  # no cache name on either side (the agent refuses such a source first)
    assert agent_module.cache_name(source) == cache_name(source)


def test_validation_allows_by_default_the_env_the_built_agent_allows(agent_module: ModuleType) -> None:
    assert default_env_allow() == agent_module.DEFAULT_ENV_ALLOW and "HF_TOKEN" not in default_env_allow()


def test_the_agents_engine_tables_name_the_catalogs_engines(agent_module: ModuleType) -> None:
    served = set(get_args(Engine)) - {"sim"}  # the simulator is the agent's own, with no flags to police
    assert set(agent_module.LISTEN_FLAGS) == served
    assert set(agent_module.FAMILIES) <= served and set(agent_module.PEER_FLAGS) <= served


@st.composite
def sources(draw: st.DrawFn) -> str:
    path = "/" + "/".join(draw(st.lists(SEGMENT, min_size=1, max_size=4)))
    kind = draw(st.sampled_from(["hf", "s3", "https", "http", "file", "path"]))
    if kind == "s3":
        bucket = draw(st.from_regex(r"[a-z0-9][a-z0-9.-]{1,20}[a-z0-9]", fullmatch=True))
        return f"s3://{bucket}{path}"
    if kind == "hf":
        rev = draw(st.one_of(st.none(), SEGMENT))
        return f"hf://{draw(SEGMENT)}/{draw(SEGMENT)}" + (f"@{rev}" if rev else "")
    if kind in ("https", "http"):
        query = draw(st.one_of(st.just(""), SEGMENT.map(lambda q: f"?sig={q}")))
        return f"{kind}://{draw(SEGMENT)}.example{path}{query}"
    return f"file://{path}" if kind == "file" else path


@settings(max_examples=300, deadline=None)
@given(sources())
def test_every_source_the_catalog_accepts_the_agent_can_fetch(agent_module: ModuleType, source: str) -> None:
    # A commit that validates must not name weights every node refuses to fetch.
    if source_problem(source) is None:
        agent_module.parse_source(source)  # raises AgentError when the agent refuses it


@settings(max_examples=300, deadline=None)
@given(sources(), st.booleans())
def test_a_single_gguf_file_is_looked_for_where_the_agent_puts_it(agent_module: ModuleType, source: str,
                                                                  gguf: bool) -> None:
    if gguf and not source.startswith("hf://"):
        source = source.split("?")[0] + ".gguf" + ("?" + source.split("?")[1] if "?" in source else "")
    if source_problem(source) is not None:
        return
    name = source_file_name(source)
    parsed = agent_module.parse_source(source)
    if parsed.kind == "http":
        stored = agent_module._url_filename(source)  # noqa: SLF001 - the name a download is stored under
    elif parsed.kind == "file":
        stored = posixpath.basename(parsed.location)
    elif parsed.kind == "s3":
        stored = parsed.key.rsplit("/", 1)[-1]  # one object: stored under its last segment
    else:
        stored = None  # hf: a directory snapshot, loaded as the entry itself
    assert name == (stored if stored is not None and stored.lower().endswith(".gguf") else None)
