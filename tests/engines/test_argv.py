"""Engine argument lists: exact, per engine, for every shape a profile can take."""

from __future__ import annotations

import pytest

from llmgw.catalog.model import Model, ModelName, Profile
from llmgw.engines.argv import (
    BUILDERS,
    EngineArgsError,
    Shard,
    engine_args,
    holds_weights,
    served_name,
    shard_engine,
    shard_env,
    source_file_name,
    weights_path,
)

HF = "hf://meta-llama/Llama-3.1-8B-Instruct@0e9e39f249a16976918f6564b8830bc894c89659"
GGUF_URL = ("https://huggingface.co/Qwen/Qwen2.5-7B-Instruct-GGUF/resolve/bb5d59e0/"
            "qwen2.5-7b-instruct-q3_k_m.gguf?download=true")
BASE = ("--host", "{host}", "--port", "{port}")
# vLLM's own answer to a stop and its usage (see vllm_args): abort in-flight requests at SIGTERM,
# and report prompt_tokens_details.cached_tokens as OpenAI does.
VLLM_FIXED = ("--shutdown-timeout", "0", "--enable-prompt-tokens-details")


def profile(engine: str = "vllm", *, gpus: int = 1, nodes: int = 1, args: tuple[str, ...] = ()) -> Profile:
    return Profile(name="p", priority=0, engine=engine, gpus=gpus, nodes=nodes, args=args)  # type: ignore[arg-type]


def model(p: Profile, *, source: str = HF, task: str = "chat", name: str = "llama-8b") -> Model:
    return Model(name=ModelName(name), source=source, size_gb=16.0, profiles=(p,), aliases=("llama", "meta/x"),
                 task=task)  # type: ignore[arg-type]


def args_for(p: Profile, shard: Shard | None = None, **kw: str) -> tuple[str, ...]:
    return engine_args(model(p, **kw), p, shard)


def test_served_name_is_the_canonical_name_not_an_alias() -> None:
    assert served_name(model(profile())) == "llama-8b"


def test_every_catalog_engine_has_a_builder() -> None:
    assert set(BUILDERS) == {"vllm", "sglang", "llama.cpp", "sim"}


# -- vLLM -----------------------------------------------------------------------------------

def test_vllm_single_gpu_profile_args_last() -> None:
    p = profile(args=("--max-model-len", "8192"))
    assert args_for(p) == ("serve", "{weights}", "--served-model-name", "llama-8b", *BASE, *VLLM_FIXED,
                           "--max-model-len", "8192")


def test_vllm_tensor_parallel() -> None:
    assert args_for(profile(gpus=4)) == ("serve", "{weights}", "--served-model-name", "llama-8b", *BASE,
                                         *VLLM_FIXED, "--tensor-parallel-size", "4")


def test_vllm_sharded_rank0_and_rank1() -> None:
    p = profile(gpus=8, nodes=2, args=("--max-model-len", "16384"))
    common = ("serve", "{weights}", "--served-model-name", "llama-8b", *BASE, *VLLM_FIXED,
              "--tensor-parallel-size", "8", "--pipeline-parallel-size", "2", "--nnodes", "2")
    rank0 = args_for(p, Shard(rank=0, node_count=2, rank0_address="10.0.0.11", dist_port=29600))
    assert rank0 == (*common, "--node-rank", "0", "--master-addr", "10.0.0.11", "--master-port", "29600",
                     "--max-model-len", "16384")
    rank1 = args_for(p, Shard(rank=1, node_count=2, rank0_address="10.0.0.11", dist_port=29600))
    assert rank1 == (*common, "--node-rank", "1", "--master-addr", "10.0.0.11", "--master-port", "29600",
                     "--headless", "--max-model-len", "16384")


def test_vllm_embedding_runs_the_pooling_runner() -> None:
    assert args_for(profile(), task="embedding") == (
        "serve", "{weights}", "--served-model-name", "llama-8b", *BASE, *VLLM_FIXED, "--runner", "pooling")


def test_vllm_single_gguf_file_is_named_inside_the_cache_entry() -> None:
    assert args_for(profile(), source=GGUF_URL)[1] == "{weights}/qwen2.5-7b-instruct-q3_k_m.gguf"


# -- SGLang ---------------------------------------------------------------------------------

SGL = ("-m", "sglang.launch_server", "--model-path", "{weights}", "--served-model-name", "llama-8b", *BASE,
       "--enable-metrics")


