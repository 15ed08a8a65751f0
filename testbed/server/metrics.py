"""Prometheus metrics of `testbed serve`: vLLM's families (the names, label names, histogram buckets and
meanings of vLLM V1's PrometheusStatLogger) under the `vllm:` prefix, or `testbed:` (--metrics-prefix testbed).

Every series carries `model_name` and `engine` (the data-parallel replica: "0" with one engine, and "unrouted"
for requests that failed before any replica took them); cache_config_info carries the cache settings and
`engine`. With LoRA on, lora_requests_info (vLLM's, with only its own labels) names the adapters of the running
and the waiting requests of every replica. Where the numbers come from:
- gauges and the engine's counters (preemptions, prefix-cache queries and hits, prompt and generation tokens)
  follow each replica's stats snapshots, a counter advancing by the growth of the replica's cumulative total;
  iteration_tokens_total observes that token growth once per step that produced tokens;
- latency and per-request histograms are observed here, in the API server, as outputs reach it (as vLLM's
  front-end does): TTFT and E2E from the request's arrival, ITL between outputs, queue time from arrival to the
  engine's first scheduling, prefill / decode / inference time from that scheduling to the first / last token.
docs/metrics.md lists the families and those of vLLM's that are not exposed (and why).
"""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from testbed.runtime.protocol import SchedulerStats

PREFIXES = ("vllm", "testbed")
FINISH_REASONS = ("stop", "length", "abort", "error")
WAITING_REASONS = ("capacity", "deferred")  # deferred: passed over for the LoRA budget (max_loras)
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
UNROUTED = "unrouted"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                         20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)
TOKENS = "tokens"  # buckets 1, 2, 5, 10, 20, 50, ... up to max_model_len

