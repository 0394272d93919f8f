"""llmgw node agent: the only llmgw code that runs on a GPU node.

Where it sits: the dispatcher reaches a node over SSH (or runs this file as a local subprocess)
and calls one verb at a time: `python3 llmgw_agent.py --config CONFIG VERB` reads one JSON object
on stdin and writes one JSON object on stdout; `serve` answers one JSON line per request on one
long-lived channel (DESIGN §4).

Why one standard-library file: a node has nothing but python3, and the controller uploads this file
as it is and checks its hash. Which python3: the tests run it on 3.11 (CI's system python3 and the
project's own); 3.9 and 3.10 (Debian 11, Ubuntu 22.04, RHEL 9 nodes) are held by static checks only,
its syntax parsed as 3.9 and its standard-library use checked by vermin
(tests/agent/test_agent_protocol.py), because no older interpreter can be installed here to run it.
It is written as modules (llmgw/agent/parts, one per responsibility) and joined into this file by
`python -m llmgw.agent.build`; the parts import only the standard library and each other, so the
joined file needs nothing but python3.

Trust: the node's own config file is trusted; requests are not. A tampered controller must not be
able to run a program the node did not allow, nor delete anything that is not one of this
system's own complete, unused cache entries. The checks holding that line are in `start` (argv
from the node's allow-list, never a shell, no loader/interpreter hooks in env) and in the
deletion guard (`verb_remove_weights`).

State kept under `state_dir`:
    engines/<replica_id>.json       one record per engine started (pid + its start time, port, argv...)
    exits/<replica_id>.json         exit code, written by the engine's monitor process when it ends
    fetches/<name>.json, .lock      progress of each fetch; the lock is held while a worker runs
    logs/engines/<replica_id>.log   the engine's stdout and stderr
    logs/fetches/<name>.log         the fetch worker's stderr
    engines.lock                    serialises starts (port choice) with the guard's "in use" check
Times are Unix epoch seconds (floats) everywhere.

Helper processes: `fetch` and `start` each spawn this same file with an internal verb
(`_fetch-worker`, `_engine-monitor`) in a new session, so the work outlives the agent process and
the SSH session that asked for it. Internal verbs are reachable only from argv, never from
SSH_ORIGINAL_COMMAND or `serve`.
"""


from __future__ import annotations

import hashlib
import os
import re
from typing import Any, Dict

AGENT_VERSION = "0.1.0"
PROTOCOL = 1
AGENT_PATH = os.path.abspath(__file__)
DEFAULT_CONFIG = "/etc/llmgw/agent.json"

MANIFEST_NAME = "llmgw-manifest.json"
# \Z, not $: "$" also matches before a trailing newline, and "llmgw-<hex>\n" is not a cache name.
CACHE_PREFIX = "llmgw-"
CACHE_NAME_RE = re.compile(r"^llmgw-[0-9a-f]{64}\Z")


def cache_name(source: str) -> str:
    """The cache entry name of a source on every node: ``llmgw-`` + the sha256 hex of its text.

    The one definition: the agent (built from these parts) and the controller (llmgw.catalog
    imports this module) both call it, so the entries a catalog wants are known exactly and an
    entry whose name matches no source is an orphan, never a guess.
    """
    return CACHE_PREFIX + hashlib.sha256(source.encode("utf-8")).hexdigest()
TMP_PREFIX = ".tmp-"  # .tmp-llmgw-<hex>: a download in progress
TRASH_PREFIX = ".trash-"  # .trash-llmgw-<hex>-<random>: an entry being deleted
# Not starting with ".": "." and ".." are names every path join takes for a directory (a replica
# ".." once made the engine's area the state dir itself, emptied at start).
REPLICA_ID_RE = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}\Z")
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
# The same characters the catalog schema refuses in a source, so a source the catalog accepts is
# never refused here; control characters are added because no URL or path needs them.
SOURCE_FORBIDDEN_RE = re.compile(r"[\s;&|`$<>'\"\\(){}*?!#\x00-\x1f\x7f]")
HF_SOURCE_RE = re.compile(r"^hf://([A-Za-z0-9._-]+/[A-Za-z0-9._-]+)(?:@([A-Za-z0-9._/-]+))?$")
HF_MISSING = "hf:// sources need the huggingface_hub package on the node: pip install huggingface_hub"
# s3://bucket/key-prefix: a bucket name as S3 allows it (3-63 of a-z 0-9 . -) and a key prefix (an
# object, or the "directory" of objects under it). Endpoint, region and credentials are the node's.
# Not a bucket S3 refuses ("a..b", an IPv4 address), and no trailing "/": s3://b/k and s3://b/k/
# would be two cache entries of the same weights.
S3_SOURCE_RE = re.compile(r"^s3://((?!\d+\.\d+\.\d+\.\d+/)(?![^/]*\.\.)[a-z0-9][a-z0-9.-]{1,61}[a-z0-9])"
                          r"/([^/](?:.*[^/])?)$")
SHARED_FSTYPES = frozenset({"nfs", "nfs4", "cifs", "smb3", "lustre", "gpfs", "ceph", "glusterfs", "beegfs"})

