"""Prometheus metrics: the only module that speaks Prometheus.

Each app gets its own CollectorRegistry (tests run several apps in one
process). Request metrics are observed from the engine's plain-data
`RequestTimings` when a request ends; gauges are read from
the engine's `stats()` at scrape time, so nothing polls.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.types import EngineStats
from frontend.request import RequestTimings

LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
    0.75, 1.0, 2.5,
)  # fmt: skip


def _kv_usage(stats: EngineStats) -> float:
    return float(stats.kv_pages_used / max(1, stats.kv_pages_total))


def _prefix_usage(stats: EngineStats) -> float:
    return float(stats.prefix_cached_pages / max(1, stats.kv_pages_total))


# (family, name, help, value from EngineStats), one model_name label each; vLLM's meanings
_SERIES: tuple[tuple[type[Metric], str, str, Callable[[EngineStats], float]], ...] = (
    (GaugeMetricFamily, "llm_requests_running", "Sequences holding KV pages",
     lambda s: s.running_requests),
    (GaugeMetricFamily, "llm_requests_waiting", "Sequences waiting to be scheduled",
     lambda s: s.waiting_requests),
    (GaugeMetricFamily, "llm_kv_cache_usage_perc",
     "KV cache pages held by running sequences, 0..1", _kv_usage),
    (CounterMetricFamily, "llm_prefix_cache_queries",
     "Prompt tokens looked up in the prefix cache", lambda s: s.prefix_queries),
    (CounterMetricFamily, "llm_prefix_cache_hits", "Prompt tokens found in the prefix cache",
     lambda s: s.prefix_hits),
    (GaugeMetricFamily, "llm_prefix_cache_usage_perc",
     "KV cache pages keeping a prefix block no sequence holds, 0..1", _prefix_usage),
    (CounterMetricFamily, "llm_num_preemptions",
     "Sequences preempted for pages (recomputed later)", lambda s: s.preemptions),
    (CounterMetricFamily, "llm_engine_steps", "Steps the engine core ran", lambda s: s.steps),
    (CounterMetricFamily, "llm_spec_decode_num_drafts",
     "Speculative decoding: sequence-steps that verified drafts", lambda s: s.spec_drafts),
    (CounterMetricFamily, "llm_spec_decode_num_draft_tokens",
     "Speculative decoding: draft tokens proposed", lambda s: s.spec_draft_tokens),
    (CounterMetricFamily, "llm_spec_decode_num_accepted_tokens",
     "Speculative decoding: draft tokens accepted", lambda s: s.spec_accepted_tokens),
)  # fmt: skip


class _StatsCollector(Collector):
    """Gauges and counters of the engine's state, read at scrape time."""

    def __init__(self, model_name: str, read_stats: Callable[[], EngineStats | None]):
        self._model_name = model_name
        self._read_stats = read_stats

    def collect(self) -> Iterator[Metric]:
        stats = self._read_stats()
        name = [self._model_name]
        for family, metric, doc, read in _SERIES:
            series = family(metric, doc, labels=["model_name"])  # type: ignore[call-arg]
            if stats is not None:
                series.add_metric(name, read(stats))  # type: ignore[attr-defined]
            yield series
        memory = GaugeMetricFamily(
            "llm_engine_memory_bytes",
            "Device memory given to each engine pool at start",
            labels=["model_name", "pool"],
        )
        if stats is not None:
            memory.add_metric(name + ["kv_cache"], stats.kv_cache_bytes)
            memory.add_metric(name + ["weights"], stats.weight_bytes)
        yield memory
        per_position = CounterMetricFamily(
            "llm_spec_decode_num_accepted_tokens_per_pos",
            "Speculative decoding: draft tokens accepted, by their position in the draft",
            labels=["model_name", "position"],
        )
        for position, count in enumerate(() if stats is None else stats.spec_accepted_per_position):
            per_position.add_metric(name + [str(position)], count)
        yield per_position
        if stats is not None and stats.lora[2]:
            yield _lora_info(name, stats)


