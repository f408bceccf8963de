"""Prometheus metrics under vLLM's names, so existing dashboards work.

Gauges and counters are read from the engine's ``stats()`` snapshot at scrape time (a
custom collector); per-request histograms and the success counter are fed by the engine's
stat-logger hook as requests produce tokens and end.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from engine.frontend.stats import IterationStats
from engine.messages import EngineStats, KVCacheInfo
from engine.sched.request import FINISH_REASONS

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets, so that alert rules naming an ``le`` and fleets summed by ``le`` work alike.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0)
# Token counts: 1, 2, 5, 10, 20, 50... (vLLM's 1-2-5 series, up to the longest context it serves).
_TOKEN_BUCKETS = tuple(m * 10 ** e for e in range(7) for m in (1, 2, 5))


class _EngineCollector(Collector):
    """The engines' counters, one series per engine (the ``engine`` label, as vLLM's: "0"
    unless data parallel)."""

    def __init__(self, engine_stats: Callable[[], list[EngineStats]], model_name: str,
                 kv_caches: Callable[[], list[KVCacheInfo]]) -> None:
        self._engine_stats = engine_stats
        self._model = model_name
        self._kv_caches = kv_caches

    def collect(self) -> Iterator:
        engines = self._engine_stats()
        if caches := self._kv_caches():
            yield _cache_config_info(caches)
        series = _SERIES + (_SPEC_DECODE_SERIES if any(s.spec_accepted_per_pos for s in engines) else ())
        for family, name, doc, value in series:
            metric = family(name, doc, labels=["model_name", "engine"])
            for rank, stats in enumerate(engines):
                metric.add_metric([self._model, str(rank)], value(stats))
            yield metric
        if series is not _SERIES:  # (speculative decoding is on)
            metric = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                         "Proposed tokens kept, by their position among a step's proposals.",
                                         labels=["model_name", "engine", "position"])
            for rank, stats in enumerate(engines):
                for position, count in enumerate(stats.spec_accepted_per_pos):
                    metric.add_metric([self._model, str(rank), str(position)], count)
            yield metric


def _cache_config_info(caches: list[KVCacheInfo]) -> GaugeMetricFamily:
    """vLLM's info gauge of the KV cache: 1, with the configuration in its labels (vLLM's label
    names and ``str()`` of their values; ``num_gpu_blocks`` counts the cache's blocks on any
    device), one series per engine, plus the bytes a token takes."""
    names = ["engine", "block_size", "num_gpu_blocks", "cache_dtype", "enable_prefix_caching", "sliding_window",
             "kv_bytes_per_token"]
    metric = GaugeMetricFamily("vllm:cache_config_info", "The KV cache's configuration (in the labels).",
                               labels=names)
    for rank, cache in enumerate(caches):
        values = (rank, cache.block_size, cache.num_blocks, cache.cache_dtype, cache.enable_prefix_caching,
                  cache.sliding_window, cache.bytes_per_token)
        metric.add_metric([str(v) for v in values], 1)
    return metric


# (family, name, description, value of an engine's stats) of each engine-labelled series.
_SERIES = (
    (GaugeMetricFamily, "vllm:num_requests_running", "Requests in the running batch.", lambda s: s.num_running),
    (GaugeMetricFamily, "vllm:num_requests_waiting", "Requests waiting to be scheduled.", lambda s: s.num_waiting),
    (GaugeMetricFamily, "vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = 100%).",
     lambda s: s.kv_cache_usage),
    (GaugeMetricFamily, "vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc under its older name (deprecated "
                                                      "in vLLM; its dashboard still reads it).", lambda s: s.kv_cache_usage),
    (CounterMetricFamily, "vllm:prompt_tokens", "Prompt tokens of the sequences that produced a first token, "
                                                "computed or found in the prefix cache (as vLLM counts them).",
     lambda s: s.num_request_prompt_tokens),
    (CounterMetricFamily, "vllm:generation_tokens", "Tokens generated.", lambda s: s.num_generation_tokens),
    (CounterMetricFamily, "vllm:num_preemptions", "Requests preempted.", lambda s: s.num_preemptions),
    (CounterMetricFamily, "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
     lambda s: s.prefix_cache_queries),
    (CounterMetricFamily, "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
     lambda s: s.prefix_cache_hits),
)
# Speculative decoding's, as vLLM names them (only where it is on).
_SPEC_DECODE_SERIES = (
    (CounterMetricFamily, "vllm:spec_decode_num_drafts", "Steps of a request that carried proposed tokens.",
     lambda s: s.spec_num_drafts),
    (CounterMetricFamily, "vllm:spec_decode_num_draft_tokens", "Proposed tokens computed.",
     lambda s: s.spec_num_draft_tokens),
    (CounterMetricFamily, "vllm:spec_decode_num_accepted_tokens", "Proposed tokens kept.",
     lambda s: s.spec_num_accepted_tokens),
)


class Metrics:
    """The server's registry. Resource handling: none beyond memory; one per app.

    ``record`` is the engine's stat logger (``EngineClient.add_stat_logger``): it gets the
    engine's own timings of every request, streamed or not, finished, aborted or failed.
    Every labelled series exists from start-up (at zero), as in vLLM, so dashboards and
    scrapers see them before the first request.
    """

    def __init__(self, engine_stats: Callable[[], list[EngineStats]], model_name: str,
                 kv_caches: Callable[[], list[KVCacheInfo]] = list) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self._engines = _EngineCollector(engine_stats, model_name, kv_caches)
        self.registry.register(self._engines)
        labels = ["model_name"]
        success = Counter("vllm:request_success", "Requests finished, by reason.", labels + ["finished_reason"],
                          registry=self.registry)
        self.request_success = {reason: success.labels(model_name, reason) for reason in FINISH_REASONS.values()}
        self.ttft = self._histogram("vllm:time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self.itl = self._histogram("vllm:inter_token_latency_seconds", "Time between output tokens.", _ITL_BUCKETS)
        self.tpot = self._histogram("vllm:time_per_output_token_seconds", "vllm:inter_token_latency_seconds under its "
                                    "older name (deprecated in vLLM; its dashboard still reads it).", _ITL_BUCKETS)
        self.e2e = self._histogram("vllm:e2e_request_latency_seconds", "Request latency, arrival to finish.",
                                   _REQUEST_BUCKETS)
        self.queue = self._histogram("vllm:request_queue_time_seconds", "Time from arrival to first scheduling.",
                                     _REQUEST_BUCKETS)
        self.prefill = self._histogram("vllm:request_prefill_time_seconds", "Time from first scheduling to the first "
                                       "token.", _REQUEST_BUCKETS)
        self.decode = self._histogram("vllm:request_decode_time_seconds", "Time from the first token to the last.",
                                      _REQUEST_BUCKETS)
        self.inference = self._histogram("vllm:request_inference_time_seconds", "Time from first scheduling to the "
                                         "last token.", _REQUEST_BUCKETS)
        self.prompt_tokens = self._histogram("vllm:request_prompt_tokens", "Prompt tokens of each finished request (each of "
                                             "its n completions counts, as in vLLM).",
                                             _TOKEN_BUCKETS)
        self.generation_tokens = self._histogram("vllm:request_generation_tokens", "Tokens generated for each "
                                                 "finished request (each of its n completions counts, as in vLLM).", _TOKEN_BUCKETS)
        self.max_generation_tokens = self._histogram("vllm:request_max_num_generation_tokens", "The longest "
                                                     "completion of each finished request, in tokens.", _TOKEN_BUCKETS)
        self.params_n = self._histogram("vllm:request_params_n", "The n of each finished request.", (1, 2, 5, 10, 20))

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]):
        family = Histogram(name, doc, ["model_name"], buckets=buckets, registry=self.registry)
        return family.labels(self.model_name)

    def record(self, stats: IterationStats) -> None:
        for ttft in stats.time_to_first_tokens:
            self.ttft.observe(ttft)
        for itl in stats.inter_token_latencies:
            self.itl.observe(itl)
            self.tpot.observe(itl)
        for request in stats.finished:  # (a request, or each of its n completions: vLLM's child requests)
            self.e2e.observe(request.e2e_latency)
            if request.queue_time is not None:
                self.queue.observe(request.queue_time)
            if request.prefill_time is not None:
                self.prefill.observe(request.prefill_time)
                self.decode.observe(request.decode_time)
                self.inference.observe(request.prefill_time + request.decode_time)
            self.prompt_tokens.observe(request.num_prompt_tokens)
            self.generation_tokens.observe(request.num_generation_tokens)
            self.request_success[request.finish_reason].inc()
        for n, longest in zip(stats.params_n, stats.max_num_generation_tokens):
            self.params_n.observe(n)
            self.max_generation_tokens.observe(longest)

    def exposition(self) -> bytes:
        """The metrics text. Under ``--api-server-count`` (PROMETHEUS_MULTIPROC_DIR set for
        every front) the request counters and histograms are every front's, added up by
        prometheus_client's multiprocess collector; the engine series are the engines' own
        (every front sees their stats)."""
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            registry = CollectorRegistry()
            MultiProcessCollector(registry)
            registry.register(self._engines)
            return generate_latest(registry)
        return generate_latest(self.registry)
