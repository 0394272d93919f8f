"""The fetch verb and its worker: one download per cache entry, progress on disk."""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
import stat
import sys
import time
from typing import List, Optional, Tuple

from llmgw.agent.parts.cache import MISSING, inspect_entry
from llmgw.agent.parts.config import NodeConfig, S3Config, _is_int
from llmgw.agent.parts.download import download_hf, download_http
from llmgw.agent.parts.files import (
    _ensure_dir,
    _inside,
    _listdir,
    _remove_file,
    fetch_paths,
    lock_is_held,
    read_json,
    tree_bytes,
    write_json_atomic,
)
from llmgw.agent.parts.growing import GrowingHasher, growing_path
from llmgw.agent.parts.local import _remove_any, check_local_source, copy_local
from llmgw.agent.parts.peer import (
    PeerFailed,
    chunk_list,
    chunk_list_digest,
    download_from_peer,
    fetch_request_peer,
)
from llmgw.agent.parts.protocol import (
    AGENT_VERSION,
    CHUNKS_NAME,
    HF_MISSING,
    MANIFEST_NAME,
    TMP_PREFIX,
    FetchFailed,
    JsonDict,
    _field,
    cache_name,
)
from llmgw.agent.parts.s3 import download_s3
from llmgw.agent.parts.sources import FetchProgress, Source, parse_source
from llmgw.agent.parts.spawn import _detach, _reply_and_release_stdio, spawn_detached

# ----------------------------------------------------------------------------------------------
# fetch


def _fetch_paths(cfg: NodeConfig, name: str) -> Tuple[str, str, str]:
    return fetch_paths(cfg.state_dir, name)


def _fetch_state(name: Optional[str], path: str, source: str, state: str, *, done: int = 0,
                 total: Optional[int] = None, error: Optional[str] = None) -> JsonDict:
    return {"name": name, "path": path, "source": source, "state": state, "bytes_done": done,
            "bytes_total": total, "error": error, "operator_copy": False, "updated_at": time.time()}


def verb_fetch(cfg: NodeConfig, request: JsonDict) -> JsonDict:
    """Start (or join) a detached download; answers at once with its state, never waits for it.
    ``peer`` ({url, token, chunks_sha256}): read the entry from that node first (the origin on any doubt)."""
    source = parse_source(_field(request, "source"))
    peer = fetch_request_peer(request)
    plain_path = source.kind == "file" and source.text.startswith("/")
    if plain_path and any(_inside(source.location, d) for d in cfg.model_dirs):
        return _operator_copy(source)
    if source.kind == "file" and peer is None:  # from a peer: the worker checks the origin only if it falls back
        check_local_source(cfg, source.location)
    name = cache_name(source.text)
    final = os.path.join(cfg.cache_dir, name)
    state_path, lock_path, log_path = _fetch_paths(cfg, name)
    manifest, problem = inspect_entry(cfg.cache_dir, name)
    if manifest is not None:
        return _done_state(name, final, manifest)
    if problem != MISSING:
        error = f"{final} exists but is not a complete cache entry ({problem}); an operator must remove it"
        return _record_failure(state_path, _fetch_state(name, final, source.text, "failed", error=error))
    if source.kind == "hf" and importlib.util.find_spec("huggingface_hub") is None:
        return _record_failure(state_path, _fetch_state(name, final, source.text, "failed", error=HF_MISSING))
    lock_fd = _try_lock(lock_path)
    if lock_fd is None:  # a worker holds the lock: join it instead of downloading twice
        current = read_json(state_path)
        if current is None or current.get("state") != "running":
            current = _fetch_state(name, final, source.text, "running")
        return current
    try:
        manifest = inspect_entry(cfg.cache_dir, name)[0]
        if manifest is not None:  # a worker finished between our first look and the lock
            return _done_state(name, final, manifest)
        state = _fetch_state(name, final, source.text, "running")
        write_json_atomic(state_path, state)
        # The worker inherits the locked descriptor, so the lock lives exactly as long as it does.
        payload: JsonDict = {"source": source.text, "lock_fd": lock_fd}
        if peer is not None:
            payload["peer"] = peer
        reply = spawn_detached(cfg, "_fetch-worker", payload, log_path=log_path, pass_fds=(lock_fd,))
        if not _is_int(reply.get("pid")):
            error = f"the fetch worker did not start: {reply.get('error', 'no reason given')}"
            return _record_failure(state_path, dict(state, state="failed", error=error))
    finally:
        os.close(lock_fd)
    return state


def _done_state(name: str, path: str, manifest: JsonDict) -> JsonDict:
    raw = manifest.get("bytes")
    size = raw if isinstance(raw, int) and _is_int(raw) else tree_bytes(path)
    state = _fetch_state(name, path, manifest["source"], "done", done=size, total=size)
    # The digest of the entry's chunk list: what the controller keeps from the node that read the
    # origin, and hands to the nodes that read this entry from a peer (never the peer's own word).
    state["chunks_sha256"] = chunk_list_digest(path)
    return state


def _operator_copy(source: Source) -> JsonDict:
    """A plain path inside model_dirs is the operator's own copy: used where it is, never copied."""
    exists = os.path.exists(source.location)
    size = tree_bytes(source.location) if exists else 0
    missing = None if exists else f"{source.location} does not exist on this node"
    state = _fetch_state(None, source.location, source.text, "done" if exists else "failed",
                         done=size, total=size, error=missing)
    state["operator_copy"] = True
    return state


def _record_failure(state_path: str, state: JsonDict) -> JsonDict:
    write_json_atomic(state_path, state)
    return state