def _lora_info(name: list[str], stats: EngineStats) -> Metric:
    """vLLM's lora_requests_info: one series whose labels name the adapters of running and
    of waiting sequences (comma-separated) and the pool's size, its value the time it was
    read (the Gateway API inference extension's picker routes by adapter affinity on it)."""
    running, waiting, max_loras = stats.lora
    info = GaugeMetricFamily(
        "llm_lora_requests_info",
        "LoRA adapters of running and waiting requests, and the most resident at once",
        labels=["model_name", "running_lora_adapters", "waiting_lora_adapters", "max_lora"],
    )
    labels = [",".join(running), ",".join(waiting), str(max_loras)]
    info.add_metric(name + labels, time.time())
    return info


class EngineMetrics:
    """Request-level metrics with units in their names and a model_name label."""

    def __init__(
        self,
        registry: CollectorRegistry,
        model_name: str,
        read_stats: Callable[[], EngineStats | None],
    ):
        self.model_name = model_name
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, registry=registry, buckets=buckets)

        self.ttft = histogram(
            "llm_time_to_first_token_seconds", "Queued to first token", LATENCY_BUCKETS
        )
        self.itl = histogram(
            "llm_inter_token_latency_seconds", "Time between a request's tokens", ITL_BUCKETS
        )
        self.e2e = histogram(
            "llm_e2e_request_latency_seconds", "Queued to finished", LATENCY_BUCKETS
        )
        self.queue = histogram(
            "llm_request_queue_time_seconds", "Queued to prefill start", LATENCY_BUCKETS
        )
        self.prefill = histogram(
            "llm_request_prefill_time_seconds", "Prefill start to end", LATENCY_BUCKETS
        )
        self.decode = histogram(
            "llm_request_decode_time_seconds", "First token to finished", LATENCY_BUCKETS
        )
        self.prompt_tokens = Counter(
            "llm_prompt_tokens", "Prompt tokens processed", labels, registry=registry
        )
        self.generation_tokens = Counter(
            "llm_generation_tokens", "Tokens generated", labels, registry=registry
        )
        self.finished = Counter(
            "llm_requests_finished",
            "Samples finished, by finish_reason",
            ["model_name", "finish_reason"],
            registry=registry,
        )
        self.failed = Counter(
            "llm_requests_failed",
            "Requests failed, by error type",
            ["model_name", "error_type"],
            registry=registry,
        )
        registry.register(_StatsCollector(model_name, read_stats))
        # Observed once a token: the series resolved here, not by a labels() lookup each time.
        self._itl = self.itl.labels(model_name)

    def observe_first_token(self, timings: RequestTimings) -> None:
        """A prompt's first token reached the server: its queue, prefill and TTFT, at once."""
        name = self.model_name
        if timings.queue_s is not None:
            self.queue.labels(name).observe(timings.queue_s)
        if timings.prefill_start is not None and timings.prefill_end is not None:
            self.prefill.labels(name).observe(timings.prefill_end - timings.prefill_start)
        if timings.ttft_s is not None:
            self.ttft.labels(name).observe(timings.ttft_s)

    def observe_inter_token(self, seconds: float) -> None:
        """The gap between two tokens of one sample, as each arrives."""
        self._itl.observe(max(0.0, seconds))

    def observe_end(self, timings: RequestTimings) -> None:
        """A prompt's stream ended (all its samples)."""
        if timings.e2e_s is not None:
            self.e2e.labels(self.model_name).observe(timings.e2e_s)
        decode = timings.phases().get("decode")
        if decode is not None:
            self.decode.labels(self.model_name).observe(decode)

    def observe_sample(self, finish_reason: str, completion_tokens: int) -> None:
        self.finished.labels(self.model_name, finish_reason).inc()
        self.generation_tokens.labels(self.model_name).inc(completion_tokens)

    def observe_prompt(self, prompt_tokens: int) -> None:
        self.prompt_tokens.labels(self.model_name).inc(prompt_tokens)

    def observe_failure(self, error_type: str) -> None:
        self.failed.labels(self.model_name, error_type).inc()
