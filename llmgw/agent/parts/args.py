"""The args policy: which engine flags a start may carry and which paths and peers they may name."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import urllib.parse
from typing import Any, Dict, Iterator, List, Optional, Tuple

from llmgw.agent.parts.config import NodeConfig, ipv4_literal
from llmgw.agent.parts.files import _inside
from llmgw.agent.parts.peerflags import PEER_FLAGS, _table_flag
from llmgw.agent.parts.protocol import Refused


# Flags known to take a file or directory, per engine: "r" read, "w" written (or a directory
# written into). A value must resolve inside the engine's own area (both) or the weights
# entry and the owner's sandbox_paths (read only). Defence in depth behind the sandbox and
# the unprivileged user, which make whatever a list like this misses harmless.
# "x": refused outright, whatever the value: the flag hands clients of the engine a shell or
# lets it delete what it loaded. "o": refused outright too: the engine would take its model or
# its arguments from somewhere the agent does not check. llama-server's router mode reads an INI
# of llama-server arguments for the instances it spawns (--models-preset: `rpc = host:port`
# there walks around rpc_peers) or serves whatever a directory holds (--models-dir); a download
# flag (-hf, --model-url, the --*-default presets) takes weights from the internet, not from the
# agent's fetch; vLLM's and SGLang's --config is a file of their arguments (--master-addr...).
# "n": refused outright too: the engine would exchange with other machines at addresses inside a
# JSON value, a URL or a list that rpc_peers cannot vouch for, or open a listener the agent did not
# choose. vLLM's and SGLang's --kv-events-config publish the token ids of every prompt cached
# (ZMQ, connecting to any endpoint, or binding tcp://* on every interface); --kv-transfer-config,
# --ec-transfer-config and SGLang's disaggregation send KV or encoder caches to peers; the OTLP
# endpoints request metadata; --weight-transfer-config and SGLang's remote-instance loader take
# weights from another machine; --grpc-port, -dpm (one API server per port) and the bootstrap and
# supervisor ports listen beside the one port the agent chose. What can be parsed exactly is a peer
# flag (PEER_FLAGS, checked against rpc_peers); these cannot, so no node setting allows them.
# Lists checked against llama-server 0.5.0's --help (--models-* and the downloads again against the
# build of scripts/build-llama-server), SGLang 0.5's server_args.py (README, real-fleet guide), and
# vLLM 0.32.0's own parser: every one of the 317 options of `vllm serve` as the build of
# scripts/build-vllm-cpu makes it (vllm.entrypoints.launchers.cli_args.make_arg_parser), with the
# fields of each JSON config flag's dataclass that name a path, a host, a class or a plugin.
def _flag_table(**groups: str) -> Dict[str, str]:
    return {flag: mode for mode, flags in groups.items() for flag in flags.split()}


PATH_FLAGS: Dict[str, Dict[str, str]] = {
    "llama.cpp": _flag_table(
        r="-m --model -md --model-draft --spec-draft-model -mv --model-vocoder -mm --mmproj --lora --lora-scaled "
          "--control-vector --control-vector-scaled --grammar-file -jf --json-schema-file --chat-template-file -lcs "
          "--lookup-cache-static --api-key-file --ssl-key-file --ssl-cert-file --media-path --path "
          "--ui-config-file --webui-config-file --video-ffmpeg-dir",
        o="--models-preset --models-dir -mu --model-url -dr --docker-repo -hf -hfr --hf-repo -hff --hf-file "
          "-hfd -hfrd --hf-repo-draft --spec-draft-hf -mmu --mmproj-url --embd-gemma-default "
          "--fim-qwen-1.5b-default --fim-qwen-3b-default --fim-qwen-7b-default --fim-qwen-7b-spec "
          "--fim-qwen-14b-spec --fim-qwen-30b-default --gpt-oss-20b-default --gpt-oss-120b-default "
          "--vision-gemma-4b-default --vision-gemma-12b-default",
        w="-lcd --lookup-cache-dynamic --log-file --slot-save-path --log-prompts-dir",
        x="--tools --tools-runtime -ag --agent --mcp-servers-config --mcp-servers-json --ui-mcp-proxy"),
    "vllm": _flag_table(
        r="--model --tokenizer --hf-config-path --generation-config --allowed-local-media-path --lora-modules "
          "--default-mm-loras --chat-template --ssl-keyfile --ssl-certfile --ssl-ca-certs --spec-model "
          "--tool-parser-plugin --reasoning-parser-plugin --speculative-config -sc --model-loader-extra-config "
          "--additional-config --structured-outputs-config --mm-encoder-fp8-scale-path",
        w="--download-dir --uds --compilation-config -cc -O --profiler-config --mm-encoder-fp8-scale-save-path",
        x="--tool-server",
        # A logging dictConfig (--log-config-file, --logging-config's pylogging_config_file) names
        # handler classes to import and build: an HTTPHandler or SocketHandler sends every log line
        # to another machine. --ec-manager-config and the --*-cls, --logits-processors,
        # --model-class-overrides, --middleware and --io-processor-plugin flags name code to import.
        # --kv-offloading-backend lmcache sends every prompt's KV to an LMCache server (tcp://localhost:5555).
        o="--config --log-config-file --logging-config --ec-manager-config --worker-cls --worker-extension-cls "
          "--scheduler-cls --logits-processors --model-class-overrides --middleware --io-processor-plugin",
        n="--kv-events-config --kv-transfer-config --ec-transfer-config --otlp-traces-endpoint "
          "--weight-transfer-config --grpc-port --data-parallel-supervisor-port "
          "--data-parallel-multi-port-external-lb -dpm --data-parallel-rpc-port -dpp --kv-offloading-backend"),
    "sglang": _flag_table(
        r="--model-path --model --tokenizer-path --chat-template --completion-template --quantization-param-path "
          "--rl-quant-profile --modelopt-checkpoint-restore-path --speculative-draft-model-path "
          "--speculative-draft-model --speculative-token-map --speculative-adaptive-config "
          "--speculative-ngram-external-corpus-path --lora-paths --ssl-keyfile --ssl-certfile --ssl-ca-certs "
          "--debug-tensor-dump-input-file --decrypted-config-file --decrypted-draft-config-file --model-checksum "
          "--deepep-config --init-expert-location "
          "--pdmux-config-path --dllm-algorithm-config --msprobe-dump-config --kt-weight-path "
          "--model-loader-extra-config",
        w="--download-dir --modelopt-checkpoint-save-path --modelopt-export-path --spec-trace-dir "
          "--file-storage-path --log-requests-target --crash-dump-folder --export-metrics-to-file-dir "
          "--debug-tensor-dump-output-folder --weight-cache-socket",
        x="--delete-ckpt-after-loading",
        # A config file the engine loads holds remote addresses this agent never sees (LMCache's
        # remote_url, FlexKV's servers): refused, as a file of arguments is.
        o="--config --lmcache-config-file --flexkv-config-file",
        # Names from SGLang 0.5's server_args.py (0.5.20's list of them, for the newer ones).
        n="--kv-events-config --otlp-traces-endpoint --encoder-urls --encoder-register-urls "
          "--encoder-bootstrap-port --remote-instance-weight-loader-seed-instance-ip "
          "--remote-instance-weight-loader-seed-instance-service-port "
          "--remote-instance-weight-loader-send-weights-group-ports --engine-info-bootstrap-port "
          "--disaggregation-mode --disaggregation-bootstrap-port --load-publish-endpoint "
          "--decoupled-spec-bind-endpoint --decoupled-spec-connect-endpoints --gated-launch-port "
          "--modelexpress-config --pdlb-url"),
}


RPC_SERVER = "rpc-server"
REFUSED_MODES = ("x", "o", "n")  # strongest first

# Flag families that reach other machines (KV stores, disaggregation, remote weights): a flag of
# one that these tables do not know is refused, not let through as a path check (seen: SGLang's
# --hicache-storage-backend mooncake with a master_server_address in its extra config). The flags
# of a family known to stay on the node are listed; those whose value names a place are parsed
# (VALUE_RULES). SGLang 0.5.x's server_args.py; vLLM 0.32.0's parser (none new since 0.18).
FAMILIES: Dict[str, Tuple[str, ...]] = {
    "sglang": ("--hicache-", "--lmcache-", "--disaggregation-", "--encoder-", "--remote-instance-", "--flexkv-",
               "--mooncake-", "--pdlb-", "--nixl-", "--hf3fs-", "--eic-", "--aibrix-"),
    "vllm": ("--kv-transfer-", "--kv-events-", "--ec-transfer-", "--weight-transfer-", "--lmcache-"),
}
LOCAL_IN_FAMILY: Dict[str, frozenset] = {
    "sglang": frozenset(("--hicache-ratio", "--hicache-size", "--hicache-write-policy", "--hicache-io-backend",
                         "--hicache-mem-layout", "--hicache-storage-prefetch-policy",
                         "--hicache-storage-backend", "--hicache-storage-backend-extra-config")),
    "vllm": frozenset(),
}
# SGLang's HiCache storage backends: only "file" stays on the node; mooncake, hf3fs, nixl, aibrix,
# eic and lmcache write every cached prompt's KV to a storage service, and "dynamic" imports a
# Python module its extra config names.
LOCAL_HICACHE_BACKENDS = ("file",)
HICACHE_FILE_KEYS = frozenset(("file_path", "max_size", "min_free_space", "prefetch_threshold",
                               "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
                               "hicache_storage_pass_prefix_keys", "extra_backend_tag"))


def engine_kind(name: str, prefix: Tuple[str, ...]) -> Optional[str]:
    """Which engine's flag table applies: by the node's engine name, else by its executable."""
    if name in PATH_FLAGS or name == RPC_SERVER:
        return name
    words = " ".join(os.path.basename(p) for p in prefix)
    for kind, marker in ((RPC_SERVER, "rpc-server"), ("llama.cpp", "llama-server"), ("vllm", "vllm"),
                         ("sglang", "sglang")):
        if marker in words:
            return kind
    return None


def _value_at(args: List[str], i: int, value: Optional[str]) -> Tuple[str, int]:
    """The value of the flag at ``i`` (given inline as --flag=value, else the next argument; ""
    when there is none) and the index after it."""
    if value is not None:
        return value, i + 1
    return (args[i + 1] if i + 1 < len(args) else ""), i + 2


def check_args(kind: Optional[str], args: List[str], *, area: str, read_roots: Tuple[str, ...],
               rpc_peers: Tuple[Any, ...] = (), fabric_address: str = "", host: Optional[str] = None,
               port: Optional[int] = None, own_peers: Optional[Tuple[str, ...]] = None) -> None:
    """Refuse args that would make the engine read or write outside what it was given, exchange
    with a machine across nodes that the node's rpc_peers does not list, or listen anywhere but
    ``host``:``port`` (the node's bind_address and the port the agent chose)."""
    flags = PATH_FLAGS.get(kind or "", {})
    i = 0
    while i < len(args):
        arg = args[i]
        mode = None
        if kind in ("vllm", "sglang") and arg.startswith("@"):
            raise Refused(f"start: {arg!r} is refused: {kind} reads @FILE as more arguments, from a file this "
                          "agent does not check", setting="args")
        family = _family_flag(kind, arg)
        if family is not None:
            flag, value = family
            value, i = _value_at(args, i, value)
            _check_family(kind, flag, value, area=area, read_roots=read_roots)
            continue
        listen = _table_flag(kind, arg, LISTEN_FLAGS)
        if listen is not None:
            flag, what, value = listen
            value, i = _value_at(args, i, value)
            check_listen(flag, value, what, host=host, port=port)
            continue
        choice = _table_flag(kind, arg, CHOICES)
        if choice is not None:
            flag, allowed, value = choice
            value, i = _value_at(args, i, value)
            check_choice(flag, value, allowed)
            continue
        peer = _table_flag(kind, arg, PEER_FLAGS)
        if peer is not None:
            flag, form, value = peer
            value, i = _value_at(args, i, value)
            check_peer(flag, value, form, rpc_peers, own=fabric_address, replica=own_peers)
            continue
        if arg.startswith("-"):
            name, value = _flag_and_value(flags, kind, arg)
            mode = _path_flag_mode(flags, name, kind)
            if mode == "x":
                raise Refused(f"start: {name} is refused on every node: it would give the engine's clients tools "
                              "that run commands or change files", setting="args")
            if mode == "o":
                raise Refused(f"start: {name} is refused on every node: the engine would take its model or its "
                              "arguments from somewhere this agent does not check (a replica's weights come from "
                              "the agent's fetch, its arguments from the request)", setting="args")
            if mode == "n":
                raise Refused(f"start: {_table_name(flags, name, kind)} is refused on every node: the engine "
                              "would send to, take from or listen for other machines at addresses this agent "
                              "cannot check (only the peer flags are, against rpc_peers; an engine listens on "
                              "bind_address and its one port)", setting="args")
            if mode is not None:
                if value is None:
                    if i + 1 >= len(args):
                        break
                    i += 1
                    value = args[i]
                if kind == "vllm" and _is_compilation_flag(_normal(name).partition(".")[0]):
                    check_compilation_backend(_normal(name), value)
                _check_value(name, value, mode, area=area, read_roots=read_roots, every=True)
        if mode is None:
            if kind in ("vllm", "sglang") and not arg.startswith("-") and URL_RE.match(arg):
                # A positional model tag as a URL (s3://, gs://, https://): the engine would load
                # from there, past the agent's fetch and its checks.
                raise Refused(f"start: {arg!r} is refused: {kind} would load a model from that address itself; "
                              "a replica's weights come from the agent's fetch ({weights})", setting="args")
            # Any other argument (a positional model path, a flag this table does not know): its
            # absolute paths and its ".." escapes are checked all the same.
            _check_value("argument", arg, "r", area=area, read_roots=read_roots, every=False)
        i += 1


def _family_flag(kind: Optional[str], arg: str) -> Optional[Tuple[str, Optional[str]]]:
    """(flag, attached value or None) when ``arg`` is a flag of a family that reaches other machines,
    in any spelling the engine takes (--flag_name, an unambiguous abbreviation)."""
    if kind not in FAMILIES or not arg.startswith("--"):
        return None
    name, eq, inline = arg.partition("=")
    normal = "--" + name[2:].replace("_", "-")
    known = set(PATH_FLAGS.get(kind, {})) | LOCAL_IN_FAMILY[kind]
    if normal not in known:
        prefixed = sorted(f for f in known if f.startswith(normal) and len(normal) >= 4)
        normal = prefixed[0] if len(prefixed) == 1 else normal
    if not normal.startswith(FAMILIES[kind]) or normal in PATH_FLAGS.get(kind, {}):
        return None  # not of a family, or a flag the tables rule on
    return normal, inline if eq else None


def _check_family(kind: Optional[str], flag: str, value: str, *, area: str, read_roots: Tuple[str, ...]) -> None:
    if flag not in LOCAL_IN_FAMILY.get(kind or "", ()):
        raise Refused(f"start: {flag} is refused on every node: a flag of a family that reaches other machines "
                      "(KV stores, disaggregation, remote weights) that this agent does not know to stay on the "
                      "node", setting="args")
    if flag == "--hicache-storage-backend" and value not in LOCAL_HICACHE_BACKENDS:
        raise Refused(f"start: --hicache-storage-backend {value!r} is refused: only 'file' keeps the KV cache on "
                      "this node (the others send every cached prompt's KV to a storage service; 'dynamic' "
                      "imports code its config names)", setting="args")
    if flag == "--hicache-storage-backend-extra-config":
        try:
            config = json.loads(value)
        except (ValueError, RecursionError):
            config = None
        if not isinstance(config, dict):
            raise Refused("start: --hicache-storage-backend-extra-config must be a JSON object (a file, @FILE, "
                          "is not read by this agent)", setting="args")
        unknown = sorted(k for k in config if k not in HICACHE_FILE_KEYS)
        if unknown:
            raise Refused(f"start: --hicache-storage-backend-extra-config key(s) {', '.join(map(repr, unknown))} "
                          "refused: only the file backend's own keys are (addresses, module paths and other "
                          "backends' settings reach beyond this node)", setting="args")
        if isinstance(config.get("file_path"), str):
            _check_value(flag, config["file_path"], "w", area=area, read_roots=read_roots, every=True)


# Flags whose value picks where the engine runs, loads from or what code it imports: only the
# values that stay on this node and import nothing a request names. vLLM 0.32.0:
# --distributed-executor-backend takes "ray" (workers on a Ray cluster, other machines) or a
# class's qualname (code to import); --data-parallel-backend/-dpb "ray" likewise; --load-format
# tensorizer, runai_streamer(_sharded), modelexpress and ipc_cache load from object stores or
# other servers; CompilationConfig's backend is "", "inductor", "eager" or a function to import.
CHOICES: Dict[str, Dict[str, str]] = {
    "vllm": {
        "--distributed-executor-backend": "mp uni",
        "--data-parallel-backend": "mp",
        "-dpb": "mp",
        "--load-format": "auto pt safetensors npcache dummy sharded_state gguf bitsandbytes mistral fastsafetensors",
    },
}
COMPILATION_FLAGS = ("--compilation-config", "-cc", "-O")
COMPILATION_BACKENDS = ("", "inductor", "eager")


def check_choice(flag: str, value: str, allowed: str) -> None:
    if value not in allowed.split():
        raise Refused(f"start: {flag} {value!r} is refused: only {', '.join(allowed.split())} keep the engine on "
                      "this node, loading what the agent fetched and importing nothing else", setting="args")


def check_compilation_backend(flag: str, value: str) -> None:
    """vLLM's compilation backend, set as a JSON key (-O '{"backend": ...}') or a dotted flag
    (--compilation-config.backend=...): a name of vLLM's own, never a function to import."""
    head, dot, key = flag.partition(".")
    backend: Any = None
    if dot:
        if key.replace("_", "-") != "backend":
            return
        backend = value
    elif value[:1] == "{":
        try:
            parsed = json.loads(value)
        except (ValueError, RecursionError):
            return  # not JSON: the path checks have it
        if not isinstance(parsed, dict) or "backend" not in parsed:
            return
        backend = parsed["backend"]
    else:
        return
    if backend not in COMPILATION_BACKENDS:
        raise Refused(f"start: {head} backend {backend!r} is refused: only vLLM's own backends "
                      f"({', '.join(repr(b) for b in COMPILATION_BACKENDS)}) are; another names code to import",
                      setting="args")


# Where an HTTP engine listens: the node's bind_address ({host}) and the port the agent chose
# ({port}), nothing else, as an rpc-server (check_rpc_server_args). vLLM keeps the last --host and a
# profile's args come after the controller's, so `--host 0.0.0.0` in a catalog put an
# unauthenticated engine (its /v1 and /metrics) on every interface, past the router's keys and
# limits; llama-server's --host also takes a unix socket path (x.sock).
LISTEN_FLAGS: Dict[str, Dict[str, str]] = {
    "llama.cpp": {"--host": "host", "--port": "port"},
    "vllm": {"--host": "host", "--port": "port"},
    "sglang": {"--host": "host", "--port": "port"},
}


def check_listen(flag: str, value: str, what: str, *, host: Optional[str], port: Optional[int]) -> None:
    if what == "host" and value != host:
        raise Refused(f"start: {flag} {value!r} is refused: an engine listens only on this node's bind_address "
                      f"({host}, what {{host}} is)", setting="bind_address")
    if what == "port" and value != str(port):
        raise Refused(f"start: {flag} {value!r} is refused: the port is the agent's choice ({port}, what {{port}} "
                      "is; the node's port_range)", setting="port_range")


def _table_name(flags: Dict[str, str], name: str, kind: Optional[str]) -> str:
    """The flag of ``flags`` that ``name`` stands for (a dotted key's head, an abbreviation...)."""
    head = name.partition(".")[0]
    normal = head if not head.startswith("--") else "--" + head[2:].replace("_", "-")
    if normal in flags:
        return normal
    matches = sorted(f for f in flags if f.startswith(normal) and flags[f] in REFUSED_MODES)
    return matches[0] if matches and kind in ("vllm", "sglang") else name


def check_peer(flag: str, value: str, form: str, peers: Tuple[Any, ...], *, own: str = "",
               replica: Optional[Tuple[str, ...]] = None) -> None:
    """Refuse ``value`` unless every address in it is parsed exactly as its engine parses it and is
    this node's own fabric address or in the node's rpc_peers; and, where the request names the
    replica's own peers (``replica``), one of those: rpc_peers is the whole fabric, and a head
    pointed at another replica's rpc-server took it (rpc-server has no authentication and serves
    one client at a time), a vLLM or SGLang rank another replica's rendezvous."""
    items = value.split(",") if form == "rpc" else [value]
    for item in items:
        if replica is not None and not _own_peer(item, form, replica):
            raise Refused(f"start: {flag} {item!r} is refused: not one of this replica's own peers "
                          f"({', '.join(replica) or 'none'}), which the controller names; a catalog cannot point "
                          "a replica at another's", setting="args")
        address = _peer_address(item, form)
        if address is None or not (str(address) == own or any(address in net for net in peers)):
            allowed = ", ".join(str(n) for n in peers) or "none"
            why = ("a llama.cpp head sends its layers only to rpc-servers at IPv4 addresses (a.b.c.d:port) "
                   if form == "rpc" else "a rank joins only ranks at IP addresses ")
            raise Refused(f"start: {flag} {item!r} is refused: {why}in this node's rpc_peers or its own "
                          f"fabric_address (allowed: {allowed})", setting="rpc_peers")


def _own_peer(item: str, form: str, replica: Tuple[str, ...]) -> bool:
    if form == "host":  # vLLM's --master-addr: rank 0's address without its port
        return any(_host_of(p) == item.strip("[]") for p in replica)
    return item in replica


def _host_of(hostport: str) -> str:
    host = hostport.rpartition(":")[0] if not hostport.startswith("[") else hostport[1:].partition("]")[0]
    return host


def _peer_address(item: str, form: str) -> Optional[Any]:
    """The address in one peer value, parsed as its reader parses it, or None when it is not one
    both the reader and this check read alike. llama.cpp's parse_endpoint splits --rpc at the
    FIRST colon (stoi reads the port and ignores what follows it, gethostbyname the host): only
    a.b.c.d:port with nothing after is read the same by both. SGLang splits host:port at its one
    colon, or takes [v6]:port."""
    if form == "host":
        return _ip_literal(item)
    if form == "hostport" and item.startswith("["):
        host, sep, port = item[1:].partition("]:")
        address = _ip_literal(host) if sep else None
        return address if address is not None and address.version == 6 and _port_ok(port) else None
    host, sep, port = item.partition(":")
    if not sep or not _port_ok(port):
        return None
    return ipv4_literal(host)


def _ip_literal(value: str) -> Optional[Any]:
    address = ipv4_literal(value)
    if address is not None or "." in value:
        return address
    try:
        return ipaddress.IPv6Address(value)
    except ValueError:
        return None


def _port_ok(value: str) -> bool:
    return 0 < len(value) <= 5 and value.isascii() and value.isdigit() and 0 < int(value) < 65536


RPC_SERVER_FLAGS = {"-H": "host", "--host": "host", "-p": "port", "--port": "port", "-t": "threads",
                    "--threads": "threads", "-d": "device", "--device": "device"}
DEVICE_RE = re.compile(r"^[A-Za-z0-9_.-]+(,[A-Za-z0-9_.-]+)*\Z")


def check_rpc_server_args(cfg: NodeConfig, args: List[str], *, port: int) -> None:
    """An rpc-server (a llama.cpp worker) runs whatever computation its client sends and has no
    authentication (llama.cpp tools/rpc/README.md): it listens on the node's fabric address and the
    port the agent chose, and nothing else; it writes nothing (-c, its tensor cache, is refused with
    every flag not known here)."""
    seen = set()
    i = 0
    while i < len(args):
        name, eq, value = args[i].partition("=")
        what = RPC_SERVER_FLAGS.get(name)
        if what is None:
            raise Refused(f"start: rpc-server argument {args[i]!r} is refused: a worker takes only --host (the "
                          "node's fabric address), --port, --threads and --device", setting="args")
        if not eq:
            i += 1
            value = args[i] if i < len(args) else ""
        if what == "host" and value != cfg.fabric_address:
            raise Refused(f"start: rpc-server --host {value!r} is refused: it listens only on this node's "
                          f"fabric_address {cfg.fabric_address} (RPC has no authentication)", setting="fabric_address")
        if what == "port" and value != str(port):
            raise Refused(f"start: rpc-server --port {value!r} is refused: the port is the agent's choice "
                          f"({port})", setting="port_range")
        if what == "threads" and not value.isdigit():
            raise Refused(f"start: rpc-server --threads {value!r} is not a number", setting="args")
        if what == "device" and not DEVICE_RE.match(value):
            raise Refused(f"start: rpc-server --device {value!r} is not a list of device names", setting="args")
        seen.add(what)
        i += 1
    if not {"host", "port"} <= seen:
        raise Refused("start: rpc-server needs --host {host} and --port {port} (without them it would "
                      "listen where its defaults say)", setting="args")


def _is_compilation_flag(head: str) -> bool:
    # argparse takes an unambiguous abbreviation (--compilation-c) as the whole flag.
    return head in COMPILATION_FLAGS or (head.startswith("--") and len(head) >= 4
                                         and "--compilation-config".startswith(head))


def _normal(name: str) -> str:
    """--flag_name as --flag-name (argparse takes both); short flags as they are."""
    return "--" + name[2:].replace("_", "-") if name.startswith("--") else name


def _flag_and_value(flags: Dict[str, str], kind: Optional[str], arg: str) -> Tuple[str, Optional[str]]:
    """(flag, attached value or None): --flag=value, and argparse's short option with its
    value attached (-O3, -O{"cache_dir": ...}), which vLLM and SGLang accept."""
    name, eq, inline = arg.partition("=")
    if eq:
        return name, inline
    if kind in ("vllm", "sglang") and not arg.startswith("--"):
        for flag in sorted((f for f in flags if not f.startswith("--")), key=len, reverse=True):
            if arg.startswith(flag) and len(arg) > len(flag) and arg[len(flag)] != ".":
                return flag, arg[len(flag):]
    return arg, None


def _path_flag_mode(flags: Dict[str, str], name: str, kind: Optional[str]) -> Optional[str]:
    if name in flags:
        return flags[name]
    # llama-server and vLLM take --log_file for --log-file; vLLM sets a key of a JSON flag
    # with --compilation-config.cache_dir (or -O.cache_dir); Python's argparse (vLLM, SGLang)
    # takes any unambiguous abbreviation, --chat-templ: so must this check, or it is walked around.
    head, dot, _ = name.partition(".")
    normal = head if not head.startswith("--") else "--" + head[2:].replace("_", "-")
    if dot:
        # --kv-events-config.endpoint is --kv-events-config: a refused flag stays refused.
        mode = _path_flag_mode(flags, head, kind)
        if mode in REFUSED_MODES:
            return mode
    if dot and (normal in flags or kind == "vllm"):
        return "w"  # a JSON key: only the engine's own area is safe for whatever it names
    if normal in flags:
        return flags[normal]
    if kind not in ("vllm", "sglang") or not normal.startswith("--") or len(normal) < 4:
        return None
    modes = {m for f, m in flags.items() if f.startswith(normal)}
    for strongest in (*REFUSED_MODES, "w", "r"):
        if strongest in modes:
            return strongest
    return None


def _check_value(flag: str, value: str, mode: str, *, area: str, read_roots: Tuple[str, ...], every: bool) -> None:
    """Check the paths in one value: the value itself (``every``: it is a path flag's), what
    follows `=` (name=path pairs), or, when it parses as JSON, each of its strings."""
    parsed: Any = None
    if value[:1] in ("{", "["):
        try:
            parsed = json.loads(value)
        except (ValueError, RecursionError):
            parsed = None
    if parsed is not None:
        candidates = [v for v in _json_strings(parsed) if _suspicious(v) or (every and URL_RE.match(v))]
    else:
        after = value.partition("=")[2]
        candidates = [v for v in (value, after) if v and (every or _suspicious(v))]
    for candidate in candidates:
        _check_path(flag, candidate, mode, area=area, read_roots=read_roots)


def _suspicious(value: str) -> bool:
    """Whether a value not known to be a path could still name one outside the engine's area."""
    return value.startswith(("/", "~", "file:")) or ".." in value.replace("\\", "/").split("/")


def _json_strings(value: Any) -> Iterator[str]:
    """Every string in a parsed JSON value, keys included; iterative, so depth costs no stack."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


# A URL of any scheme but file: (s3://, gs://, https://...), the way the engines' loaders spell one.
URL_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def _check_path(flag: str, value: str, mode: str, *, area: str, read_roots: Tuple[str, ...]) -> None:
    if URL_RE.match(value) and not value.startswith("file:"):
        # As a relative path s3://bucket/m is "inside the area"; as vLLM's or SGLang's loader reads
        # it (runai streamer, tensorizer, SGLang's remote loader), the model comes from another machine.
        raise Refused(f"start: {flag} {value!r} is refused: a URL, not a path (an engine's files come from the "
                      "agent's fetch, its weights entry or sandbox_paths, never from another machine)",
                      setting="args")
    if value.startswith("file:"):
        try:
            value = urllib.parse.unquote(urllib.parse.urlsplit(value).path)
        except ValueError as exc:  # file://[::1/x: not a URL at all
            raise Refused(f"start: {flag} {value!r} is refused: not a usable file URL ({exc})",
                          setting="args") from None
    if value.startswith("~"):
        value = area + value[1:]  # HOME is the engine's area
    path = os.path.realpath(os.path.join(area, value))  # relative values are relative to the engine's cwd
    allowed = (area,) if mode == "w" else (area,) + read_roots
    if not any(_inside(path, os.path.realpath(root)) for root in allowed):
        where = "the engine's own area" if mode == "w" else "the engine's own area, its weights or sandbox_paths"
        # sandbox_paths can widen what an engine reads; nothing widens where it writes.
        raise Refused(f"start: {flag} {value} is refused: it names a path outside {where} ({area})",
                      setting="args" if mode == "w" else "sandbox_paths")
