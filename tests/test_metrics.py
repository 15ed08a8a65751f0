"""/metrics carries vLLM's families by default: vLLM's names (`vllm:` prefix), label names and histogram buckets,
with values that move as vLLM's do. The server is `testbed serve --emulate --cost-model zero` (the real API server
and engine core, no model forward: each request echoes its prompt, so token counts are exact); the official
`openai` client sends the requests. The `testbed:` prefix (--metrics-prefix testbed) is covered in
test_server_faults.py, the per-replica `engine` label in test_dp_serve.py.
"""
from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_helpers import metric, running_server

pytestmark = pytest.mark.timeout(300)
MAX_MODEL_LEN = 128
BASE = ("model_name", "engine")

# vLLM's families (vllm/v1/metrics/loggers.py) this engine computes: name -> (type, extra label)
FAMILIES = {
    "num_requests_running": ("gauge", None), "num_requests_waiting": ("gauge", None),
    "num_requests_waiting_by_reason": ("gauge", "reason"), "engine_sleep_state": ("gauge", "sleep_state"),
    "kv_cache_usage_perc": ("gauge", None), "prefix_cache_queries": ("counter", None),
    "prefix_cache_hits": ("counter", None), "num_preemptions": ("counter", None), "prompt_tokens": ("counter", None),
    "prompt_tokens_by_source": ("counter", "source"), "prompt_tokens_cached": ("counter", None),
    "generation_tokens": ("counter", None), "request_success": ("counter", "finished_reason"),
    "request_prompt_tokens": ("histogram", None), "request_generation_tokens": ("histogram", None),
    "iteration_tokens_total": ("histogram", None), "request_max_num_generation_tokens": ("histogram", None),
    "request_params_n": ("histogram", None), "request_params_max_tokens": ("histogram", None),
    "time_to_first_token_seconds": ("histogram", None), "inter_token_latency_seconds": ("histogram", None),
    "request_time_per_output_token_seconds": ("histogram", None), "e2e_request_latency_seconds": ("histogram", None),
    "request_queue_time_seconds": ("histogram", None), "request_inference_time_seconds": ("histogram", None),
    "request_prefill_time_seconds": ("histogram", None), "request_decode_time_seconds": ("histogram", None),
    "request_prefill_kv_computed_tokens": ("histogram", None), "cache_config_info": ("gauge", None),
}
# vLLM's bucket lists, as vLLM writes them
TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
        80.0, 160.0, 640.0, 2560.0]
PER_TOKEN = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
REQUEST = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
           960.0, 1920.0, 7680.0]
