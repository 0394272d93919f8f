"""hello and inventory: what this node has (GPUs, memory, mounts, cache, engines, fetches)."""

from __future__ import annotations

import csv
import hashlib
import os
import re
import shutil
import subprocess
import time
from typing import Dict, List, Optional, Tuple

from llmgw.agent.parts.cache import inspect_entry
from llmgw.agent.parts.config import NodeConfig
from llmgw.agent.parts.fetch import fetch_views
from llmgw.agent.parts.files import _inside, _listdir, tree_bytes
from llmgw.agent.parts.lease import _lease_request, lease_heard, lease_view, read_lease, take_lease
from llmgw.agent.parts.local import local_source_roots
from llmgw.agent.parts.protocol import (
    AGENT_PATH,
    AGENT_VERSION,
    CACHE_NAME_RE,
    NVIDIA_SMI_QUERY,
    NVIDIA_SMI_TIMEOUT,
    PROTOCOL,
    SHARED_FSTYPES,
    TMP_PREFIX,
    TRASH_PREFIX,
    JsonDict,
)
from llmgw.agent.parts.sandbox import OWNER_ENV, confinement
from llmgw.agent.parts.status import engine_views

# ----------------------------------------------------------------------------------------------
# hello and inventory


def verb_hello(cfg: NodeConfig, _request: JsonDict) -> JsonDict:
    with open(AGENT_PATH, "rb") as fh:
        digest = hashlib.sha256(fh.read()).hexdigest()
    return {"agent_version": AGENT_VERSION, "agent_sha256": digest, "hostname": cfg.hostname,
            "protocol": PROTOCOL}


def verb_inventory(cfg: NodeConfig, request: JsonDict) -> JsonDict:
    # A controller's poll renews its lease (or takes one nobody holds): no extra round trip.
    asked = request.get("lease")
    if asked is not None:
        lease = take_lease(cfg, _lease_request(asked), takeover=False)
    else:
        lease = lease_view(read_lease(cfg), None, time.time(), heard=lease_heard(cfg))
    gpus, gpu_error = gpu_inventory(cfg)
    engines = engine_views(cfg)
    weights, invalid, foreign = cache_listing(cfg, engines)
    mounts = read_mounts(cfg.mounts_file)
    return {
        "hostname": cfg.hostname,
        "agent_version": AGENT_VERSION,
        "protocol": PROTOCOL,
        "gpus": gpus,
        "gpu_error": gpu_error,
        "memory_mb": memory_mb(),
        "filesystems": [filesystem_info(p, mounts) for p in (cfg.cache_dir,) + cfg.model_dirs],
        "weights": weights,
        # Cache-named entries that are not complete (no manifest, wrong hash, a symlink): never
        # counted as present and never removed, listed so an operator can look at them.
        "invalid_weights": invalid,
        "foreign": foreign,
        "engines": engines,
        "fetches": fetch_views(cfg),
        # Which confinement this node gives engines (user, sandbox): shown by `llmgw nodes`.
        "confinement": confinement(cfg).view(),
        "env_allow": sorted(cfg.env_allow),
        # Where this node's shards of a replica across nodes meet the others (rpc-server, vLLM's master).
        "fabric_address": cfg.fabric_address,
        # Where it serves its complete cache entries to other fleet nodes (null: it does not).
        "peer_port": cfg.peer_port,
        # What this node's owner lets engines use: the controller plans within it (a start outside
        # it would be refused here after the plan had promised it).
        # Each root as configured and as resolved: a catalog may name it either way.
        "offers": {"engines": sorted(cfg.engines),
                   "local_roots": sorted(set(cfg.local_sources + cfg.model_dirs + local_source_roots(cfg))),
                   "model_dirs": sorted(set(cfg.model_dirs + tuple(os.path.realpath(d) for d in cfg.model_dirs))),
                   # Env names only the owner sets (engine_env): a start that sets one is refused.
                   "owner_env": sorted(OWNER_ENV)},
        "lease": lease,
        # A digest of the node config as its owner wrote it: the controller retries a replica that
        # failed here at once when it changes (the owner fixed what refused or broke the start),
        # not after a crash-loop backoff.
        "settings": settings_digest(cfg),
    }