# attribute -> (kind, vLLM's name without prefix, documentation, extra label, buckets)
FAMILIES: dict[str, tuple] = {
    "num_requests_running": ("gauge", "num_requests_running", "Number of requests in model execution batches."),
    "num_requests_waiting": ("gauge", "num_requests_waiting", "Number of requests waiting to be processed."),
    "waiting_by_reason": ("gauge", "num_requests_waiting_by_reason",
                          "Number of waiting requests by reason: 'capacity' = waiting for scheduling capacity; "
                          "'deferred' = deferred by transient constraints (here: a LoRA adapter over --max-loras).",
                          "reason"),
    "engine_sleep_state": ("gauge", "engine_sleep_state", "Engine sleep state; awake = 1 means the engine is awake "
                           "(this engine never sleeps).", "sleep_state"),
    "kv_cache_usage_perc": ("gauge", "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
    "num_requests_swapped": ("gauge", "num_requests_swapped", "Number of requests swapped to CPU."),
    "cpu_cache_usage_perc": ("gauge", "cpu_cache_usage_perc", "CPU KV-cache (swap) usage. 1 means 100 percent usage."),
    "num_swap_preemptions": ("counter", "num_swap_preemptions",
                             "Cumulative number of preemptions that swapped the request's KV blocks to CPU (the "
                             "others recomputed)."),
    "blocks_swapped_out": ("counter", "kv_blocks_swapped_out", "Cumulative number of KV blocks swapped out to CPU."),
    "blocks_swapped_in": ("counter", "kv_blocks_swapped_in", "Cumulative number of KV blocks swapped in from CPU."),
    "prefix_cache_queries": ("counter", "prefix_cache_queries",
                             "Prefix cache queries, in terms of number of queried tokens."),
    "prefix_cache_hits": ("counter", "prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."),
    "num_preemptions": ("counter", "num_preemptions", "Cumulative number of preemption from the engine."),
    "prompt_tokens": ("counter", "prompt_tokens", "Number of prefill tokens processed."),
    "prompt_tokens_by_source": ("counter", "prompt_tokens_by_source", "Number of prompt tokens by source.", "source"),
    "prompt_tokens_cached": ("counter", "prompt_tokens_cached", "Number of cached prompt tokens (local + external)."),
    "generation_tokens": ("counter", "generation_tokens", "Number of generation tokens processed."),
    "request_success": ("counter", "request_success", "Count of successfully processed requests.", "finished_reason"),
    "request_prompt_tokens": ("histogram", "request_prompt_tokens", "Number of prefill tokens processed.", None,
                              TOKENS),
    "request_generation_tokens": ("histogram", "request_generation_tokens", "Number of generation tokens processed.",
                                  None, TOKENS),
    "iteration_tokens": ("histogram", "iteration_tokens_total", "Histogram of number of tokens per engine_step.", None,
                         ITERATION_BUCKETS),
    "request_max_num_generation_tokens": ("histogram", "request_max_num_generation_tokens",
                                          "Histogram of maximum number of requested generation tokens.", None, TOKENS),
    "request_params_n": ("histogram", "request_params_n", "Histogram of the n request parameter.", None, N_BUCKETS),
    "request_params_max_tokens": ("histogram", "request_params_max_tokens",
                                  "Histogram of the max_tokens request parameter.", None, TOKENS),
    "ttft": ("histogram", "time_to_first_token_seconds", "Histogram of time to first token in seconds.", None,
             TTFT_BUCKETS),
    "itl": ("histogram", "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", None,
            TOKEN_LATENCY_BUCKETS),
    "tpot": ("histogram", "request_time_per_output_token_seconds",
             "Histogram of time_per_output_token_seconds per request.", None, TOKEN_LATENCY_BUCKETS),
    "e2e": ("histogram", "e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", None,
            REQUEST_LATENCY_BUCKETS),
    "queue_time": ("histogram", "request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
                   None, REQUEST_LATENCY_BUCKETS),
    "inference_time": ("histogram", "request_inference_time_seconds",
                       "Histogram of time spent in RUNNING phase for request.", None, REQUEST_LATENCY_BUCKETS),
    "prefill_time": ("histogram", "request_prefill_time_seconds",
                     "Histogram of time spent in PREFILL phase for request.", None, REQUEST_LATENCY_BUCKETS),
    "decode_time": ("histogram", "request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
                    None, REQUEST_LATENCY_BUCKETS),
    "prefill_kv_computed": ("histogram", "request_prefill_kv_computed_tokens",
                            "Histogram of new KV tokens computed during prefill (excluding cached tokens).", None,
                            TOKENS),
}
_LABEL_VALUES = {"reason": WAITING_REASONS, "sleep_state": SLEEP_STATES, "source": PROMPT_SOURCES,
                 "finished_reason": FINISH_REASONS}
CACHE_CONFIG_LABELS = ("block_size", "cache_dtype", "enable_prefix_caching", "gpu_memory_utilization",
                       "num_gpu_blocks", "engine")
LORA_INFO_LABELS = ("max_lora", "waiting_lora_adapters", "running_lora_adapters")

disable_created_metrics()  # no *_created series: they only add noise to every scrape


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's buckets of token counts)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


@dataclass(slots=True)
class FinishedRequest:
    """What the per-request histograms need of one finished sequence. Times are time.time(): `arrival` and
    the token times of the API server, `scheduled` the engine's first scheduling (None: never scheduled)."""

    finish_reason: str
    arrival: float
    finished: float
    scheduled: float | None
    first_token: float | None
    last_token: float | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_generation_tokens: int
    max_tokens: int | None


class BatchedHistogram:
    """A histogram child observed once per token (inter-token latency): values are kept in a list and added to the
    Prometheus histogram in bulk by `flush` (ServerMetrics flushes at every stats snapshot, once per engine step,
    and before every scrape), one bucket search each and one locked add per bucket touched, instead of a
    Histogram.observe (a lock and a bucket scan) per token. What a scrape shows is what per-value observes give."""

    __slots__ = ("child", "pending", "observe")

    def __init__(self, child) -> None:
        self.child = child
        self.pending: list[float] = []
        self.observe = self.pending.append

    def flush(self) -> None:
        values = self.pending
        if not values:
            return
        child = self.child
        bounds, counts = child._upper_bounds, {}
        for v in values:
            i = bisect_left(bounds, v)  # the first bucket whose bound is >= v, as Histogram.observe picks
            counts[i] = counts.get(i, 0) + 1
        for i, n in counts.items():
            child._buckets[i].inc(n)
        child._sum.inc(sum(values))
        values.clear()


class EngineMetrics:
    """The metrics of one replica: attributes named as FAMILIES (ttft, prompt_tokens, ...); a family with an
    extra label is a dict from that label's value. `itl` is a BatchedHistogram (flush before reading it)."""

    def __init__(self, families: dict, model_name: str, engine: str) -> None:
        for attr, fam in families.items():
            extra = FAMILIES[attr][3] if len(FAMILIES[attr]) > 3 else None
            if attr == "engine_sleep_state":
                continue  # a state of real replicas only (ServerMetrics sets it)
            if extra is None:
                setattr(self, attr, fam.labels(model_name, engine))
            else:
                setattr(self, attr, {v: fam.labels(model_name, engine, v) for v in _LABEL_VALUES[extra]})
        self.itl = BatchedHistogram(self.itl)
        self._last = SchedulerStats(0, 0, 0.0, 0, 0, 0, -1)

    def update_stats(self, s: SchedulerStats) -> None:
        """A stats snapshot: gauges take its values, counters its growth since the last one (a step's tokens
        are observed in iteration_tokens_total); the inter-token latencies observed since the last one are
        flushed."""
        self.itl.flush()
        self.num_requests_running.set(s.num_running)
        self.num_requests_waiting.set(s.num_waiting)
        self.waiting_by_reason["capacity"].set(s.num_waiting - s.num_deferred)
        self.waiting_by_reason["deferred"].set(s.num_deferred)
        self.kv_cache_usage_perc.set(s.kv_cache_usage)
        self.num_requests_swapped.set(s.num_swapped)
        self.cpu_cache_usage_perc.set(s.cpu_cache_usage)
        last = self._last
        prompt, cached = s.prompt_tokens - last.prompt_tokens, s.cached_prompt_tokens - last.cached_prompt_tokens
        generated = s.generation_tokens - last.generation_tokens
        for counter, grown in ((self.num_preemptions, s.num_preemptions - last.num_preemptions),
                               (self.prefix_cache_queries, s.prefix_cache_queries - last.prefix_cache_queries),
                               (self.prefix_cache_hits, s.prefix_cache_hits - last.prefix_cache_hits),
                               (self.prompt_tokens, prompt), (self.prompt_tokens_cached, cached),
                               (self.prompt_tokens_by_source["local_compute"], prompt - cached),
                               (self.prompt_tokens_by_source["local_cache_hit"], cached),
                               (self.generation_tokens, generated),
                               (self.num_swap_preemptions, s.num_swap_preemptions - last.num_swap_preemptions),
                               (self.blocks_swapped_out, s.blocks_swapped_out - last.blocks_swapped_out),
                               (self.blocks_swapped_in, s.blocks_swapped_in - last.blocks_swapped_in)):
            if grown > 0:
                counter.inc(grown)
        if prompt + generated > 0:
            self.iteration_tokens.observe(prompt + generated)
        self._last = s

    def observe_finished(self, r: FinishedRequest) -> None:
        """One sequence ended: its finish reason, latencies (those it got that far for) and token counts."""
        self.request_success[r.finish_reason if r.finish_reason in self.request_success else "error"].inc()
        self.e2e.observe(max(r.finished - r.arrival, 0.0))
        self.request_prompt_tokens.observe(r.num_prompt_tokens)
        self.request_generation_tokens.observe(r.num_generation_tokens)
        if r.max_tokens:
            self.request_params_max_tokens.observe(r.max_tokens)
        if r.scheduled is None:
            return
        self.queue_time.observe(max(r.scheduled - r.arrival, 0.0))
        if r.first_token is None or r.last_token is None:
            return
        self.prefill_kv_computed.observe(r.num_prompt_tokens - r.num_cached_tokens)
        self.prefill_time.observe(max(r.first_token - r.scheduled, 0.0))
        self.decode_time.observe(r.last_token - r.first_token)
        self.inference_time.observe(max(r.last_token - r.scheduled, 0.0))
        if r.num_generation_tokens > 1:
            self.tpot.observe((r.last_token - r.first_token) / (r.num_generation_tokens - 1))

    def observe_parent(self, n: int, max_generation_tokens: int) -> None:
        """Every sequence of one prompt (n of them) ended; the longest generated that many tokens."""
        self.request_params_n.observe(n)
        self.request_max_num_generation_tokens.observe(max_generation_tokens)


class ServerMetrics:
    """Every family, with one EngineMetrics per replica. `num_gpu_blocks` maps each replica to its KV-cache
    size (cache_config_info); `cache` holds the other cache settings; `max_loras` (None: LoRA off) adds
    lora_requests_info."""

    def __init__(self, model_name: str, num_engines: int = 1, max_model_len: int = 4096, prefix: str = "vllm",
                 num_gpu_blocks: dict[int, int] | None = None, cache: dict[str, str] | None = None,
                 max_loras: int | None = None) -> None:
        if prefix not in PREFIXES:
            raise ValueError(f"--metrics-prefix must be one of {PREFIXES}, got {prefix!r}")
        self.registry = r = CollectorRegistry()
        self.model_name = model_name
        token_buckets = build_1_2_5_buckets(max_model_len)
        fams: dict = {}
        for attr, (kind, name, doc, *rest) in FAMILIES.items():
            labels = ["model_name", "engine"] + ([rest[0]] if rest and rest[0] else [])
            if kind == "histogram":
                fams[attr] = Histogram(f"{prefix}:{name}", doc, labels, registry=r,
                                       buckets=token_buckets if rest[1] == TOKENS else rest[1])
            else:
                fams[attr] = (Gauge if kind == "gauge" else Counter)(f"{prefix}:{name}", doc, labels, registry=r)
        self._families = fams
        self.engines: dict[int | None, EngineMetrics] = {
            e: EngineMetrics(fams, model_name, str(e)) for e in range(num_engines)}
        info = Gauge(f"{prefix}:cache_config_info", "Information of the LLMEngine CacheConfig", CACHE_CONFIG_LABELS,
                     registry=r)
        for e in self.engines:
            for state in SLEEP_STATES:
                fams["engine_sleep_state"].labels(model_name, str(e), state).set(state == "awake")
            blocks = (num_gpu_blocks or {}).get(e)
            info.labels(**{**{k: "" for k in CACHE_CONFIG_LABELS}, **(cache or {}),
                           "num_gpu_blocks": "" if blocks is None else str(blocks), "engine": str(e)}).set(1)
        self._max_lora = str(max_loras)
        self._lora_info = None if max_loras is None else Gauge(
            f"{prefix}:lora_requests_info", "Running stats on lora requests.", LORA_INFO_LABELS, registry=r)
        # replica -> the (running, waiting) adapters of its last snapshot
        self._lora_adapters: dict[int, tuple[dict[str, int], dict[str, int]]] = {}
        self._update_lora_info()

    def update_stats(self, e: int, s: SchedulerStats) -> None:
        """A stats snapshot of replica `e`: its families, then lora_requests_info."""
        self.engine(e).update_stats(s)
        if self._lora_info is not None:
            self._lora_adapters[e] = (s.running_lora_adapters, s.waiting_lora_adapters)
            self._update_lora_info()

    def _update_lora_info(self) -> None:
        """vLLM's lora_requests_info: the series of (max_lora, waiting adapters, running adapters), the names
        comma-separated (each once, in replica order), is set to the current time; series of earlier adapter
        sets stay with the time they were last current, as in vLLM (the newest one is the present)."""
        if self._lora_info is None:
            return
        replicas = [self._lora_adapters[e] for e in sorted(self._lora_adapters)]
        running = ",".join(dict.fromkeys(name for r, _ in replicas for name in r))
        waiting = ",".join(dict.fromkeys(name for _, w in replicas for name in w))
        self._lora_info.labels(self._max_lora, waiting, running).set_to_current_time()

    def engine(self, e: int | None) -> EngineMetrics:
        """The metrics of replica `e` (None: a request no replica took)."""
        m = self.engines.get(e)
        if m is None:
            m = self.engines[e] = EngineMetrics(self._families, self.model_name, UNROUTED if e is None else str(e))
        return m

    def render(self) -> bytes:
        for m in self.engines.values():
            m.itl.flush()
        return generate_latest(self.registry)
