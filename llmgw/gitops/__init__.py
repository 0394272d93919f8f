"""GitOps: a commit on the followed branch becomes the fleet's desired state.

    GitOpsFollower   fetches, judges (validation, the prune guard) and applies commits
    GitMirror        the bare mirror of the followed branch
    DesiredState     the catalog in force, and its subscribers
    CommitWriter     `llmgw models add/remove`: commits made for an operator
"""

from llmgw.lazy import lazy_exports

# Resolved on first use: the typed state store and the pure plan import gitops.status, and must
# not load the follower (prometheus, watchfiles) or the writer by doing so.
_EXPORTS = {
    "DesiredState": "llmgw.gitops.desired", "GitOpsFollower": "llmgw.gitops.follower",
    "GitMirror": "llmgw.gitops.repo", "SyncState": "llmgw.gitops.status", "SyncStatus": "llmgw.gitops.status",
    "CommitWriter": "llmgw.gitops.writer", "Store": "llmgw.state",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
