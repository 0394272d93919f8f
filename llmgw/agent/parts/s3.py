"""s3:// sources: objects from S3 or an S3-compatible store (MinIO, Ceph, R2), read with AWS
Signature V4 written here in the standard library (the agent stays stdlib-only).

``s3://bucket/prefix`` is one object (the key itself: stored as ``<entry>/<its last segment>``,
as an http(s) file is) or every object under ``prefix/`` (stored under their paths below it).
Each object is read with ranged GETs that resume from what is on disk, pinned to the ETag the
listing gave (``If-Match``: an object replaced meanwhile is not spliced from two versions), and
verified: its size, and its MD5 where the ETag is one (an object uploaded in one part). Objects
verified are noted in the entry's temporary directory, so a fetch killed and run again reads
only what it did not have. Errors name the bucket and the key and S3's own code, never the
credentials; a redirect (a bucket in another region) is not followed with the signature.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import json
import os
import re
import stat
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from llmgw.agent.parts.config import S3Config
from llmgw.agent.parts.download import _range_start
from llmgw.agent.parts.local import _remove_any
from llmgw.agent.parts.protocol import AGENT_VERSION, CHUNK, HTTP_ATTEMPTS, HTTP_TIMEOUT, MANIFEST_NAME, FetchFailed
from llmgw.agent.parts.sources import FetchProgress, Source

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
S3_DONE = ".llmgw-s3-verified.json"  # in the temporary directory only: the objects already verified
S3_NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"
MAX_S3_OBJECTS = 100_000  # a listing longer than this is not a model
MAX_S3_PAGES = 1_000  # of 1,000 keys each
MAX_S3_PAGE = 8 << 20
SIZE_RE = re.compile(r"^[0-9]{1,15}$")
ETAG_RE = re.compile(r"^[!#-~]{0,128}$")  # printable ASCII without '"': it goes into If-Match
REGION_RE = re.compile(r"^[a-z0-9-]{1,32}$")


@dataclass(frozen=True)
class S3Access:
    """The node's S3 settings resolved (config, then environment)."""

    endpoint: str  # scheme://host[:port], no path
    region: str
    path_style: bool
    access_key_id: str
    secret_access_key: str
    session_token: str

    def __repr__(self) -> str:  # the secret never in a traceback's locals or a log
        return f"S3Access(endpoint={self.endpoint!r}, region={self.region!r}, path_style={self.path_style})"


@dataclass(frozen=True)
class S3Object:
    key: str
    relative: str  # where it lands under the entry
    size: int
    etag: str


class _S3Retry(Exception):
    """A transient failure: try again, resuming from what is on disk."""


class _S3Status(Exception):
    def __init__(self, status: int, code: str, message: str, region: str = "") -> None:
        super().__init__(f"HTTP {status} {code}")
        self.status, self.code, self.message, self.region = status, code, message, region


def resolve_access(cfg: S3Config, environ: Optional[Dict[str, str]] = None) -> S3Access:
    env = os.environ if environ is None else environ
    region = cfg.region or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1"
    endpoint = cfg.endpoint or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or ""
    named = bool(endpoint)
    if not endpoint:
        endpoint = f"https://s3.{region}.amazonaws.com"
    if not REGION_RE.match(region):
        raise FetchFailed(f"the node's S3 region {region[:40]!r} is not a region name (a-z, 0-9 and '-')")
    parts = urllib.parse.urlsplit(endpoint)
    if (parts.scheme not in ("http", "https") or not parts.hostname or parts.username is not None
            or parts.path not in ("", "/") or parts.query or parts.fragment):
        # Never shown whole: a URL with user:password@ in it would put the password in the error.
        raise FetchFailed(f"the node's S3 endpoint ({parts.scheme}://{parts.hostname or ''}) must be "
                          "scheme://host[:port] only: no user or password in it, no path, query or fragment")

    def from_file(name: str, what: str) -> str:
        if not name:
            return ""
        try:
            with open(name, encoding="utf-8") as fh:
                return fh.read().strip()
        except OSError as exc:
            raise FetchFailed(f"the node's s3.{what} {name} is unreadable: {exc.strerror}") from None

    key_id = cfg.access_key_id or env.get("AWS_ACCESS_KEY_ID", "")
    secret = from_file(cfg.secret_access_key_file, "secret_access_key_file") or (
        "" if cfg.access_key_id and cfg.secret_access_key_file else env.get("AWS_SECRET_ACCESS_KEY", ""))
    token = from_file(cfg.session_token_file, "session_token_file") or env.get("AWS_SESSION_TOKEN", "")
    if any(not c.isprintable() or c.isspace() for c in key_id + secret + token):
        raise FetchFailed("the node's S3 credentials hold spaces or control characters (a file with two lines?)")
    if bool(key_id) != bool(secret):
        raise FetchFailed("the node's S3 credentials are half set: an access key id needs its secret (s3."
                          "secret_access_key_file or AWS_SECRET_ACCESS_KEY) and the other way round")
    path_style = cfg.path_style if cfg.path_style is not None else named
    return S3Access(f"{parts.scheme}://{parts.netloc}", region, path_style, key_id, secret, token)