# Request env is an allow-list the node owns (DESIGN §4, "The node boundary"): a deny-list of the
# names that make an interpreter or loader run code cannot be complete (PYTHONWARNINGS naming a
# module with import side effects, BROWSER, LLAMA_ARG_* mirroring every llama-server flag,
# VLLM_PLUGINS, HF_HOME...). The default holds knobs that only tune threads, allocators, NCCL
# transport choice and log verbosity: none names a file, a module or a library. The node config's
# `env_allow` adds names; nothing else is set from a request.
DEFAULT_ENV_ALLOW = frozenset({
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS",
    "TOKENIZERS_PARALLELISM", "CUDA_DEVICE_MAX_CONNECTIONS", "CUDA_LAUNCH_BLOCKING", "CUDA_MODULE_LOADING",
    "PYTORCH_CUDA_ALLOC_CONF", "NCCL_DEBUG", "NCCL_IB_DISABLE", "NCCL_IB_HCA", "NCCL_P2P_DISABLE",
    "NCCL_P2P_LEVEL", "NCCL_SOCKET_IFNAME", "NCCL_CUMEM_ENABLE", "VLLM_ATTENTION_BACKEND",
    # A sharded replica's ranks name the node's fabric (llmgw.engines.argv.shard_env): an address
    # and an interface name, neither a file nor code.
    "VLLM_HOST_IP", "GLOO_SOCKET_IFNAME",
    "VLLM_LOGGING_LEVEL", "VLLM_WORKER_MULTIPROC_METHOD",
})
# Not here, ever: the switches the agent sets for an engine kind (ENGINE_KIND_ENV: HF_HUB_OFFLINE,
# TRANSFORMERS_OFFLINE, the usage reports). With the hub back on, `--tokenizer org/repo` (a relative
# value, "inside the area" to the path check) or an --hf-overrides auto_map with
# --trust-remote-code made vLLM download files and code; only the owner's engine_env sets them.
# What an engine inherits from the agent's own environment: only what programs need to find
# their tools and speak the locale. Anything else the agent's environment holds (SSH_AUTH_SOCK,
# cloud credentials of root's login shell) is not the engine's; `engine_env` sets more.
INHERITED_ENV = ("PATH", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "LC_MESSAGES", "TZ")
SANDBOX_MODES = ("auto", "bwrap", "none")
# Directories a sandboxed engine never sees (each becomes an empty tmpfs): homes hold keys and
# shell histories; the agent's cache, state and config and the operator's model dirs are
# hidden as a whole and only the one weights entry and the engine's own area are bound back.
SANDBOX_HIDDEN = ("/root", "/home", "/tmp", "/var/tmp", "/run/user")
SYSTEM_DIRS = frozenset({"/", "/etc", "/usr", "/opt", "/var", "/var/lib", "/srv", "/home", "/root", "/tmp"})
BWRAP_CANDIDATES = ("/usr/bin/bwrap", "/usr/local/bin/bwrap", "/bin/bwrap")
SETPRIV_CANDIDATES = ("/usr/bin/setpriv", "/bin/setpriv")
PROBE_TIMEOUT = 10.0

NVIDIA_SMI_QUERY = "index,name,uuid,memory.total,memory.used,ecc.errors.uncorrected.volatile.total"
NVIDIA_SMI_TIMEOUT = 15.0
HTTP_TIMEOUT = 30.0
# Nodes fetching from each other (llmgw.agent.parts.peer): the unit a chunk is checked in, and the
# entry's list of them, kept beside its files (the manifest stays a few hundred bytes).
PEER_CHUNK = 32 << 20
CHUNKS_NAME = "llmgw-chunks.json"
HTTP_ATTEMPTS = 3
SPAWN_TIMEOUT = 30.0
CHUNK = 1 << 20
PROGRESS_EVERY = 0.25
LOG_TAIL_LINES = 20
LOG_ROTATE_BYTES = 64 << 20
KILL_WAIT = 5.0
EXIT_RECORD_WAIT = 2.0
MAX_GRACE = 600.0
SERVE_WORKERS = 8
# One request line may not exceed this: a line without end must not grow the agent's memory.
SERVE_MAX_LINE = 64 << 20
# A manifest is a few hundred bytes; anything bigger is not one of ours.
MAX_MANIFEST_BYTES = 1 << 20
# A dead engine's record, exit file and log are dropped this long after it ended, so state_dir
# does not grow with every replica the fleet ever ran.
ENGINE_RECORD_TTL = 24 * 3600.0

PUBLIC_VERBS = ("hello", "inventory", "lease", "fetch", "seed", "start", "stop", "status", "remove-weights", "serve")
INTERNAL_VERBS = ("_fetch-worker", "_engine-monitor", "_peer-server")
USAGE = "usage: llmgw_agent.py [--config CONFIG] {" + ",".join(PUBLIC_VERBS) + "}"

JsonDict = Dict[str, Any]


class AgentError(Exception):
    """The request cannot be served; the answer is {"error": message} and a non-zero exit."""

    exit_code = 1


class UsageError(AgentError):
    """The command line (or SSH_ORIGINAL_COMMAND) names no known verb: nothing is run."""

    exit_code = 2


class FetchFailed(Exception):
    """A download failed in a way worth reporting as the fetch's error (not a bug)."""


class Refused(AgentError):
    """A start the node's owner does not allow. `setting` names the node config key that would
    allow it, so the controller can show the operator which knob to turn (or not turn)."""

    def __init__(self, message: str, *, setting: str) -> None:
        super().__init__(message)
        self.setting = setting


def _field(request: JsonDict, key: str) -> Any:
    if key not in request:
        raise AgentError(f"missing field {key!r}")
    return request[key]


def _optional(request: JsonDict, key: str, default: Any) -> Any:
    """An optional field; null counts as absent (callers send {"env": null} for "none")."""
    value = request.get(key)
    return default if value is None else value
