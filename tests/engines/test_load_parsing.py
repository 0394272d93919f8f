"""Load from canned /metrics text of each engine, in the shapes the engines really print."""

from __future__ import annotations

from llmgw.engines.health import Load, parse_load

VLLM = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="llama-8b"} 3.0
vllm:num_requests_running{engine="1",model_name="llama-8b"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="llama-8b"} 4.0
vllm:num_requests_waiting{engine="1",model_name="llama-8b"} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="llama-8b"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="llama-8b"} 0.75
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="llama-8b"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="llama-8b"} 7.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="llama-8b"} 7.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="llama-8b"} 1.5
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="llama-8b"} 1234.0
"""

VLLM_OLD = """\
# HELP vllm:num_requests_running Number of requests currently running on GPU.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 0.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.5
"""

SGLANG = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m",tp_rank="0",pp_rank="0"} 8.0
sglang:num_running_reqs{model_name="m",tp_rank="0",pp_rank="1"} 2.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m",tp_rank="0",pp_rank="0"} 4.0
# HELP sglang:token_usage The token usage
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m",tp_rank="0",pp_rank="0"} 0.28
"""

LLAMACPP = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 120
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 2
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 5
"""


def test_vllm_sums_label_sets_and_reports_the_fullest_cache() -> None:
    # Its prompt counter too (every prompt token: what bounds the prompts routers report).
    assert parse_load(VLLM, "vllm") == Load(running=5, waiting=5, kv_cache_usage=0.75, prompted=1234.0)


def test_vllm_old_cache_spelling() -> None:
    assert parse_load(VLLM_OLD, "vllm") == Load(running=1, waiting=0, kv_cache_usage=0.5)


def test_vllm_prefers_the_new_spelling_when_both_are_exported() -> None:
    both = VLLM_OLD + 'vllm:kv_cache_usage_perc{model_name="m"} 0.125\n'
    assert parse_load(both, "vllm") == Load(running=1, waiting=0, kv_cache_usage=0.125)


def test_sglang() -> None:
    assert parse_load(SGLANG, "sglang") == Load(running=10, waiting=4, kv_cache_usage=0.28)


def test_llamacpp_has_no_cache_gauge() -> None:
    # Nor a prompt counter of every prompt token: its prompt_tokens_total leaves out what its cache held.
    assert parse_load(LLAMACPP, "llama.cpp") == Load(running=2, waiting=5, kv_cache_usage=None)


def test_sim_speaks_vllm() -> None:
    assert parse_load(VLLM, "sim") == parse_load(VLLM, "vllm")


def test_no_load_metrics_is_unknown_not_idle() -> None:
    assert parse_load(LLAMACPP, "vllm") is None
    assert parse_load("", "sglang") is None


def test_a_malformed_sample_is_no_reading_not_idle() -> None:
    assert parse_load("vllm:num_requests_running{model_name=\"m\" 1\n", "vllm") is None


def test_a_gauge_that_is_not_a_count_is_no_reading_not_an_exception() -> None:
    # vLLM's running gauge as NaN once ended the router's load readings of every replica.
    assert parse_load("vllm:num_requests_running NaN\nvllm:num_requests_waiting +Inf\n", "vllm") is None
    load = parse_load("vllm:num_requests_running NaN\nvllm:num_requests_waiting 3\n"
                      "vllm:gpu_cache_usage_perc NaN\n", "vllm")
    assert load is not None and (load.running, load.waiting, load.kv_cache_usage) == (0, 3, None)