def _quote(text: str) -> str:
    return urllib.parse.quote(text, safe="-_.~")


def sign_v4(access: S3Access, method: str, host: str, path: str, query: List[Tuple[str, str]],
            now: datetime.datetime) -> Dict[str, str]:
    """The headers that sign a bodiless request (AWS Signature V4, service s3); unsigned without
    credentials. ``path`` is already percent-encoded as sent."""
    amz_date = now.strftime("%Y%m%dT%H%M%SZ")
    headers = {"host": host, "x-amz-content-sha256": EMPTY_SHA256, "x-amz-date": amz_date}
    if access.session_token:
        headers["x-amz-security-token"] = access.session_token
    if not access.access_key_id:
        return {k: v for k, v in headers.items() if k != "host"}
    canonical_query = "&".join(f"{_quote(k)}={_quote(v)}" for k, v in sorted(query))
    signed = sorted(headers)
    canonical = "\n".join([method, path, canonical_query, *(f"{k}:{headers[k].strip()}" for k in signed), "",
                           ";".join(signed), EMPTY_SHA256])
    scope = f"{amz_date[:8]}/{access.region}/s3/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    key = ("AWS4" + access.secret_access_key).encode()
    for part in (amz_date[:8], access.region, "s3", "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    headers["Authorization"] = (f"AWS4-HMAC-SHA256 Credential={access.access_key_id}/{scope}, "
                                f"SignedHeaders={';'.join(signed)}, Signature={signature}")
    return {k: v for k, v in headers.items() if k != "host"}


def _where(access: S3Access, bucket: str, key: str) -> Tuple[str, str]:
    """(host, encoded path) of an object (key "" : the bucket)."""
    netloc = urllib.parse.urlsplit(access.endpoint).netloc
    encoded = urllib.parse.quote(key, safe="/-_.~")
    # A bucket name with dots is not covered by the store's wildcard certificate as a host name:
    # path style then, as the AWS SDKs do.
    if access.path_style or "." in bucket:
        return netloc, f"/{bucket}/{encoded}" if key else f"/{bucket}"
    return f"{bucket}.{netloc}", f"/{encoded}"


def _open(access: S3Access, bucket: str, key: str, query: List[Tuple[str, str]],
          extra: Optional[Dict[str, str]] = None) -> Any:
    import urllib.error
    import urllib.request

    host, path = _where(access, bucket, key)
    headers = sign_v4(access, "GET", host, path, query, datetime.datetime.now(datetime.timezone.utc))
    headers["User-Agent"] = f"llmgw-agent/{AGENT_VERSION}"
    headers.update(extra or {})
    scheme = urllib.parse.urlsplit(access.endpoint).scheme
    url = f"{scheme}://{host}{path}" + ("?" + "&".join(f"{_quote(k)}={_quote(v)}" for k, v in query) if query else "")

    class Stay(urllib.request.HTTPRedirectHandler):
        # urllib follows a redirect with the request's headers: the signature would go to
        # another host. Answered as the 3xx it is (a bucket in another region says which).
        def redirect_request(self, *_args: Any) -> None:
            return None

    opener = urllib.request.build_opener(Stay)
    try:
        return opener.open(urllib.request.Request(url, headers=headers), timeout=HTTP_TIMEOUT)
    except urllib.error.HTTPError as exc:
        with exc:
            body = exc.read(64 << 10)
            status, region = exc.code, exc.headers.get("x-amz-bucket-region", "")
        code, message = _error_of(body)
        if status >= 500 or status == 429 or code in ("SlowDown", "InternalError", "RequestTimeout"):
            raise _S3Retry(f"HTTP {status} {code}".strip()) from None
        raise _S3Status(status, code, message, region) from None


