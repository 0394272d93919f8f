"""http(s):// and hf:// sources: resumable downloads with bounded retries."""

from __future__ import annotations

import os
import re
import stat
import threading
import time
import urllib.parse
from typing import Any, Optional

from llmgw.agent.parts.files import tree_bytes
from llmgw.agent.parts.local import _remove_any
from llmgw.agent.parts.protocol import (
    AGENT_VERSION,
    CHUNK,
    HF_MISSING,
    HTTP_ATTEMPTS,
    HTTP_TIMEOUT,
    MANIFEST_NAME,
    FetchFailed,
)
from llmgw.agent.parts.sources import FetchProgress, Source


def _url_filename(url: str) -> str:
    segment = urllib.parse.unquote(urllib.parse.urlsplit(url).path.rsplit("/", 1)[-1])
    if segment in ("", ".", "..", MANIFEST_NAME) or "/" in segment or "\0" in segment:
        return "download"
    return segment


class _Retry(Exception):
    """A transient HTTP failure: try again, resuming from what is on disk."""


def download_http(url: str, tmp: str, progress: FetchProgress) -> None:
    # Imported here: http.client pulls in ssl and email, a third of the start-up time of every
    # other verb, and only the fetch worker needs it.
    import http.client
    import urllib.error

    os.makedirs(tmp, exist_ok=True)
    dest = os.path.join(tmp, _url_filename(url))
    last: Exception = FetchFailed("no attempt made")
    for attempt in range(HTTP_ATTEMPTS):
        try:
            _http_attempt(url, dest, progress)
            return
        except urllib.error.HTTPError as exc:
            exc.close()
            if exc.code < 500:
                raise FetchFailed(f"HTTP {exc.code} {exc.reason} from {url}") from exc
            last = exc
        except (_Retry, urllib.error.URLError, http.client.HTTPException, OSError) as exc:
            last = exc
        if attempt + 1 < HTTP_ATTEMPTS:
            time.sleep(0.5 * 2 ** attempt)
    raise FetchFailed(f"downloading {url} failed: {last}")


def _http_attempt(url: str, dest: str, progress: FetchProgress) -> None:
    import urllib.error
    import urllib.request

    try:
        info = os.lstat(dest)
    except FileNotFoundError:
        info = None
    if info is not None and not stat.S_ISREG(info.st_mode):
        _remove_any(dest)  # a link (or directory) is no partial download: never write through it
        info = None
    offset = info.st_size if info is not None else 0
    headers = {"User-Agent": f"llmgw-agent/{AGENT_VERSION}"}
    if offset:
        headers["Range"] = f"bytes={offset}-"
    try:
        response = urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=HTTP_TIMEOUT)
    except urllib.error.HTTPError as exc:
        if exc.code != 416 or not offset:
            raise
        total = _range_total(exc.headers.get("Content-Range"))
        exc.close()
        if total == offset:  # the partial file is in fact complete
            progress.update(offset, offset, force=True)
            return
        os.unlink(dest)
        raise _Retry("the server refused to resume; starting over") from exc
    with response:
        resumed = offset > 0 and response.status == 206
        if resumed and _range_start(response.headers.get("Content-Range")) != offset:
            os.unlink(dest)
            raise _Retry("the server resumed at the wrong offset; starting over")
        done = offset if resumed else 0  # a 200 to a Range request sends the whole file again
        total = _expected_total(response, done)
        progress.update(done, total, force=True)
        first = True
        mode = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_APPEND if resumed else os.O_TRUNC)
        with os.fdopen(os.open(dest, mode, 0o666), "ab" if resumed else "wb") as out:
            while True:
                chunk = response.read1(CHUNK)  # read1: whatever has arrived, so progress moves
                if not chunk:
                    break
                out.write(chunk)
                done += len(chunk)
                # The first chunk is always written, so a stalled download shows it has begun.
                progress.update(done, total, force=first)
                first = False
    if total is not None and done != total:
        raise _Retry(f"the connection closed after {done} of {total} bytes")


def _expected_total(response: Any, done: int) -> Optional[int]:
    total = _range_total(response.headers.get("Content-Range"))
    if total is not None:
        return total
    length = response.headers.get("Content-Length", "")
    return done + int(length) if length.isdigit() else None


def _range_total(header: Optional[str]) -> Optional[int]:
    match = re.match(r"^bytes\s+(?:\d+-\d+|\*)/(\d+)$", (header or "").strip())
    return int(match.group(1)) if match else None


def _range_start(header: Optional[str]) -> Optional[int]:
    match = re.match(r"^bytes\s+(\d+)-", (header or "").strip())
    return int(match.group(1)) if match else None


def download_hf(source: Source, tmp: str, progress: FetchProgress) -> None:
    try:
        from huggingface_hub import snapshot_download  # optional: only nodes fetching hf:// need it
    except ImportError as exc:
        raise FetchFailed(HF_MISSING) from exc
    os.makedirs(tmp, exist_ok=True)
    stop = threading.Event()
    watcher = threading.Thread(target=_watch_tree, args=(tmp, progress, stop), daemon=True)
    watcher.start()
    try:
        # local_dir (not cache_dir) so the entry holds real files, not links into a hub cache;
        # huggingface_hub resumes what an earlier try left there.
        snapshot_download(repo_id=source.location, revision=source.revision, local_dir=tmp)
    except (OSError, ValueError) as exc:  # hub errors derive from these (HTTP errors are OSErrors)
        raise FetchFailed(f"huggingface_hub: {exc}") from exc
    finally:
        stop.set()
        watcher.join()


def _watch_tree(path: str, progress: FetchProgress, stop: threading.Event) -> None:
    """Progress for downloads that report none: the size of what is on disk so far."""
    while not stop.wait(1.0):
        progress.update(tree_bytes(path), None)
