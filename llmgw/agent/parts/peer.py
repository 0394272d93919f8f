"""Nodes fetch from each other (issue 42).

A node holding a complete cache entry serves it, read-only and chunk by chunk, to fleet nodes
that hold a token the controller issued for that fetch (``seed``: the controller registers the
token's digest with the node that has the entry, which starts its peer server on
``fabric_address:peer_port`` if it is not running). The entry's chunk list (each file's size
and the SHA-256 of every PEER_CHUNK bytes) is written when the entry is made, from what came
from the origin; the fetching node is handed the list's digest by the controller, over its own
SSH channel, so a peer that lies about the list or a chunk is caught. Chunks are written in
order, each only once verified, so a file is always a verified prefix: a fetch killed and run
again continues from it, and one that falls back to the origin resumes from it too.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import json
import os
import stat
import threading
import time
import urllib.parse
from typing import Any, Dict, List, Optional, Set, Tuple

from llmgw.agent.parts.cache import inspect_entry
from llmgw.agent.parts.config import NodeConfig
from llmgw.agent.parts.files import _ensure_dir, fetch_paths, lock_is_held, read_json, write_json_atomic
from llmgw.agent.parts.growing import growing_path
from llmgw.agent.parts.protocol import (
    AGENT_VERSION,
    CACHE_NAME_RE,
    CHUNKS_NAME,
    HTTP_TIMEOUT,
    MANIFEST_NAME,
    PEER_CHUNK,
    TMP_PREFIX,
    AgentError,
    JsonDict,
    Refused,
    _field,
)
from llmgw.agent.parts.sources import FetchProgress
from llmgw.agent.parts.spawn import _detach, _reply_and_release_stdio, spawn_detached

MAX_TOKEN_TTL = 86400.0
MAX_TOKENS = 4096
MAX_CHUNK_LIST_BYTES = 32 << 20
# A followed node that reads nothing more from the origin for this long is given up on: its
# followers read the origin themselves (from what they verified so far). Long: the node hashes its
# whole entry once more when its download ends (hundreds of GB at a GB/s), and says nothing meanwhile.
FOLLOW_STALL = 600.0
FOLLOW_POLL = 0.25  # seconds between asks of a followed node that has nothing new
MAC_HEADER = "X-Llmgw-Signature"
PEER_ATTEMPTS = 4  # a peer that answers 503 (busy) or not at all is asked again, after 1, 2, 4 s


def chunk_list(directory: str) -> JsonDict:
    """Every regular file under ``directory`` (links and the agent's own files left out), with
    its size and the SHA-256 of each PEER_CHUNK bytes, in a fixed order."""
    files: List[JsonDict] = []
    for root, dirs, names in os.walk(directory):
        dirs.sort()
        for name in sorted(names):
            path = os.path.join(root, name)
            relative = os.path.relpath(path, directory)
            if relative in (MANIFEST_NAME, CHUNKS_NAME) or not stat.S_ISREG(os.lstat(path).st_mode):
                continue
            sums = []
            with open(path, "rb") as fh:
                for block in iter(lambda: fh.read(PEER_CHUNK), b""):
                    sums.append(hashlib.sha256(block).hexdigest())
            files.append({"path": relative, "size": os.path.getsize(path), "sha256": sums})
    return {"chunk": PEER_CHUNK, "files": files}


def encode_chunk_list(chunks: JsonDict) -> bytes:
    return json.dumps(chunks, sort_keys=True, separators=(",", ":")).encode()


def chunk_list_digest(entry: str) -> Optional[str]:
    """The SHA-256 of the entry's chunk list as a peer server sends it; None when it has none."""
    listing = _entry_chunk_list(entry)
    return None if listing is None else hashlib.sha256(encode_chunk_list(listing)).hexdigest()


def _tokens_path(cfg: NodeConfig) -> str:
    return os.path.join(cfg.state_dir, "peer-tokens.json")


def _server_path(cfg: NodeConfig) -> str:
    return os.path.join(cfg.state_dir, "peer-server.json")


def verb_seed(cfg: NodeConfig, request: JsonDict) -> JsonDict:
    """Let the holder of the token whose SHA-256 is ``token_sha256`` read cache entry ``name`` for
    ``ttl`` seconds; start the peer server if it is not running. Answers its URL and the digest
    of the entry's chunk list (what the fetching node checks the list it reads against)."""
    if cfg.peer_port is None:
        raise Refused("seed: this node serves no peers (set peer_port in its config)", setting="peer_port")
    name, digest, ttl = _field(request, "name"), _field(request, "token_sha256"), request.get("ttl", 3600)
    if not isinstance(name, str) or not CACHE_NAME_RE.match(name):
        raise AgentError("seed: name must be a cache name")
    if not _hex64(digest):
        raise AgentError("seed: token_sha256 must be 64 lowercase hex digits")
    if not isinstance(ttl, (int, float)) or isinstance(ttl, bool) or not 0 < ttl <= MAX_TOKEN_TTL:
        raise AgentError(f"seed: ttl must be seconds from 0 to {MAX_TOKEN_TTL:g}")
    mac_key = request.get("mac_key")
    if mac_key is not None and not _hex64(mac_key):
        raise AgentError("seed: mac_key must be 64 lowercase hex digits")
    manifest, problem = inspect_entry(cfg.cache_dir, name)
    listing = None
    if manifest is not None:
        listing = _entry_chunk_list(os.path.join(cfg.cache_dir, name))
        if listing is None:
            raise AgentError(f"seed: {name} has no chunk list (fetched by an older agent); it is not served")
    elif not _growing_here(cfg, name):
        raise AgentError(f"seed: {name} is neither a complete cache entry here ({problem}) nor read from the "
                         "origin here now")
    # One seed at a time on a node: the controller seeds several fetches from one holder at once,
    # and two read-modify-writes of the tokens lost one, two servers raced for the port.
    _ensure_dir(cfg.state_dir)
    lock = os.open(os.path.join(cfg.state_dir, "peer.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        now = time.time()
        tokens = [t for t in (read_json(_tokens_path(cfg)) or {}).get("tokens", [])
                  if isinstance(t, dict) and isinstance(t.get("expires"), (int, float)) and t["expires"] > now]
        made = {"sha256": digest, "name": name, "expires": now + float(ttl)}
        if mac_key is not None:
            made["mac_key"] = mac_key  # what its answers are signed with (the tokens file is the agent's only)
        tokens = (tokens + [made])[-MAX_TOKENS:]
        write_json_atomic(_tokens_path(cfg), {"tokens": tokens})
        os.chmod(_tokens_path(cfg), 0o600)
        _ensure_server(cfg)
    finally:
        os.close(lock)
    url = f"http://{_host(cfg.fabric_address)}:{cfg.peer_port}"
    if listing is None:  # followed as it reads the origin: its chunks as they come, its list at the end
        return {"url": url, "growing": True}
    return {"url": url, "chunks_sha256": hashlib.sha256(encode_chunk_list(listing)).hexdigest()}


def _growing_here(cfg: NodeConfig, name: str) -> bool:
    """A fetch worker reads entry ``name`` from the origin here now, hashing its chunks as they come."""
    return os.path.exists(growing_path(cfg.state_dir, name)) and lock_is_held(fetch_paths(cfg.state_dir, name)[1])


def _growing_answer(cfg: NodeConfig, name: str) -> Optional[JsonDict]:
    """What a follower asks for: ``complete`` (the entry is in place: read its chunk list), or the
    sums so far, whether the fetch still runs and how far it is; None: no such fetch here."""
    for _ in range(2):  # the entry may be put in place between the looks: then it is complete
        if inspect_entry(cfg.cache_dir, name)[0] is not None:
            return {"complete": True}
        record = read_json(growing_path(cfg.state_dir, name))
        if record is not None:
            state_path, lock_path, _log = fetch_paths(cfg.state_dir, name)
            state = read_json(state_path) or {}
            running = lock_is_held(lock_path)
            if running or inspect_entry(cfg.cache_dir, name)[0] is None:
                return {"complete": False, "running": running, "files": record.get("files", []),
                        "bytes_done": state.get("bytes_done"), "bytes_total": state.get("bytes_total")}
    return None


def _hex64(text: Any) -> bool:
    return isinstance(text, str) and len(text) == 64 and all(c in "0123456789abcdef" for c in text)


def signature(mac_key: str, body: bytes) -> str:
    """How a peer server signs a list it answers to a follower: HMAC-SHA256 under the key the
    controller gave both over their own SSH channels. Whoever answers at the node's address
    without it (a spoofed address, a port taken while the server was down) cannot sign."""
    return hmac.new(bytes.fromhex(mac_key), body, hashlib.sha256).hexdigest()


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def _entry_chunk_list(entry: str) -> Optional[JsonDict]:
    """The entry's chunk list as its fetch wrote it, or None (an entry of an older agent: it is
    not served, and its readers go to the origin; hashing it here would hold a verb for minutes)."""
    try:
        with open(os.path.join(entry, CHUNKS_NAME), "rb") as fh:
            data = json.loads(fh.read(MAX_CHUNK_LIST_BYTES))
    except (OSError, ValueError):
        return None
    ok = isinstance(data, dict) and isinstance(data.get("files"), list) and data.get("chunk") == PEER_CHUNK
    return data if ok else None


def _ensure_server(cfg: NodeConfig) -> None:
    record = read_json(_server_path(cfg)) or {}
    pid = record.get("pid")
    if isinstance(pid, int) and record.get("port") == cfg.peer_port and _is_peer_server(pid):
        return
    log = os.path.join(cfg.state_dir, "logs", "peer-server.log")
    reply = spawn_detached(cfg, "_peer-server", {}, log_path=log)
    if not isinstance(reply.get("pid"), int):
        raise AgentError(f"seed: the peer server did not start: {reply.get('error', 'no reason given')} (see {log})")


def _is_peer_server(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return b"_peer-server" in fh.read()
    except OSError:
        return False


def verb_peer_server(cfg: NodeConfig, request: JsonDict) -> JsonDict:  # noqa: ARG001 - a verb's signature
    """Internal: serve complete cache entries to token holders until killed."""
    import http.server

    _detach()
    assert cfg.peer_port is not None
    http.server.ThreadingHTTPServer.allow_reuse_address = True
    try:
        server = http.server.ThreadingHTTPServer((cfg.fabric_address, cfg.peer_port), _handler(cfg))
    except OSError as exc:
        _reply_and_release_stdio({"error": f"cannot listen on {cfg.fabric_address}:{cfg.peer_port}: {exc.strerror}"})
        return {}
    server.daemon_threads = True
    write_json_atomic(_server_path(cfg), {"pid": os.getpid(), "port": cfg.peer_port})
    _reply_and_release_stdio({"pid": os.getpid()})
    server.serve_forever()
    return {}


def _handler(cfg: NodeConfig) -> Any:
    import http.server

    class Handler(http.server.BaseHTTPRequestHandler):
        timeout = HTTP_TIMEOUT  # a client that stops reading or writing does not hold a thread for ever
        server_version = "llmgw-agent"  # no version to anyone who connects
        sys_version = ""
        mac_key: Optional[str] = None  # what this request's lists are signed with (its token's)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's name
            pass  # the token never reaches a log; refusals are counted by the fetching side

        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            if not SERVING.acquire(blocking=False):  # a bound on threads and buffers, whoever asks
                return self._say(503, b"too many requests at once; try again")
            try:
                self._get()
            finally:
                SERVING.release()

        def _get(self) -> None:
            parts = urllib.parse.urlsplit(self.path).path.split("/")
            # /v1/<entry>/chunks, /v1/<entry>/<file index>/<chunk index>, /v1/<entry>/growing[/<chunk index>]
            if len(parts) not in (4, 5) or parts[1] != "v1" or not CACHE_NAME_RE.match(parts[2]):
                return self._say(404, b"no such thing")
            name = parts[2]
            opened = self._allowed(name)
            if opened is None:
                return self._say(403, b"this token does not open this entry")
            self.mac_key = opened.get("mac_key") if isinstance(opened.get("mac_key"), str) else None
            if parts[3] == "growing":
                return self._growing(name, parts)
            if inspect_entry(cfg.cache_dir, name)[0] is None:
                return self._say(404, b"no complete entry of that name here")
            entry = os.path.join(cfg.cache_dir, name)
            listing = _entry_chunk_list(entry)
            if listing is None:
                return self._say(404, b"no chunk list for that entry here")
            if len(parts) == 4:
                if parts[3] != "chunks":
                    return self._say(404, b"no such thing")
                return self._say(200, encode_chunk_list(listing), "application/json")
            if not (_decimal(parts[3]) and _decimal(parts[4])) or int(parts[3]) >= len(listing["files"]):
                return self._say(404, b"no such chunk")
            file = listing["files"][int(parts[3])]
            index = int(parts[4])
            relative = file.get("path") if isinstance(file, dict) else None
            if not isinstance(relative, str) or _bad_path(relative) or index >= len(file.get("sha256") or ()):
                return self._say(404, b"no such chunk")
            self._send_chunk(entry, relative, index, last=True)

        def _growing(self, name: str, parts: List[str]) -> None:
            """/v1/<entry>/growing: the sums so far; /v1/<entry>/growing/<chunk index>?path=<file>:
            a whole chunk the origin reader hashed (by path: its list of files may change)."""
            answer = _growing_answer(cfg, name)
            if answer is None:
                return self._say(404, b"that entry is not read from the origin here")
            if len(parts) == 4:
                return self._say(200, json.dumps(answer).encode(), "application/json")
            if answer.get("complete") or not _decimal(parts[4]):
                return self._say(404, b"no such chunk")
            relative = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query).get("path", [""])[0]
            index = int(parts[4])
            sums = next((f.get("sha256") for f in answer["files"] if isinstance(f, dict) and f.get("path") == relative),
                        None)
            if _bad_path(relative) or not isinstance(sums, list) or index >= len(sums):
                return self._say(404, b"no such chunk")
            self._send_chunk(os.path.join(cfg.cache_dir, TMP_PREFIX + name), relative, index, last=False)

        def _send_chunk(self, entry: str, relative: str, index: int, *, last: bool) -> None:
            """Chunk ``index`` of ``relative`` in ``entry``; ``last``: the file's last chunk may be short
            (of a growing file only whole chunks are sent)."""
            path = os.path.join(entry, relative)
            # Inside the entry, through no link (the entry's own name included): the list is only
            # what this node wrote, but an entry is a directory others may have written into.
            inside = os.path.join(os.path.realpath(cfg.cache_dir), os.path.basename(entry), relative)
            if os.path.realpath(path) != inside:
                return self._say(404, b"no such file")
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            except OSError:
                return self._say(404, b"no such file")
            try:
                start = index * PEER_CHUNK
                length = max(0, min(PEER_CHUNK, os.fstat(fd).st_size - start))
                if not last and length < PEER_CHUNK:
                    return self._say(404, b"no such chunk")
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(length))
                self.end_headers()
                sent = 0
                while sent < length:  # a megabyte at a time: 32 MiB per client held is a lot of clients
                    block = os.pread(fd, min(1 << 20, length - sent), start + sent)
                    if not block:
                        break
                    self.wfile.write(block)
                    sent += len(block)
            finally:
                os.close(fd)
            return None

        def _allowed(self, name: str) -> Optional[JsonDict]:
            """The token entry the request's bearer token opens ``name`` with, or None."""
            header = self.headers.get("Authorization", "")
            if not header.startswith("Bearer "):
                return None
            digest = hashlib.sha256(header[len("Bearer "):].encode("utf-8", "surrogateescape")).hexdigest()
            now = time.time()
            return next((t for t in (read_json(_tokens_path(cfg)) or {}).get("tokens", [])
                         if isinstance(t, dict) and t.get("name") == name and isinstance(t.get("expires"), (int, float))
                         and t["expires"] > now and hmac.compare_digest(str(t.get("sha256", "")), digest)), None)

        def _say(self, status: int, body: bytes, kind: str = "text/plain") -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            if status == 200 and kind == "application/json" and self.mac_key is not None:
                self.send_header(MAC_HEADER, signature(self.mac_key, body))
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return Handler


SERVING = threading.BoundedSemaphore(32)  # requests a peer server answers at once


def _decimal(text: str) -> bool:
    return text.isascii() and text.isdigit() and len(text) < 10


def _bad_path(relative: str) -> bool:
    """Not a plain relative path of a file in an entry (or one of the agent's own names)."""
    parts = relative.split("/")
    return (not relative or relative.startswith("/") or "\0" in relative or relative in (MANIFEST_NAME, CHUNKS_NAME)
            or any(p in ("", ".", "..") for p in parts))


class PeerFailed(Exception):
    """The peer could not give what was asked, or gave what does not check out: fall back to the origin."""

    def __init__(self, message: str, status: Optional[int] = None) -> None:
        super().__init__(message)
        self.status = status  # the HTTP status the peer answered, where it answered one


def download_from_peer(peer: JsonDict, name: str, tmp: str, progress: FetchProgress) -> None:
    """Read entry ``name`` from ``peer`` into ``tmp``. ``{url, token, chunks_sha256}``: a complete
    entry, its chunk list checked against the digest the controller handed over, each chunk against
    the list. ``{url, token, follow: true, mac_key}``: the node reading the origin now, its chunks
    read as it hashes them, then the rest by its chunk list once its entry is in place; every list
    it answers signed with ``mac_key`` (which the controller gave it too): its word, which is the
    origin's, and no one else's."""
    url, token, digest, mac_key = peer.get("url"), peer.get("token"), peer.get("chunks_sha256"), peer.get("mac_key")
    follow = peer.get("follow") is True
    if not (isinstance(url, str) and url.startswith("http://") and isinstance(token, str)
            and (isinstance(digest, str) or (follow and _hex64(mac_key)))):
        raise PeerFailed("the peer to read from is not described (url, token, chunks_sha256 or follow and mac_key)")
    signed = mac_key if follow and isinstance(mac_key, str) else None
    try:
        os.makedirs(tmp, exist_ok=True)
        known = _follow(url, token, name, tmp, progress, signed) if signed is not None else {}
        raw = _get(f"{url}/v1/{name}/chunks", token, MAX_CHUNK_LIST_BYTES, signed)
        if signed is None and hashlib.sha256(raw).hexdigest() != digest:
            raise PeerFailed("the peer's chunk list is not the one the controller was told of")
        files = _checked_list(raw)
        total = sum(f[1] for f in files)
        done = 0
        for i, (relative, size, sums) in enumerate(files):
            done = _read_file(url, token, name, tmp, i, relative, size, sums, progress, done, total,
                              known.get(relative, []))
        _remove_unlisted(tmp, {f[0] for f in files})
    except OSError as exc:  # the disk, or a file where a directory must go: the origin's way may do
        raise PeerFailed(f"writing what the peer sent failed ({exc.strerror or type(exc).__name__})") from None
    write_json_atomic(os.path.join(tmp, CHUNKS_NAME), json.loads(raw))


def _follow(url: str, token: str, name: str, tmp: str, progress: FetchProgress, mac_key: str) -> Dict[str, List[str]]:
    """Read the whole chunks the followed node hashed, as it hashes them, until its entry is in
    place; per file, the sums of the chunks written here (each checked against the sum it came with)."""
    have: Dict[str, List[str]] = {}
    last_change, last_seen = time.monotonic(), None
    while True:
        answer = _growing(url, token, name, mac_key)
        if answer.get("complete") is True:
            return have
        files = _checked_growing(answer)
        seen = (answer.get("bytes_done"), sum(len(sums) for _path, sums in files))
        if seen != last_seen:
            last_change, last_seen = time.monotonic(), seen
        read = False
        try:
            for relative, sums in files:
                read |= _follow_file(url, token, name, tmp, relative, sums, have, progress, answer.get("bytes_total"))
        except PeerFailed as exc:
            if exc.status != 404:
                raise
            read = False  # its entry went into place (or a file moved) since it answered: asked again
        if read:
            continue
        if answer.get("running") is not True:
            raise PeerFailed("the node reading the origin stopped before it had the entry")
        if time.monotonic() - last_change > FOLLOW_STALL:
            raise PeerFailed(f"the node reading the origin read nothing more for {FOLLOW_STALL:g} s")
        time.sleep(FOLLOW_POLL)


def _growing(url: str, token: str, name: str, mac_key: str) -> JsonDict:
    try:
        answer = json.loads(_get(f"{url}/v1/{name}/growing", token, MAX_CHUNK_LIST_BYTES, mac_key))
    except ValueError:
        raise PeerFailed("the followed node's sums are not JSON") from None
    if not isinstance(answer, dict):
        raise PeerFailed("the followed node's sums are not of this agent's kind")
    return answer


def _checked_growing(answer: JsonDict) -> List[Tuple[str, List[str]]]:
    files = answer.get("files")
    if not isinstance(files, list) or len(files) > 100_000:
        raise PeerFailed("the followed node's sums are not of this agent's kind")
    out = []
    for f in files:
        relative, sums = (f.get("path"), f.get("sha256")) if isinstance(f, dict) else (None, None)
        if not isinstance(relative, str) or _bad_path(relative) or not isinstance(sums, list) \
                or not all(isinstance(x, str) and len(x) == 64 for x in sums):
            raise PeerFailed(f"the followed node's sums name {str(relative)[:80]!r}, not a plain path in the entry")
        out.append((relative, sums))
    return out


def _follow_file(url: str, token: str, name: str, tmp: str, relative: str, sums: List[str],
                 have: Dict[str, List[str]], progress: FetchProgress, total: Any) -> bool:
    """Write the chunks of ``relative`` not written yet; whether any was."""
    dest = os.path.join(tmp, relative)
    mine = have.get(relative)
    if mine is None:  # first seen in this run: what an earlier, killed run verified is kept
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        good = _verified_prefix(dest, len(sums) * PEER_CHUNK, sums)
        mine = have[relative] = sums[:good // PEER_CHUNK]
    agree = 0
    while agree < len(mine) and agree < len(sums) and mine[agree] == sums[agree]:
        agree += 1
    if agree < len(mine):  # the followed node's file started again: what differs is read again
        del mine[agree:]
    if len(mine) >= len(sums):
        return False
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o666)
    try:
        os.ftruncate(fd, len(mine) * PEER_CHUNK)
        query = urllib.parse.urlencode({"path": relative})
        for index in range(len(mine), len(sums)):
            data = _get(f"{url}/v1/{name}/growing/{index}?{query}", token, PEER_CHUNK)
            if len(data) != PEER_CHUNK or hashlib.sha256(data).hexdigest() != sums[index]:
                raise PeerFailed(f"chunk {index} of {relative} from the followed node does not match its sum")
            os.pwrite(fd, data, index * PEER_CHUNK)
            mine.append(sums[index])
            written = sum(len(x) for x in have.values()) * PEER_CHUNK
            progress.update(written, total if isinstance(total, int) else None)
    finally:
        os.close(fd)
    return True


def _remove_unlisted(tmp: str, listed: Set[str]) -> None:
    """Files a followed node had for a while (a download's partial name) and its entry has not."""
    for root, _dirs, names in os.walk(tmp):
        for base in names:
            path = os.path.join(root, base)
            relative = os.path.relpath(path, tmp)
            if relative not in listed and relative not in (MANIFEST_NAME, CHUNKS_NAME):
                os.unlink(path)


def _checked_list(raw: bytes) -> List[Any]:
    """The list's files as (path, size, sums), or PeerFailed: the digest matched, but a list is
    checked whole before anything is written by it."""
    try:
        listing = json.loads(raw)
    except ValueError:
        raise PeerFailed("the peer's chunk list is not JSON") from None
    files = listing.get("files") if isinstance(listing, dict) else None
    if not isinstance(listing, dict) or listing.get("chunk") != PEER_CHUNK or not isinstance(files, list) \
            or len(files) > 100_000:
        raise PeerFailed("the peer's chunk list is not of this agent's kind")
    out, paths = [], set()
    for f in files:
        relative, size, sums = (f.get("path"), f.get("size"), f.get("sha256")) if isinstance(f, dict) else (0, 0, 0)
        if not isinstance(relative, str) or _bad_path(relative) or relative in paths:
            raise PeerFailed(f"the peer's chunk list names {str(relative)[:80]!r}, not a plain path in the entry")
        if type(size) is not int or size < 0 or not isinstance(sums, list) \
                or len(sums) != -(-size // PEER_CHUNK) or not all(isinstance(x, str) and len(x) == 64 for x in sums):
            raise PeerFailed(f"the peer's chunk list has no plain size and chunk sums for {relative[:80]!r}")
        paths.add(relative)
        out.append((relative, size, sums))
    for relative in paths:  # "a" and "a/b": a file and a directory of one name
        if any(relative.startswith(other + "/") for other in paths):
            raise PeerFailed(f"the peer's chunk list names {relative[:80]!r} under another file")
    return out


def _read_file(url: str, token: str, name: str, tmp: str, i: int, relative: str, size: int, sums: List[str],
               progress: FetchProgress, done: int, total: int, known: List[str]) -> int:
    """``known``: sums of whole chunks this run wrote to the file, each checked as it came (not hashed again)."""
    dest = os.path.join(tmp, relative)
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    have = _known_prefix(dest, size, sums, known) if known else _verified_prefix(dest, size, sums)
    done += have
    progress.update(done, total, force=True)
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o666)
    try:
        os.ftruncate(fd, have)  # a chunk cut short by a kill, or one that does not check out, is read again
        for index in range(have // PEER_CHUNK, len(sums)):
            want = min(PEER_CHUNK, size - index * PEER_CHUNK)
            data = _get(f"{url}/v1/{name}/{i}/{index}", token, want)
            if len(data) != want or hashlib.sha256(data).hexdigest() != sums[index]:
                raise PeerFailed(f"chunk {index} of {relative} from the peer does not match its list")
            os.pwrite(fd, data, index * PEER_CHUNK)
            done += len(data)
            progress.update(done, total)
    finally:
        os.close(fd)
    return done


def _known_prefix(dest: str, size: int, sums: List[str], known: List[str]) -> int:
    """Bytes of ``dest`` from the start whose chunks this run wrote and checked, as far as the list agrees."""
    agree = 0
    while agree < len(known) and agree < len(sums) and known[agree] == sums[agree]:
        agree += 1
    try:
        info = os.lstat(dest)
    except FileNotFoundError:
        return 0
    if not stat.S_ISREG(info.st_mode):
        return _verified_prefix(dest, size, sums)  # (removes it)
    return min(agree * PEER_CHUNK, size, info.st_size)


def _verified_prefix(dest: str, size: int, sums: List[str]) -> int:
    """Bytes of ``dest`` that check out against ``sums``, whole chunks from the start: each is
    hashed again (two holders, or a holder and the origin, may hold other bytes under one name)."""
    try:
        info = os.lstat(dest)
    except FileNotFoundError:
        return 0
    if not stat.S_ISREG(info.st_mode):
        os.unlink(dest)  # a link or other planted thing is never written through
        return 0
    good = 0
    with open(dest, "rb") as fh:
        for expected in sums:
            block = fh.read(PEER_CHUNK)
            if not block or len(block) < min(PEER_CHUNK, size - good) or hashlib.sha256(block).hexdigest() != expected:
                break
            good += len(block)
    return good


def _get(url: str, token: str, limit: int, mac_key: Optional[str] = None) -> bytes:
    """The body at ``url`` (at most ``limit`` bytes and one more, to tell a longer one); with
    ``mac_key``, only one the peer signed with it."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}",
                                                   "User-Agent": f"llmgw-agent/{AGENT_VERSION}"})

    class Stay(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *_args: Any) -> None:
            return None  # the token goes to the peer it was issued for, nowhere else

    failure = PeerFailed("the peer was not asked")
    for attempt in range(PEER_ATTEMPTS):
        if attempt:
            time.sleep(2 ** (attempt - 1))
        try:
            with urllib.request.build_opener(Stay).open(request, timeout=HTTP_TIMEOUT) as response:
                body = response.read(limit + 1)[:limit + 1]
                said = response.headers.get(MAC_HEADER, "")
        except urllib.error.HTTPError as exc:
            exc.close()
            failure = PeerFailed(f"the peer answered HTTP {exc.code}", exc.code)
            if exc.code != 503:  # busy: asked again; any other answer is the peer's word
                raise failure from None
            continue
        except (urllib.error.URLError, OSError, ValueError) as exc:
            failure = PeerFailed(f"the peer could not be read ({type(exc).__name__})")
            continue
        if mac_key is not None and not hmac.compare_digest(said, signature(mac_key, body)):
            raise PeerFailed("the answer is not signed by the node the controller named")
        return body
    raise failure


def fetch_request_peer(request: JsonDict) -> Optional[Dict[str, Any]]:
    """The fetch request's ``peer``, checked for shape (None: from the origin)."""
    peer = request.get("peer")
    if peer is None:
        return None
    if not isinstance(peer, dict) or not all(isinstance(peer.get(k), str) for k in ("url", "token")) \
            or not (isinstance(peer.get("chunks_sha256"), str) or (peer.get("follow") is True
                                                                   and _hex64(peer.get("mac_key")))):
        raise AgentError("fetch: peer must be {url, token, chunks_sha256} or {url, token, follow: true, mac_key}")
    out: Dict[str, Any] = {k: peer[k] for k in ("url", "token", "chunks_sha256", "mac_key", "from")
                           if isinstance(peer.get(k), str)}
    if peer.get("follow") is True:
        out["follow"] = True
    return out