def _error_of(body: bytes) -> Tuple[str, str]:
    """S3's error code and message (only those: its body may echo the request's signature)."""
    import xml.etree.ElementTree as ET

    try:
        root = ET.fromstring(body)
    except ET.ParseError:
        return "", ""
    code, message = root.findtext("Code") or "", root.findtext("Message") or ""
    printable = "".join(c for c in message if c.isprintable())[:200]
    return "".join(c for c in code if c.isalnum())[:64], printable


def list_objects(access: S3Access, bucket: str, prefix: str) -> List[S3Object]:
    """The objects the source names: the key itself, or those under ``prefix/`` (their paths below it)."""
    import xml.etree.ElementTree as ET

    out: List[S3Object] = []
    token = ""
    seen_tokens = set()
    below = prefix if prefix.endswith("/") else prefix + "/"
    for _page in range(MAX_S3_PAGES):
        query = [("list-type", "2"), ("prefix", prefix)] + ([("continuation-token", token)] if token else [])
        with _open(access, bucket, "", query) as response:
            body = response.read(MAX_S3_PAGE + 1)
        if len(body) > MAX_S3_PAGE:  # a page of 1,000 keys is well under a megabyte; parsed, this takes 20x
            raise FetchFailed(f"a listing page of s3://{bucket}/{prefix} over {MAX_S3_PAGE >> 20} MiB; refused")
        try:
            root = ET.fromstring(body)
        except ET.ParseError as exc:
            raise _S3Retry(f"an unreadable listing of s3://{bucket}/{prefix} ({exc})") from None
        for item in root.iter(f"{S3_NS}Contents"):
            key = item.findtext(f"{S3_NS}Key") or ""
            size_text = item.findtext(f"{S3_NS}Size") or ""
            etag = (item.findtext(f"{S3_NS}ETag") or "").strip('"')
            # What goes into a header or a number is checked first: a store's listing is its word.
            if not SIZE_RE.match(size_text) or not ETAG_RE.match(etag):
                raise _S3Retry(f"a listing of s3://{bucket}/{prefix} with no plain size or ETag for an object")
            if key == prefix and not key.endswith("/"):
                relative = key.rsplit("/", 1)[-1]
            elif key.startswith(below) and not key.endswith("/"):
                relative = key[len(below):]
            else:
                continue  # a sibling that merely starts alike (prefix2/...), or a folder marker
            out.append(S3Object(key, _safe_relative(bucket, key, relative), int(size_text), etag))
            if len(out) > MAX_S3_OBJECTS:
                raise FetchFailed(f"s3://{bucket}/{prefix} holds more than {MAX_S3_OBJECTS} objects")
        if root.findtext(f"{S3_NS}IsTruncated") != "true":
            break
        token = root.findtext(f"{S3_NS}NextContinuationToken") or ""
        if not token or token in seen_tokens:  # a store that would page for ever
            raise _S3Retry(f"a truncated listing of s3://{bucket}/{prefix} without a new continuation token")
        seen_tokens.add(token)
    else:
        raise FetchFailed(f"the listing of s3://{bucket}/{prefix} ran past {MAX_S3_PAGES} pages; refused")
    paths = {o.relative for o in out}
    for o in out:  # "a" and "a/b" both objects: a file and a directory of one name
        parent = o.relative.rsplit("/", 1)[0] if "/" in o.relative else ""
        while parent:
            if parent in paths:
                raise FetchFailed(f"s3://{bucket}/{prefix}: {parent} is both an object and a prefix of others "
                                  f"({o.relative}); the entry cannot hold both")
            parent = parent.rsplit("/", 1)[0] if "/" in parent else ""
    if any(o.relative == o.key.rsplit("/", 1)[-1] and o.key == prefix for o in out) and len(out) > 1:
        # Both an object named like the prefix and objects below it: which one was meant is unknown.
        raise FetchFailed(f"s3://{bucket}/{prefix} is both an object and a prefix of others; name one")
    return out