def test_sglang_single_gpu_and_tp() -> None:
    assert args_for(profile("sglang", args=("--mem-fraction-static", "0.8"))) == (
        *SGL, "--mem-fraction-static", "0.8")
    assert args_for(profile("sglang", gpus=2)) == (*SGL, "--tp-size", "2")


def test_sglang_sharded_ranks_use_total_tp_and_dist_init_addr() -> None:
    p = profile("sglang", gpus=2, nodes=2)
    for rank in (0, 1):
        shard = Shard(rank=rank, node_count=2, rank0_address="sgl-dev-0", dist_port=50000)
        assert args_for(p, shard) == (*SGL, "--tp-size", "4", "--dist-init-addr", "sgl-dev-0:50000",
                                      "--nnodes", "2", "--node-rank", str(rank))


def test_sglang_embedding() -> None:
    assert args_for(profile("sglang"), task="embedding") == (*SGL, "--is-embedding")


# -- llama.cpp ------------------------------------------------------------------------------

def test_llamacpp_cpu_gguf_from_url() -> None:
    p = profile("llama.cpp", gpus=0, args=("--ctx-size", "8192"))
    assert args_for(p, source=GGUF_URL) == (
        "-m", "{weights}/qwen2.5-7b-instruct-q3_k_m.gguf", "--alias", "llama-8b", *BASE, "--metrics",
        "--n-gpu-layers", "0", "--ctx-size", "8192")


def test_llamacpp_gpu_offloads_every_layer_and_embeds() -> None:
    assert args_for(profile("llama.cpp", gpus=1), source="file:///srv/models/bge%20small.gguf",
                    task="embedding") == (
        "-m", "{weights}/bge small.gguf", "--alias", "llama-8b", *BASE, "--metrics", "--n-gpu-layers", "999",
        "--embeddings")


def test_llamacpp_routed_by_prefix_keeps_each_conversation_in_its_slot_unless_the_profile_says() -> None:
    from dataclasses import replace

    from llmgw.engines.argv import engine_args

    p = profile("llama.cpp", gpus=0)
    m = replace(model(p, source=GGUF_URL), routing="prefix")
    assert engine_args(m, p)[-2:] == ("--slot-prompt-similarity", "0")
    own = profile("llama.cpp", gpus=0, args=("--slot-prompt-similarity=0.5",))
    assert engine_args(replace(m, profiles=(own,)), own).count("--slot-prompt-similarity") == 0
    assert "--slot-prompt-similarity" not in args_for(p, source=GGUF_URL)  # least-outstanding: llama.cpp's own


def test_llamacpp_operator_path_is_the_file_itself() -> None:
    assert args_for(profile("llama.cpp"), source="/models/x.gguf")[:2] == ("-m", "{weights}")


def test_llamacpp_directory_source_needs_the_operator_to_name_the_file() -> None:
    with pytest.raises(EngineArgsError, match="does not name one"):
        args_for(profile("llama.cpp"))
    p = profile("llama.cpp", args=("-m", "{weights}/model-q4.gguf"))
    assert args_for(p) == ("--alias", "llama-8b", *BASE, "--metrics", "--n-gpu-layers", "999",
                           "-m", "{weights}/model-q4.gguf")


def test_llamacpp_head_offloads_every_layer_to_its_workers_rpc_servers() -> None:
    # llama.cpp tools/rpc/README.md: `llama-server --rpc host:port,host:port`; a CPU head with
    # -ngl 0 would keep every layer and leave the workers idle.
    p = profile("llama.cpp", gpus=0, nodes=3, args=("--threads", "1"))
    head = Shard(rank=0, node_count=3, rank0_address="10.0.0.11", workers=("10.0.0.12:8101", "[fd00::3]:8100"))
    assert args_for(p, head, source=GGUF_URL) == (
        "-m", "{weights}/qwen2.5-7b-instruct-q3_k_m.gguf", "--alias", "llama-8b", *BASE, "--metrics",
        "--n-gpu-layers", "999", "--rpc", "10.0.0.12:8101,[fd00::3]:8100", "--threads", "1")


def test_llamacpp_worker_is_an_rpc_server_with_only_host_port_and_the_heads_threads() -> None:
    p = profile("llama.cpp", gpus=0, nodes=3, args=("--ctx-size", "2048", "-t", "2"))
    worker = Shard(rank=2, node_count=3, rank0_address="10.0.0.11")
    # No llama-server flag (rpc-server stops at the first it does not know), never -c (a cache on disk).
    assert args_for(p, worker, source=GGUF_URL) == (*BASE, "--threads", "2")
    assert args_for(profile("llama.cpp", gpus=1, nodes=2), Shard(rank=1, node_count=2, rank0_address="a"),
                    source=GGUF_URL) == BASE
    assert shard_engine(p, 0) == "llama.cpp" and shard_engine(p, 1) == shard_engine(p, 2) == "rpc-server"
    assert shard_engine(profile("vllm", nodes=2), 1) == "vllm"