def settings_digest(cfg: NodeConfig) -> Optional[str]:
    """The first 16 hex digits of the config file's sha256 (None: unreadable now)."""
    try:
        with open(cfg.path, "rb") as fh:
            return hashlib.sha256(fh.read()).hexdigest()[:16]
    except OSError:
        return None


def gpu_inventory(cfg: NodeConfig) -> Tuple[List[JsonDict], Optional[str]]:
    """GPUs from nvidia-smi when the node has it, else those declared in the node config.

    When nvidia-smi exists but fails, the declared GPUs are NOT used: a driver that does not
    answer means the GPUs cannot be trusted, so the node reports none and says why."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return [_declared_gpu(g) for g in cfg.gpus], None
    argv = [exe, f"--query-gpu={NVIDIA_SMI_QUERY}", "--format=csv,noheader,nounits"]
    try:
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True,
                              timeout=NVIDIA_SMI_TIMEOUT, check=False)
    except subprocess.TimeoutExpired:
        return [], f"nvidia-smi did not answer within {NVIDIA_SMI_TIMEOUT:g}s"
    except OSError as exc:
        return [], f"nvidia-smi could not run: {exc}"
    gpus = parse_nvidia_smi(proc.stdout.decode("utf-8", "replace"))
    if proc.returncode != 0:
        said = (proc.stderr or proc.stdout).decode("utf-8", "replace").strip().splitlines()
        return gpus, f"nvidia-smi exited with {proc.returncode}: {said[0] if said else 'no output'}"
    return gpus, None


def _declared_gpu(gpu: JsonDict) -> JsonDict:
    return {"index": gpu["index"], "class": gpu["class"], "name": None, "uuid": None,
            "memory_gb": gpu["memory_gb"], "memory_used_gb": None, "declared": True,
            "healthy": True, "problems": []}


def parse_nvidia_smi(text: str) -> List[JsonDict]:
    rows = csv.reader(text.splitlines(), skipinitialspace=True)
    return [_gpu_from_row([c.strip() for c in row]) for row in rows if len(row) == 6]


def _gpu_from_row(row: List[str]) -> JsonDict:
    index, name, uuid, total, used, ecc = row
    problems: List[str] = []
    total_mib = _smi_number(total, "memory.total", problems)
    used_mib = _smi_number(used, "memory.used", problems)
    # "[N/A]" for ECC means the card has no ECC (consumer cards): not a problem in itself.
    ecc_count = None if ecc == "[N/A]" else _smi_number(ecc, "ecc.errors.uncorrected.volatile.total", problems)
    if ecc_count:
        problems.append(f"ecc errors: {int(ecc_count)}")
    return {"index": int(index) if index.isdigit() else index, "class": gpu_class(name), "name": name,
            "uuid": uuid, "memory_gb": _mib_to_gb(total_mib), "memory_used_gb": _mib_to_gb(used_mib),
            "declared": False, "healthy": not problems, "problems": problems}


def _smi_number(value: str, field: str, problems: List[str]) -> Optional[float]:
    try:
        return float(value)
    except ValueError:
        problems.append(f"{value} reported for {field}")
        return None


def _mib_to_gb(mib: Optional[float]) -> Optional[float]:
    # Decimal GB, so a card sold as "80GB" (an H100 reports 81559 MiB = 79.6 GiB = 85.5 GB) meets
    # a catalog's gpu_memory_gb: 80. GiB would put every card just under its label.
    return None if mib is None else round(mib * (1 << 20) / 1e9, 1)


_BRAND_WORDS = frozenset({"nvidia", "tesla", "geforce", "quadro"})


def gpu_class(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100', 'NVIDIA A100-SXM4-80GB' -> 'a100', 'NVIDIA L40S' -> 'l40s'.

    A heuristic: the first word after the brand; 'RTX 4090' -> 'rtx4090', 'RTX A6000' -> 'a6000'."""
    words = [re.sub(r"[^a-z0-9]", "", w) for w in re.split(r"[\s_-]+", name.lower())]
    words = [w for w in words if w and w not in _BRAND_WORDS]
    if not words:
        return "unknown"
    if words[0] == "rtx" and len(words) > 1:
        return words[1] if words[1][0].isalpha() else "rtx" + words[1]
    return words[0]