def _safe_relative(bucket: str, key: str, relative: str) -> str:
    """Where an object lands under the entry: a plain relative path, or the fetch fails (a key is
    anyone's who can write the bucket: never a way out of the cache entry)."""
    parts = relative.split("/")
    if (not relative or any(p in ("", ".", "..") or p.startswith(".llmgw-") for p in parts) or "\0" in relative
            or not all(c.isprintable() for c in relative) or relative == MANIFEST_NAME):
        raise FetchFailed(f"s3://{bucket}/{key}: the key is no plain relative path under the source; refused")
    return relative


def download_s3(source: Source, tmp: str, progress: FetchProgress, cfg: S3Config) -> None:
    assert source.key is not None
    bucket, prefix = source.location, source.key
    access = resolve_access(cfg)
    os.makedirs(tmp, exist_ok=True)
    last: Exception = FetchFailed("no attempt made")
    for attempt in range(HTTP_ATTEMPTS):
        try:
            _s3_attempt(access, bucket, prefix, tmp, progress)
            return
        except _S3Status as exc:
            raise FetchFailed(_explain(exc, bucket, prefix, access)) from None
        except (_S3Retry, OSError) as exc:
            last = exc
        except Exception as exc:  # http.client's own errors (IncompleteRead, RemoteDisconnected)
            if type(exc).__module__ != "http.client":
                raise
            last = exc
        if attempt + 1 < HTTP_ATTEMPTS:
            time.sleep(0.5 * 2 ** attempt)
    raise FetchFailed(f"reading s3://{bucket}/{prefix} from {access.endpoint} failed: {last}")


def _explain(exc: _S3Status, bucket: str, key: str, access: S3Access) -> str:
    where = f"s3://{bucket}/{key}"
    said = f"{exc.code}: {exc.message}" if exc.code else f"HTTP {exc.status}"
    if exc.status in (301, 307, 400) and exc.region:
        return f"{where}: the bucket is in region {exc.region}, not {access.region}: set s3.region on the node"
    if exc.status == 403:
        return f"{where}: access denied by {access.endpoint} ({said}); check the node's S3 credentials and policy"
    if exc.status == 404:
        return f"{where}: not found at {access.endpoint} ({said})"
    return f"{where}: HTTP {exc.status} from {access.endpoint} ({said})"


def _s3_attempt(access: S3Access, bucket: str, prefix: str, tmp: str, progress: FetchProgress) -> None:
    objects = list_objects(access, bucket, prefix)
    if not objects:
        raise FetchFailed(f"s3://{bucket}/{prefix}: no object there at {access.endpoint} (nor under "
                          f"{prefix.rstrip('/')}/)")
    total = sum(o.size for o in objects)
    done_path = os.path.join(tmp, S3_DONE)
    # Key -> [ETag, size, verified]: what each file on disk was read from (a partial file of
    # another version of its object is read again whole, never spliced with the new one).
    record = _read_verified(done_path)
    done = sum(o.size for o in objects if record.get(o.key) == [o.etag, o.size, True] and _has(tmp, o))
    progress.update(done, total, force=True)
    for o in objects:
        if record.get(o.key) == [o.etag, o.size, True] and _has(tmp, o):
            continue
        if record.get(o.key, [None])[0] != o.etag:
            _remove_if_any(os.path.join(tmp, o.relative))
        record[o.key] = [o.etag, o.size, False]
        _write_verified(done_path, record)
        done = _fetch_object(access, bucket, o, tmp, progress, done, total)
        record[o.key] = [o.etag, o.size, True]
        _write_verified(done_path, record)
    _keep_only(tmp, {o.relative for o in objects})  # an earlier try's file of a key gone since is not the model's


def _remove_if_any(path: str) -> None:
    try:
        _remove_any(path)
    except FileNotFoundError:
        pass