BUCKETS = {"time_to_first_token_seconds": TTFT, "inter_token_latency_seconds": PER_TOKEN,
           "request_time_per_output_token_seconds": PER_TOKEN, "e2e_request_latency_seconds": REQUEST,
           "request_queue_time_seconds": REQUEST, "request_inference_time_seconds": REQUEST,
           "request_prefill_time_seconds": REQUEST, "request_decode_time_seconds": REQUEST,
           "iteration_tokens_total": [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384],
           "request_params_n": [1, 2, 5, 10, 20],
           **{n: [1, 2, 5, 10, 20, 50, 100] for n in ("request_prompt_tokens", "request_generation_tokens",
                                                      "request_max_num_generation_tokens", "request_params_max_tokens",
                                                      "request_prefill_kv_computed_tokens")}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server("--emulate", "--cost-model", "zero", "--max-model-len", str(MAX_MODEL_LEN),
                        "--num-gpu-blocks", "64", "--enable-prefix-caching", "--served-model-name", "smol",
                        log_dir=tmp_path_factory.mktemp("metrics")) as srv:
        yield srv


def scrape(server) -> str:
    return httpx.get(f"{server.url}/metrics", timeout=30).text


def test_vllm_families_labels_and_buckets(server):
    fams = {f.name: f for f in text_string_to_metric_families(scrape(server))}
    assert not [n for n in fams if not n.startswith("vllm:")], "every family has vLLM's prefix"
    for name, (kind, extra) in FAMILIES.items():
        fam = fams.get(f"vllm:{name}")
        assert fam is not None and fam.type == kind, name
        if name == "cache_config_info":
            (s,) = fam.samples
            assert s.labels == {"block_size": "16", "cache_dtype": "auto", "enable_prefix_caching": "True",
                                "gpu_memory_utilization": "0.9", "num_gpu_blocks": "64", "engine": "0"}
            continue
        for s in fam.samples:
            assert set(s.labels) - {"le"} == {*BASE, *([extra] if extra else [])}, (name, s.labels)
            assert s.labels["model_name"] == "smol" and s.labels["engine"] == "0"
        if kind == "histogram":
            les = [float(s.labels["le"]) for s in fam.samples if s.name.endswith("_bucket")]
            assert les == [*BUCKETS[name], float("inf")], name
    page = scrape(server)
    assert metric(page, "vllm:engine_sleep_state", sleep_state="awake") == 1
    assert metric(page, "vllm:engine_sleep_state", sleep_state="discard_all") == 0
    assert {s.labels["finished_reason"] for s in fams["vllm:request_success"].samples} == {"stop", "length", "abort",
                                                                                            "error"}
    assert {s.labels["source"] for s in fams["vllm:prompt_tokens_by_source"].samples} == {
        "local_compute", "local_cache_hit", "external_kv_transfer"}


def _totals(page: str) -> dict[str, float]:
    names = ["prompt_tokens_total", "generation_tokens_total", "prompt_tokens_cached_total", "iteration_tokens_total_sum",
             "iteration_tokens_total_count", "request_params_n_sum", "request_params_n_count",
             "request_max_num_generation_tokens_sum", "request_params_max_tokens_sum", "request_prompt_tokens_sum",
             "request_generation_tokens_sum", "request_prefill_kv_computed_tokens_sum"]
    names += [f"{h}_count" for h in ("e2e_request_latency_seconds", "request_queue_time_seconds",
                                     "request_prefill_time_seconds", "request_decode_time_seconds",
                                     "request_inference_time_seconds", "request_time_per_output_token_seconds",
                                     "time_to_first_token_seconds", "inter_token_latency_seconds")]
    out = {n: metric(page, f"vllm:{n}") for n in names}
    for source in ("local_compute", "local_cache_hit", "external_kv_transfer"):
        out[source] = metric(page, "vllm:prompt_tokens_by_source_total", source=source)
    out["length"] = metric(page, "vllm:request_success_total", finished_reason="length")
    return out


def test_values_move_as_vllms(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)
    short = "Count: one two three"  # under one block: no sequence of it reads the prefix cache
    long = "The quick brown fox jumps over the lazy dog. " * 4
    before = _totals(scrape(server))
    a = client.completions.create(model="smol", prompt=short, max_tokens=3, n=2)
    client.completions.create(model="smol", prompt=long, max_tokens=4)
    b = client.completions.create(model="smol", prompt=long, max_tokens=4)  # reads the first one's blocks
    page = scrape(server)
    d = {k: v - before[k] for k, v in _totals(page).items()}
    pa, pb = a.usage.prompt_tokens, b.usage.prompt_tokens
    cached = b.usage.prompt_tokens_details.cached_tokens
    assert pa < 17 and pb > 32 and cached == (pb - 1) // 16 * 16
    prompts, generated = 2 * pa + 2 * pb, 3 + 3 + 4 + 4
    assert d["prompt_tokens_total"] == prompts and d["generation_tokens_total"] == generated
    assert d["iteration_tokens_total_sum"] == prompts + generated
    assert d["iteration_tokens_total_count"] >= 4  # a step per token at least (prefills may share a step)
    assert d["prompt_tokens_cached_total"] == d["local_cache_hit"] == cached and d["external_kv_transfer"] == 0
    assert d["local_compute"] == prompts - cached
    assert d["length"] == 4
    for h in ("e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
              "request_decode_time_seconds", "request_inference_time_seconds", "request_time_per_output_token_seconds",
              "time_to_first_token_seconds"):
        assert d[f"{h}_count"] == 4, h
    assert d["inter_token_latency_seconds_count"] == 2 + 2 + 3 + 3
    assert d["request_params_n_count"] == 3 and d["request_params_n_sum"] == 2 + 1 + 1  # one per prompt
    assert d["request_max_num_generation_tokens_sum"] == 3 + 4 + 4
    assert d["request_params_max_tokens_sum"] == 3 + 3 + 4 + 4
    assert d["request_prompt_tokens_sum"] == prompts and d["request_generation_tokens_sum"] == generated
    assert d["request_prefill_kv_computed_tokens_sum"] == prompts - cached
    assert metric(page, "vllm:num_requests_waiting_by_reason", reason="capacity") == metric(
        page, "vllm:num_requests_waiting") == 0
    assert metric(page, "vllm:num_requests_running") == 0 and metric(page, "vllm:kv_cache_usage_perc") == 0


def test_swap_preemption_shows_in_the_swap_families(tmp_path):
    """--preemption-mode swap: vLLM V0's swap gauges (requests swapped, CPU cache usage) and the counters of swap
    preemptions and blocks moved, which a tight cache under concurrent sequences makes move. The six sequences
    are one request's (n=6), so they reach the engine together: six separate requests reached it far enough
    apart, about one run in six, that they all fit and nothing was preempted."""
    with running_server("--emulate", "--cost-model", "zero", "--max-model-len", str(MAX_MODEL_LEN),
                        "--num-gpu-blocks", "12", "--preemption-mode", "swap", "--num-cpu-blocks", "64",
                        "--served-model-name", "smol", log_dir=tmp_path) as srv:
        fams = {f.name: f.type for f in text_string_to_metric_families(scrape(srv))}
        assert {n: fams.get(f"vllm:{n}") for n in ("num_requests_swapped", "cpu_cache_usage_perc",
                                                   "num_swap_preemptions", "kv_blocks_swapped_out",
                                                   "kv_blocks_swapped_in")} == {
            "num_requests_swapped": "gauge", "cpu_cache_usage_perc": "gauge", "num_swap_preemptions": "counter",
            "kv_blocks_swapped_out": "counter", "kv_blocks_swapped_in": "counter"}
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=60)
        prompt = "The quick brown fox jumps over the lazy dog. " * 4  # about 40 tokens: 5 blocks with its outputs
        done = client.completions.create(model="smol", prompt=prompt, max_tokens=40, n=6,
                                         extra_body={"ignore_eos": True})
        assert len(done.choices) == 6 and done.usage.completion_tokens == 6 * 40
        page = scrape(srv)
        swaps = metric(page, "vllm:num_swap_preemptions_total")
        assert swaps > 0 and swaps == metric(page, "vllm:num_preemptions_total")
        assert metric(page, "vllm:kv_blocks_swapped_out_total") == metric(page, "vllm:kv_blocks_swapped_in_total") > 0
        assert metric(page, "vllm:num_requests_swapped") == 0 and metric(page, "vllm:cpu_cache_usage_perc") == 0