def memory_mb() -> JsonDict:
    values: Dict[str, int] = {}
    try:
        with open("/proc/meminfo", encoding="ascii", errors="replace") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    values[key] = int(parts[0])  # kB
    except OSError:
        pass
    total, available = values.get("MemTotal"), values.get("MemAvailable")
    return {"total": None if total is None else total // 1024,
            "available": None if available is None else available // 1024}


def read_mounts(mounts_file: str) -> List[Tuple[str, str]]:
    """(mount point, fstype) for each line of a /proc/mounts-style table, in order."""
    try:
        with open(mounts_file, encoding="utf-8", errors="replace") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return []
    mounts = []
    for line in lines:
        fields = line.split()
        if len(fields) >= 3:
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[1])
            mounts.append((point, fields[2]))
    return mounts


def mount_for(path: str, mounts: List[Tuple[str, str]]) -> Optional[Tuple[str, str]]:
    """The mount holding path: the longest matching mount point; a later one of equal length
    wins, because it was mounted on top."""
    best = None
    for point, fstype in mounts:
        if _inside(path, point) or point == "/":
            if best is None or len(point) >= len(best[0]):
                best = (point, fstype)
    return best


def is_shared_fstype(fstype: str) -> bool:
    return fstype in SHARED_FSTYPES or fstype.startswith("fuse.")


def filesystem_info(path: str, mounts: List[Tuple[str, str]]) -> JsonDict:
    # A directory that does not exist yet is reported for the filesystem it would be created on.
    probe = os.path.realpath(path)
    while not os.path.exists(probe) and probe != "/":
        probe = os.path.dirname(probe)
    found = mount_for(probe, mounts)
    total: Optional[int]
    free: Optional[int]
    try:
        vfs = os.statvfs(probe)
        total, free = vfs.f_blocks * vfs.f_frsize, vfs.f_bavail * vfs.f_frsize
    except OSError:
        total = free = None
    return {"path": path, "mount_point": found[0] if found else None, "fstype": found[1] if found else None,
            "total_bytes": total, "free_bytes": free, "shared": bool(found and is_shared_fstype(found[1])),
            "exists": os.path.isdir(path)}


def cache_listing(cfg: NodeConfig, engines: List[JsonDict]) -> Tuple[List[JsonDict], List[JsonDict], List[str]]:
    """(complete entries, cache-named entries that are not complete, foreign paths)."""
    last_start: Dict[str, float] = {}
    for engine in engines:
        if engine.get("weights"):
            started = engine.get("started_at") or 0.0
            last_start[engine["weights"]] = max(last_start.get(engine["weights"], 0.0), started)
    weights, invalid, foreign = [], [], []
    for name in _listdir(cfg.cache_dir):
        path = os.path.join(cfg.cache_dir, name)
        if name.startswith((TMP_PREFIX + "llmgw-", TRASH_PREFIX + "llmgw-")):
            continue  # our own downloads and deletions in flight
        if not CACHE_NAME_RE.match(name):
            foreign.append(path)
            continue
        manifest, problem = inspect_entry(cfg.cache_dir, name)
        if manifest is None:
            invalid.append({"path": path, "name": name, "reason": problem})
            continue
        try:
            mtime = os.lstat(path).st_mtime
        except OSError:
            continue
        weights.append({"path": path, "name": name, "source": manifest["source"], "bytes": tree_bytes(path),
                        "complete": True, "fetched_at": manifest.get("fetched_at"),
                        "last_used": max(mtime, last_start.get(path, 0.0))})
    for model_dir in cfg.model_dirs:
        foreign.extend(os.path.join(model_dir, name) for name in _listdir(model_dir))
    return weights, invalid, foreign
