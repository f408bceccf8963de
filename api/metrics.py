"""Prometheus metrics under vLLM's names, so existing dashboards work.

Gauges and counters are read from the engine's ``stats()`` snapshot at scrape time (a
custom collector); per-request histograms and the success counter are observed by the
HTTP handlers as requests finish.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.messages import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0)


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats], model_name: str) -> None:
        self._stats = stats
        self._model = model_name

    def collect(self) -> Iterator:
        s = self._stats()
        for name, doc, value in (
            ("vllm:num_requests_running", "Requests in the running batch.", s.num_running),
            ("vllm:num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting),
            ("vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = 100%).", s.kv_cache_usage),
        ):
            yield self._one(GaugeMetricFamily(name, doc, labels=["model_name"]), value)
        for name, doc, value in (
            ("vllm:prompt_tokens", "Prompt tokens computed.", s.num_prompt_tokens),
            ("vllm:generation_tokens", "Tokens generated.", s.num_generation_tokens),
            ("vllm:num_preemptions", "Requests preempted.", s.num_preemptions),
            ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries),
            ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits),
        ):
            yield self._one(CounterMetricFamily(name, doc, labels=["model_name"]), value)

    def _one(self, family, value):
        family.add_metric([self._model], value)
        return family


class Metrics:
    """The server's registry. Resource handling: none beyond memory; one per app."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(stats, model_name))
        labels = ["model_name"]
        self.request_success = Counter("vllm:request_success", "Requests finished, by reason.",
                                       labels + ["finished_reason"], registry=self.registry)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between output tokens.", labels,
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency, arrival to finish.", labels,
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.queue = Histogram("vllm:request_queue_time_seconds", "Time from arrival to first scheduling.", labels,
                               buckets=_LATENCY_BUCKETS, registry=self.registry)

    def observe_request(self, timer: RequestTimer, finish_reasons: list[str]) -> None:
        m = self.model_name
        if timer.first_token is not None:
            self.ttft.labels(m).observe(timer.first_token - timer.arrival)
        if timer.first_scheduled is not None:
            self.queue.labels(m).observe(max(0.0, timer.first_scheduled - timer.arrival))
        for gap in timer.gaps:
            self.itl.labels(m).observe(gap)
        self.e2e.labels(m).observe(timer.last - timer.arrival)
        for reason in finish_reasons:
            self.request_success.labels(m, reason).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Timestamps of one request's outputs (monotonic seconds, as the engine's clock)."""

    def __init__(self, arrival: float) -> None:
        self.arrival = arrival
        self.first_token: float | None = None
        self.first_scheduled: float | None = None
        self.last = arrival
        self.gaps: list[float] = []

    def on_tokens(self, now: float, num_tokens: int) -> None:
        if num_tokens == 0:
            return
        if self.first_token is None:
            self.first_token = now
        else:
            self.gaps.append((now - self.last) / num_tokens)  # coalesced tokens share the interval
        self.last = now