def _keep_only(tmp: str, wanted: set) -> None:
    """Leave in ``tmp`` the listed files only (and no sidecar): the entry is what the listing says."""
    for root, dirs, names in os.walk(tmp, topdown=False):
        for name in names:
            path = os.path.join(root, name)
            if os.path.relpath(path, tmp) not in wanted:
                os.unlink(path)
        for name in dirs:
            path = os.path.join(root, name)
            if not os.path.islink(path) and not os.listdir(path):
                os.rmdir(path)


def _has(tmp: str, o: S3Object) -> bool:
    try:
        info = os.lstat(os.path.join(tmp, o.relative))
    except OSError:
        return False
    return stat.S_ISREG(info.st_mode) and info.st_size == o.size


def _read_verified(path: str) -> Dict[str, List[Any]]:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_verified(path: str, verified: Dict[str, List[Any]]) -> None:
    tmp = path + ".new"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(verified, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _fetch_object(access: S3Access, bucket: str, o: S3Object, tmp: str, progress: FetchProgress,
                  done: int, total: int) -> int:
    """Read one object into place (resuming a partial file), verified; returns the bytes done."""
    dest = os.path.join(tmp, o.relative)
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    if o.size == 0:  # an empty object is a file all the same (a marker an engine may look for)
        os.close(os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o666))
        return done
    try:
        info: Optional[os.stat_result] = os.lstat(dest)
    except FileNotFoundError:
        info = None
    if info is not None and (not stat.S_ISREG(info.st_mode) or info.st_size > o.size):
        _remove_any(dest)  # a link, a directory or more than the object: never written through
        info = None
    offset = info.st_size if info is not None else 0
    # An MD5 ETag (one part) is verified; the bytes on disk count toward it.
    md5 = hashlib.md5(usedforsecurity=False) if _is_md5(o.etag) else None
    if md5 is not None and offset:
        with open(dest, "rb") as fh:
            for block in iter(lambda: fh.read(CHUNK), b""):
                md5.update(block)
    done += offset
    if offset < o.size:
        extra = {"Range": f"bytes={offset}-"} if offset else {}
        if o.etag:
            extra["If-Match"] = f'"{o.etag}"'
        try:
            response = _open(access, bucket, o.key, [], extra)
        except _S3Status as exc:
            if exc.status == 412:  # replaced since the listing: read it whole again, listed again
                _remove_if_any(dest)
                raise _S3Retry(f"s3://{bucket}/{o.key} changed while it was read") from None
            raise
        with response:
            # An object encrypted with KMS or a customer key has an ETag that is not its MD5.
            if response.headers.get("x-amz-server-side-encryption") == "aws:kms" or response.headers.get(
                    "x-amz-server-side-encryption-customer-algorithm"):
                md5 = None
            if offset:
                # Resumed where the Content-Range says so (some stores answer 200 with it, not 206);
                # the whole object sent again instead is taken from its first byte.
                start = _range_start(response.headers.get("Content-Range"))
                if start == 0 or (start is None and response.status == 200):
                    done -= offset
                    offset = 0
                    md5 = hashlib.md5(usedforsecurity=False) if md5 is not None else None
                elif start != offset:
                    raise _S3Retry(f"s3://{bucket}/{o.key}: the store did not resume at byte {offset}")
            mode = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_APPEND if offset else os.O_TRUNC)
            with os.fdopen(os.open(dest, mode, 0o666), "ab" if offset else "wb") as out:
                written = offset
                while True:
                    chunk = response.read1(CHUNK)
                    if not chunk:
                        break
                    if written + len(chunk) > o.size:
                        raise _S3Retry(f"s3://{bucket}/{o.key}: more bytes than the {o.size} listed")
                    out.write(chunk)
                    if md5 is not None:
                        md5.update(chunk)
                    written += len(chunk)
                    done += len(chunk)
                    progress.update(done, total)
        if written != o.size:
            raise _S3Retry(f"s3://{bucket}/{o.key}: the connection closed after {written} of {o.size} bytes")
    if md5 is not None and md5.hexdigest() != o.etag.lower():
        os.unlink(dest)
        raise _S3Retry(f"s3://{bucket}/{o.key}: what was read does not match its ETag (MD5); read again")
    progress.update(done, total, force=True)
    return done


def _is_md5(etag: str) -> bool:
    return len(etag) == 32 and all(c in "0123456789abcdefABCDEF" for c in etag)
