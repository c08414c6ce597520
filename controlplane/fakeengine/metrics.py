"""The fake engine's ``/metrics``, in vLLM's metric names and labels
(``model_name``, ``engine``), so that what scrapes a vLLM server (a
dashboard, llm-d's or the Gateway API Inference Extension's saturation
detector, burstgate's own load reports later) reads this one the same way.

Gauges and the model's token counters are read from the engine at scrape
time; latencies (model seconds, see live.py) are observed when a request
finishes.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from controlplane.fakeengine.live import LiveEngine, LiveRequest

# vLLM's own buckets for these histograms (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
# vLLM's buckets of vllm:iteration_tokens_total (tokens per engine step).
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
LABELS = ("model_name", "engine")


class _EngineState(Collector):
    def __init__(self, live: LiveEngine, model: str) -> None:
        self.live = live
        self.labels = [model, "0"]

    def collect(self) -> Iterator[Metric]:
        e = self.live.engine
        for name, doc, value in (
            ("vllm:num_requests_running", "Number of requests in model execution batches.",
             e.num_running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
             e.num_waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
             e.kv_usage),
        ):  # fmt: skip
            g = GaugeMetricFamily(name, doc, labels=LABELS)
            g.add_metric(self.labels, float(value))
            yield g
        for name, doc, value in (
            ("vllm:prompt_tokens", "Number of prefill tokens processed.", e.prompt_tokens_total),
            ("vllm:generation_tokens", "Number of generation tokens processed.",
             e.generation_tokens_total),
            ("vllm:num_preemptions", "Cumulative number of preemptions from the engine.",
             e.preemptions),
        ):  # fmt: skip
            c = CounterMetricFamily(name, doc, labels=LABELS)
            c.add_metric(self.labels, float(value))
            yield c


class EngineMetrics:
    """A registry of its own (not the process's default one)."""

    def __init__(self, live: LiveEngine, model: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineState(live, model))
        self._labels = {"model_name": model, "engine": "0"}
        r = self.registry
        self.prefix_queries = Counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            LABELS, registry=r,
        ).labels(**self._labels)  # fmt: skip
        self.prefix_hits = Counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            LABELS, registry=r,
        ).labels(**self._labels)  # fmt: skip
        self.success = Counter(
            "vllm:request_success", "Count of successfully processed requests.",
            (*LABELS, "finished_reason"), registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            LABELS, buckets=TTFT_BUCKETS, registry=r,
        ).labels(**self._labels)  # fmt: skip
        self.queue_time = Histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            LABELS, buckets=LATENCY_BUCKETS, registry=r,
        ).labels(**self._labels)  # fmt: skip
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            LABELS, buckets=LATENCY_BUCKETS, registry=r,
        ).labels(**self._labels)  # fmt: skip
        # Tokens per engine step: what a sidecar's load report calls batch_tokens.
        self.iteration_tokens = Histogram(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
            LABELS, buckets=ITERATION_BUCKETS, registry=r,
        ).labels(**self._labels)  # fmt: skip
        live.on_finish.append(self._finished)
        live.on_step.append(self.iteration_tokens.observe)

    def prompt(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.prefix_queries.inc(prompt_tokens)
        self.prefix_hits.inc(cached_tokens)

    def finished(self, reason: str) -> None:
        self.success.labels(**self._labels, finished_reason=reason).inc()

    def _finished(self, live: LiveRequest) -> None:
        self.ttft.observe(live.ttft_s)
        self.queue_time.observe(live.queue_s)
        self.e2e.observe(live.e2e_s)
