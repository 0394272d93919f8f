"""The chunk sums of an entry still being read from the origin (issue 42: nodes follow the reader).

Nodes waiting for a copy used to start only once the node reading the origin had the whole entry,
and then all read it at once: the fleet took the origin's time plus a whole copy's. Instead, the
node that reads the origin hashes each PEER_CHUNK of its files as the download completes it, and
keeps the sums in a record its peer server reads (``<state>/growing/<name>.json``), so the others
read each chunk as soon as it is there, and finish moments after it. The record is that node's
word for the origin's bytes, as its finished entry's chunk list is: a node only follows one the
controller saw reading the origin.
"""

from __future__ import annotations

import hashlib
import os
import stat
import threading
from typing import Dict, List, Tuple

from llmgw.agent.parts.files import _remove_file, write_json_atomic
from llmgw.agent.parts.protocol import CHUNKS_NAME, MANIFEST_NAME, PEER_CHUNK

SCAN_EVERY = 0.25  # seconds between looks at the download's files


def growing_path(state_dir: str, name: str) -> str:
    return os.path.join(state_dir, "growing", name + ".json")


class GrowingHasher:
    """Hashes the whole chunks of the files under ``tmp`` as they grow, on a thread, and writes
    their sums to the record at ``path``. A file that shrinks or is replaced starts again (its
    earlier sums are dropped; a reader that took those chunks finds them wrong at the end)."""

    def __init__(self, tmp: str, path: str) -> None:
        self.tmp, self.path = tmp, path
        self._files: Dict[str, Tuple[int, List[str]]] = {}  # path -> (inode, sums), first seen first
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="growing-hasher", daemon=True)

    def __enter__(self) -> "GrowingHasher":
        self._write()  # at once: a node told to follow this one finds the record from the start
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()
        _remove_file(self.path)

    def stop(self) -> None:
        """No more scans (the record stays until the context ends: after the entry is in place)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(SCAN_EVERY):
            try:
                if self.scan():
                    self._write()
            except OSError:
                continue  # a file moved under the scan: the next one sees it as it is

    def scan(self) -> bool:
        """Hash what grew since the last scan; whether the record changed."""
        seen, changed = set(), False
        for root, dirs, names in os.walk(self.tmp):
            dirs.sort()
            for base in sorted(names):
                path = os.path.join(root, base)
                relative = os.path.relpath(path, self.tmp)
                info = os.lstat(path)
                if relative in (MANIFEST_NAME, CHUNKS_NAME) or not stat.S_ISREG(info.st_mode):
                    continue
                seen.add(relative)
                inode, sums = self._files.get(relative, (info.st_ino, []))
                if inode != info.st_ino or info.st_size < len(sums) * PEER_CHUNK:
                    inode, sums, changed = info.st_ino, [], True
                if len(sums) < info.st_size // PEER_CHUNK:
                    changed |= self._hash_more(path, info.st_size, sums)
                self._files[relative] = (inode, sums)
        for gone in [r for r in self._files if r not in seen]:
            del self._files[gone]
            changed = True
        return changed

    def _hash_more(self, path: str, size: int, sums: List[str]) -> bool:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            before = len(sums)
            while (len(sums) + 1) * PEER_CHUNK <= size and not self._stop.is_set():
                block = os.pread(fd, PEER_CHUNK, len(sums) * PEER_CHUNK)
                if len(block) < PEER_CHUNK:
                    break
                sums.append(hashlib.sha256(block).hexdigest())
            return len(sums) != before
        finally:
            os.close(fd)

    def _write(self) -> None:
        files = [{"path": relative, "sha256": list(sums)} for relative, (_inode, sums) in self._files.items()]
        write_json_atomic(self.path, {"chunk": PEER_CHUNK, "files": files})
        os.chmod(self.path, 0o600)
