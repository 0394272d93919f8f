"""GitOps: a commit on the followed branch becomes the fleet's desired state."""

from llmgw.gitops.desired import DesiredState
from llmgw.gitops.follower import GitOpsFollower
from llmgw.gitops.repo import GitMirror
from llmgw.gitops.status import SyncState, SyncStatus
from llmgw.gitops.store import Store
from llmgw.gitops.writer import CommitWriter

__all__ = ["CommitWriter", "DesiredState", "GitMirror", "GitOpsFollower", "Store", "SyncState", "SyncStatus"]
