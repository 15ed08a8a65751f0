"""Prometheus metrics of `testbed serve`: vLLM's metric names under the `testbed:` prefix.

Gauges and the preemption / prefix-cache counters follow the engine core's stats snapshots
(counters advance by the growth of the core's cumulative totals); token counters and latency
histograms are observed here, in the API server, as outputs reach it (as vLLM's front-end does).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from testbed.server.protocol import SchedulerStats

FINISH_REASONS = ("stop", "length", "abort", "error")
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)


disable_created_metrics()  # no *_created series: they only add noise to every scrape


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        lab = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"testbed:{name}", doc, lab, registry=r).labels(model_name)

        def counter(name: str, doc: str):
            return Counter(f"testbed:{name}", doc, lab, registry=r).labels(model_name)

        def hist(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"testbed:{name}", doc, lab, buckets=buckets, registry=r).labels(model_name)

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent.")
        self.prompt_tokens = counter("prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Generation tokens processed.")
        self.num_preemptions = counter("num_preemptions", "Cumulative preemptions in the engine.")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        success = Counter("testbed:request_success", "Finished requests by finish reason.",
                          lab + ["finished_reason"], registry=r)
        self.request_success = {f: success.labels(model_name, f) for f in FINISH_REASONS}
        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between successive tokens.", _ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency.", _LATENCY_BUCKETS)
        self.queue_time = hist("request_queue_time_seconds", "Time waiting before first scheduled.",
                               _LATENCY_BUCKETS)
        self._last = SchedulerStats(0, 0, 0.0, 0, 0, 0, -1)

    def update_stats(self, s: SchedulerStats) -> None:
        self.num_requests_running.set(s.num_running)
        self.num_requests_waiting.set(s.num_waiting)
        self.kv_cache_usage_perc.set(s.kv_cache_usage)
        last = self._last
        for counter, new, old in ((self.num_preemptions, s.num_preemptions, last.num_preemptions),
                                  (self.prefix_cache_queries, s.prefix_cache_queries, last.prefix_cache_queries),
                                  (self.prefix_cache_hits, s.prefix_cache_hits, last.prefix_cache_hits)):
            if new > old:
                counter.inc(new - old)
        self._last = s

    def render(self) -> bytes:
        return generate_latest(self.registry)