def test_only_a_llamacpp_head_holds_weights_every_vllm_and_sglang_rank_does() -> None:
    assert [holds_weights(profile("llama.cpp", nodes=3), r) for r in range(3)] == [True, False, False]
    assert [holds_weights(profile("vllm", nodes=2), r) for r in range(2)] == [True, True]
    assert [holds_weights(profile("sglang", nodes=2), r) for r in range(2)] == [True, True]


def test_llamacpp_head_without_every_worker_address_is_refused() -> None:
    with pytest.raises(EngineArgsError, match="needs 2 worker address"):
        args_for(profile("llama.cpp", nodes=3), Shard(rank=0, node_count=3, rank0_address="a", workers=("b:1",)),
                 source=GGUF_URL)


def test_fabric_env_of_sharded_vllm_and_sglang_and_none_elsewhere() -> None:
    shard = Shard(rank=1, node_count=2, rank0_address="10.0.0.11")
    # NCCL_SOCKET_IFNAME "=name" matches that interface exactly (NCCL env docs), not every prefix.
    assert shard_env(profile("vllm", nodes=2), shard) == {
        "VLLM_HOST_IP": "{fabric_address}", "NCCL_SOCKET_IFNAME": "={fabric_interface}",
        "GLOO_SOCKET_IFNAME": "{fabric_interface}"}
    assert shard_env(profile("sglang", nodes=2), shard) == {
        "NCCL_SOCKET_IFNAME": "={fabric_interface}", "GLOO_SOCKET_IFNAME": "{fabric_interface}"}
    assert shard_env(profile("llama.cpp", nodes=2), shard) == {}
    assert shard_env(profile("vllm"), None) == {}


# -- sim ------------------------------------------------------------------------------------

def test_sim_args() -> None:
    assert args_for(profile("sim", args=("--ttft", "0.1"))) == (
        "--model", "llama-8b", *BASE, "--ttft", "0.1")
    assert args_for(profile("sim"), task="embedding") == ("--model", "llama-8b", *BASE, "--task", "embedding")
    shard = Shard(rank=1, node_count=2, rank0_address="::1", dist_port=29501)
    assert args_for(profile("sim", nodes=2), shard) == (
        "--model", "llama-8b", *BASE, "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "[::1]:29501")


# -- shards and sources ---------------------------------------------------------------------

def test_a_sharded_profile_needs_a_matching_shard() -> None:
    with pytest.raises(EngineArgsError, match="needs its Shard"):
        args_for(profile(nodes=2))
    with pytest.raises(EngineArgsError, match="shard of 3 nodes"):
        args_for(profile(nodes=2), Shard(rank=0, node_count=3, rank0_address="a"))
    with pytest.raises(EngineArgsError, match="shard of 2 nodes"):
        args_for(profile(), Shard(rank=0, node_count=2, rank0_address="a"))


@pytest.mark.parametrize(("rank", "nodes", "port"), [(2, 2, 1), (-1, 2, 1), (0, 1, 1), (0, 2, 0), (0, 2, 70000)])
def test_shard_rejects_impossible_placements(rank: int, nodes: int, port: int) -> None:
    with pytest.raises(EngineArgsError):
        Shard(rank=rank, node_count=nodes, rank0_address="a", dist_port=port)


def test_unknown_engine_is_refused() -> None:
    with pytest.raises(EngineArgsError, match="unknown engine"):
        args_for(profile("tgi"))


@pytest.mark.parametrize(("source", "name", "path"), [
    (HF, None, "{weights}"),
    (GGUF_URL, "qwen2.5-7b-instruct-q3_k_m.gguf", "{weights}/qwen2.5-7b-instruct-q3_k_m.gguf"),
    ("file:///srv/m/a.GGUF", "a.GGUF", "{weights}/a.GGUF"),
    ("file:///srv/m/tree", None, "{weights}"),
    ("/models/own.gguf", "own.gguf", "{weights}"),
    ("/models/own-dir/", None, "{weights}"),
])
def test_weights_path_follows_the_agents_cache_layout(source: str, name: str | None, path: str) -> None:
    assert source_file_name(source) == name
    assert weights_path(model(profile(), source=source)) == path
