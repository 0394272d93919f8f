"""The one exception tree of llmgw.

Library errors (paramiko, git, jsonschema, aiohttp) are wrapped at the boundary with
``raise ... from exc`` so nothing above the boundary knows which library failed, and
callers retry by type, never by message::

    LlmgwError
    ├── CatalogError          a catalog cannot be read or is invalid (carries problems)
    ├── GitError              fetching, reading or pushing the catalog repository failed
    │   └── PushRejected      the remote refused a push (someone pushed first, or read-only)
    ├── DispatchError         talking to a node failed
    │   ├── NodeUnreachable   connect / transport failure: worth retrying later (temporary)
    │   ├── HostKeyRejected   unknown or changed host key: an operator must act (permanent)
    │   └── AgentError        the agent answered with an error for this request
    │       └── StartRefused  the node's owner does not allow what a start asked (env, args, user)
    ├── EngineArgsError       a (model, profile, shard) an engine cannot be started with
    ├── ConfigError           the controller's own configuration is unusable
    ├── StoreError            the controller's store failed a call (database away, timeout, disk full)
    └── AccessError           no single source names a controller's admin URL and token
"""

from __future__ import annotations


class LlmgwError(Exception):
    """Base of every error llmgw raises on purpose."""


class CatalogError(LlmgwError):
    """A catalog could not be loaded; ``problems`` lists every reason with its location."""

    def __init__(self, message: str, problems: tuple = ()) -> None:
        super().__init__(message)
        self.problems = problems


class GitError(LlmgwError):
    """A git operation on the catalog repository failed; ``code``: git's exit status, when it ran."""

    def __init__(self, message: str, *, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class BranchMissing(GitError):
    """The remote answered, but the followed branch is not on it."""


class PushRejected(GitError):
    """The remote refused a push."""


class DispatchError(LlmgwError):
    """A call to a node's agent failed."""


class NodeUnreachable(DispatchError):
    """The node could not be reached or the connection broke; temporary."""


class HostKeyRejected(DispatchError):
    """The node's host key is unknown or changed; permanent until an operator trusts it."""


class AgentError(DispatchError):
    """The agent ran and answered with an error for this request."""


class StartRefused(AgentError):
    """The node refused a start by its own config (DESIGN §4, the node boundary): retrying the
    same request cannot help until the catalog or the node config changes. ``setting`` is the
    node config key that decides it (``env_allow``, ``sandbox_paths``, ``engine_user``...)."""

    def __init__(self, message: str, *, setting: str) -> None:
        super().__init__(message)
        self.setting = setting


class EngineArgsError(LlmgwError):
    """An engine's argument builder refused a (model, profile, shard): a sharded profile
    without its shard, llama.cpp across nodes or without a .gguf file."""


class ConfigError(LlmgwError):
    """The controller's own configuration is unusable."""


class StoreError(LlmgwError):
    """A call to the controller's store failed (llmgw.store): nothing of it was written, and the
    same call may succeed later (the database back, the disk freed). Unusable from the start
    (unreachable when opened, a newer schema) is a ConfigError instead."""


class AccessError(LlmgwError):
    """A command cannot tell which controller to talk to, or with which token (llmgw.adminaccess)."""
