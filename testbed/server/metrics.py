"""Prometheus metrics of `testbed serve`: vLLM's metric names under the `testbed:` prefix, labelled
by `model_name` and, as vLLM's, by `engine` (the data-parallel replica; "0" with one replica, and
"unrouted" for requests that failed before any replica took them).

Gauges and the preemption / prefix-cache counters follow each replica's stats snapshots
(counters advance by the growth of its cumulative totals); token counters and latency histograms
are observed here, in the API server, as outputs reach it (as vLLM's front-end does).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from testbed.server.protocol import SchedulerStats

FINISH_REASONS = ("stop", "length", "abort", "error")
UNROUTED = "unrouted"
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
_GAUGES = {"num_requests_running": "Requests in the running batch.",
           "num_requests_waiting": "Requests waiting to be scheduled.",
           "kv_cache_usage_perc": "KV-cache usage: 1 means 100 percent."}
_COUNTERS = {"prompt_tokens": "Prefill tokens processed.", "generation_tokens": "Generation tokens processed.",
             "num_preemptions": "Cumulative preemptions in the engine.",
             "prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
             "prefix_cache_hits": "Prompt tokens found in the prefix cache."}
_HISTOGRAMS = {"ttft": ("time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS),
               "itl": ("inter_token_latency_seconds", "Time between successive tokens.", _ITL_BUCKETS),
               "e2e": ("e2e_request_latency_seconds", "End-to-end request latency.", _LATENCY_BUCKETS),
               "queue_time": ("request_queue_time_seconds", "Time waiting before first scheduled.", _LATENCY_BUCKETS)}

disable_created_metrics()  # no *_created series: they only add noise to every scrape


class EngineMetrics:
    """The metrics of one replica: attributes named as the metrics (ttft, prompt_tokens, ...)."""

    def __init__(self, families: dict, model_name: str, engine: str) -> None:
        for attr, fam in families.items():
            if attr != "request_success":
                setattr(self, attr, fam.labels(model_name, engine))
        self.request_success = {f: families["request_success"].labels(model_name, engine, f) for f in FINISH_REASONS}
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


class ServerMetrics:
    def __init__(self, model_name: str, num_engines: int = 1) -> None:
        self.registry = r = CollectorRegistry()
        self.model_name = model_name
        lab = ["model_name", "engine"]
        fams: dict = {name: Gauge(f"testbed:{name}", doc, lab, registry=r) for name, doc in _GAUGES.items()}
        fams |= {name: Counter(f"testbed:{name}", doc, lab, registry=r) for name, doc in _COUNTERS.items()}
        fams |= {attr: Histogram(f"testbed:{name}", doc, lab, buckets=b, registry=r)
                 for attr, (name, doc, b) in _HISTOGRAMS.items()}
        fams["request_success"] = Counter("testbed:request_success", "Finished requests by finish reason.",
                                          lab + ["finished_reason"], registry=r)
        self._families = fams
        self.engines: dict[int | None, EngineMetrics] = {
            e: EngineMetrics(fams, model_name, str(e)) for e in range(num_engines)}

    def engine(self, e: int | None) -> EngineMetrics:
        """The metrics of replica `e` (None: a request no replica took)."""
        m = self.engines.get(e)
        if m is None:
            m = self.engines[e] = EngineMetrics(self._families, self.model_name, UNROUTED if e is None else str(e))
        return m

    def render(self) -> bytes:
        return generate_latest(self.registry)
