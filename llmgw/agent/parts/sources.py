"""Weight sources as a fetch request names them, and the progress record a fetch keeps."""

from __future__ import annotations

import os
import threading
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any, Optional

from llmgw.agent.parts.files import write_json_atomic
from llmgw.agent.parts.protocol import (
    HF_SOURCE_RE,
    PROGRESS_EVERY,
    S3_SOURCE_RE,
    SOURCE_FORBIDDEN_RE,
    AgentError,
    JsonDict,
)


@dataclass(frozen=True)
class Source:
    text: str
    kind: str  # "file", "http", "hf" or "s3"
    location: str  # a local path, a URL, a Hugging Face repo id or an S3 bucket
    revision: Optional[str] = None  # hf://: the revision asked for
    key: Optional[str] = None  # s3://: the key prefix under the bucket


def parse_source(text: Any) -> Source:
    if not isinstance(text, str) or not text:
        raise AgentError("fetch: source must be a non-empty string")
    if SOURCE_FORBIDDEN_RE.search(text):
        raise AgentError("fetch: source contains whitespace or shell metacharacters; refused")
    try:
        text.encode("utf-8")
    except UnicodeError as exc:  # a lone surrogate: it has no cache name and no file name
        raise AgentError("fetch: source is not valid Unicode text") from exc
    if text.startswith("hf://"):
        match = HF_SOURCE_RE.match(text)
        if not match:
            raise AgentError("fetch: hf:// sources look like hf://org/repo[@revision]")
        return Source(text, "hf", match.group(1), match.group(2))
    if text.startswith("s3://"):
        match = S3_SOURCE_RE.match(text)
        if not match or "//" in match.group(2) or any(p in (".", "..") for p in match.group(2).split("/")):
            raise AgentError("fetch: s3:// sources look like s3://bucket/key-prefix (a bucket name of 3 to 63 "
                             "characters a-z, 0-9, '.' and '-', then a key without '.', '..' or '//' segments)")
        return Source(text, "s3", match.group(1), key=match.group(2))
    if text.startswith(("http://", "https://")):
        if not urllib.parse.urlsplit(text).netloc:
            raise AgentError("fetch: the URL has no host")
        return Source(text, "http", text)
    if text.startswith("file://"):
        parts = urllib.parse.urlsplit(text)
        if parts.netloc not in ("", "localhost"):
            raise AgentError("fetch: file:// sources must be local (file:///abs/path)")
        path = urllib.parse.unquote(parts.path)
    elif text.startswith("/"):
        path = text
    else:
        raise AgentError("fetch: unsupported source; use hf://, s3://, http(s)://, file:/// or an absolute path")
    if not path.startswith("/") or "\0" in path or ".." in path.split("/"):
        raise AgentError("fetch: a local source must be an absolute path without '..'")
    return Source(text, "file", os.path.normpath(path))


class FetchProgress:
    """Writes the fetch's state file: the first update at once, then at most every PROGRESS_EVERY s."""

    def __init__(self, path: str, state: JsonDict) -> None:
        self._path = path
        self._state = state
        self._last = 0.0
        self._mutex = threading.Lock()

    def update(self, done: int, total: Optional[int], *, force: bool = False) -> None:
        with self._mutex:
            self._state.update(bytes_done=done, bytes_total=total)
            now = time.monotonic()
            if force or now - self._last >= PROGRESS_EVERY:
                self._last = now
                self._write()

    def finish(self, state: str, *, error: Optional[str] = None, size: Optional[int] = None) -> None:
        with self._mutex:
            self._state.update(state=state, error=error)
            if size is not None:
                self._state.update(bytes_done=size, bytes_total=size)
            self._write()

    def _write(self) -> None:
        self._state["updated_at"] = time.time()
        write_json_atomic(self._path, self._state)