def _try_lock(path: str, attempts: int = 4, delay: float = 0.02) -> Optional[int]:
    """An fd holding an exclusive flock on path, or None while someone else holds it.

    Retries briefly because `status` takes the lock shared for an instant to tell a live worker
    from a dead one; only a lock held across the retries means a running fetch."""
    _ensure_dir(os.path.dirname(path))
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    for attempt in range(attempts):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if attempt + 1 < attempts:
                time.sleep(delay)
    os.close(fd)
    return None


def fetch_views(cfg: NodeConfig) -> List[JsonDict]:
    views = []
    directory = os.path.join(cfg.state_dir, "fetches")
    for file_name in _listdir(directory):
        if not file_name.endswith(".json") or file_name.startswith("."):
            continue
        state = read_json(os.path.join(directory, file_name))
        if state is None:
            continue
        _, lock_path, log_path = _fetch_paths(cfg, str(state.get("name")))
        if state.get("state") == "running" and not lock_is_held(lock_path):
            state = dict(state, state="failed",
                         error=f"the fetch worker stopped before finishing (see {log_path}); fetch again to resume")
        views.append({k: state.get(k) for k in ("name", "path", "source", "state", "bytes_done", "bytes_total",
                                                 "error", "updated_at")})
    return views


def verb_fetch_worker(cfg: NodeConfig, request: JsonDict) -> JsonDict:
    """Internal: the detached download. Holds the fetch lock (inherited fd) until it is done."""
    source = parse_source(request["source"])
    lock_fd = int(request["lock_fd"])
    _detach()
    _reply_and_release_stdio({"pid": os.getpid()})
    name = cache_name(source.text)
    final = os.path.join(cfg.cache_dir, name)
    state_path, _, _ = _fetch_paths(cfg, name)
    progress = FetchProgress(state_path, _fetch_state(name, final, source.text, "running"))
    tmp = os.path.join(cfg.cache_dir, TMP_PREFIX + name)
    # A record of sums an earlier worker left: this one may read from a peer, and must not be followed.
    _remove_file(growing_path(cfg.state_dir, name))
    try:
        os.makedirs(cfg.cache_dir, exist_ok=True)  # the umask's mode: engines may run as another user
        _no_planted_link(tmp)
        peer = request.get("peer")
        from_peer = False
        try:
            if not isinstance(peer, dict):
                raise PeerFailed("no peer")
            download_from_peer(peer, name, tmp, progress)
            from_peer = True
        except PeerFailed as exc:
            if isinstance(peer, dict):
                print(f"reading {name} from the peer {peer.get('url')} failed ({exc}); reading the origin",
                      file=sys.stderr, flush=True)  # the fetch log
        if from_peer:
            size = finalize_entry(source, tmp, final, chunks_checked=True)
        else:
            # A node serving peers hashes what comes as it comes, so others read it meanwhile
            # (llmgw.agent.parts.growing); the record goes once the entry is in place.
            with contextlib.ExitStack() as growing:
                if cfg.peer_port is not None:
                    hasher = growing.enter_context(GrowingHasher(tmp, growing_path(cfg.state_dir, name)))
                download(source, tmp, progress, local_roots=cfg.local_sources + cfg.model_dirs, s3=cfg.s3)
                if cfg.peer_port is not None:
                    hasher.stop()
                size = finalize_entry(source, tmp, final)
        progress.finish("done", size=size)
    except FetchFailed as exc:
        progress.finish("failed", error=str(exc))
    except BaseException as exc:
        # Its type only: an exception's text may carry a header value (a token) it choked on.
        progress.finish("failed", error=f"internal error ({type(exc).__name__}): see the fetch log on the node")
        raise  # the traceback goes to the fetch log
    finally:
        os.close(lock_fd)
    return {}


def _no_planted_link(tmp: str) -> None:
    try:
        planted = not stat.S_ISDIR(os.lstat(tmp).st_mode)
    except FileNotFoundError:
        planted = False
    if planted:  # a link (or file) under our temporary name: writing through it would leave the cache
        _remove_any(tmp)


def download(source: Source, tmp: str, progress: FetchProgress, *, local_roots: Tuple[str, ...],
             s3: S3Config) -> None:
    """Bring the source's content into the directory tmp (which may hold a partial earlier try)."""
    _no_planted_link(tmp)
    if source.kind == "file":
        copy_local(source.location, tmp, progress, local_roots)
    elif source.kind == "http":
        download_http(source.location, tmp, progress)
    elif source.kind == "s3":
        download_s3(source, tmp, progress, s3)
    else:
        download_hf(source, tmp, progress)


def finalize_entry(source: Source, tmp: str, final: str, *, chunks_checked: bool = False) -> int:
    """Write the manifest and rename tmp into place: the rename is the commit point, so an entry
    under its cache name is always complete. ``chunks_checked``: the chunk list came from a peer,
    checked against the controller's digest (kept); otherwise it is made here, from the files, and
    a file of that name from the origin is not taken for it (it would name any file to serve)."""
    chunks = os.path.join(tmp, CHUNKS_NAME)
    if not chunks_checked and os.path.lexists(chunks):
        _remove_any(chunks)
    size = tree_bytes(tmp) - _size_of(chunks)
    if not chunks_checked:
        # What another node checks each chunk it reads from here against (llmgw.agent.parts.peer).
        write_json_atomic(chunks, chunk_list(tmp))
    write_json_atomic(os.path.join(tmp, MANIFEST_NAME), {
        "source": source.text, "fetched_at": time.time(), "bytes": size, "agent_version": AGENT_VERSION})
    try:
        os.rename(tmp, final)
    except OSError as exc:
        raise FetchFailed(f"could not move the download into place: {exc.strerror}") from exc
    return size


def _size_of(path: str) -> int:
    try:
        return os.lstat(path).st_size
    except OSError:
        return 0
