"""The engine's Prometheus /metrics as a ``LoadReport`` (the mapping is the
one proto/burstgate/v1/admission.proto gives, in vLLM's names).

A report field takes the first of its metric names that the page has
(several for renamed metrics, e.g. vLLM's ``kv_cache_usage_perc``, before
that ``gpu_cache_usage_perc``), summed over its series (a data-parallel
engine has one per rank), except ``kv_cache_usage`` which is their mean:

- ``queue_depth`` (required), a gauge: ``vllm:num_requests_waiting``;
- ``requests_running``, a gauge: ``vllm:num_requests_running``;
- ``kv_cache_usage``, a gauge 0..1: ``vllm:kv_cache_usage_perc``, else
  ``vllm:gpu_cache_usage_perc``;
- ``batch_tokens``: a histogram's mean over the interval (delta sum / delta
  count; a gauge: its value): ``vllm:iteration_tokens_total``;
- ``prefix_cache_hits``, ``prefix_cache_queries``, counters of prompt
  tokens: the miss rate is 1 - delta hits / delta queries over the interval:
  ``vllm:prefix_cache_hits``, ``vllm:prefix_cache_queries`` (v1 engine; on
  the wire ``..._total``; older: ``vllm:gpu_prefix_cache_*``);
- ``prefix_cache_hit_rate``, a gauge: the miss rate is 1 - it, only when the
  page has no such counters (vLLM's v0 ``vllm:gpu_prefix_cache_hit_rate``);
- ``gpu_utilization``, a gauge in percent: DCGM's ``DCGM_FI_DEV_GPU_UTIL``.

SGLang and TGI presets map what they have. SGLang's counters are
``sglang:cached_tokens_total`` (its series by ``cache_source``: device, host,
storage, summed) over ``sglang:prompt_tokens_total``; both count a request
when it finishes, so its rate trails vLLM's by a request's duration. Its
``sglang:cache_hit_rate`` gauge is the last prefill batch's rate, not the
interval's: read only from a page without the counters (older SGLang). The
config's ``metrics.names`` overrides any field. Counters and histograms are
read as deltas between two scrapes (a counter that went down, an engine
restart, counts from zero; the two prefix-cache counters restart together,
so that a restart's fresh hits are never divided by the old queries); a
term with nothing in the interval is left out (the miss rate unset), never
guessed. A page without the queue depth gives no report: it is the gate's
main signal, and a report without it would read as an empty queue.

Parsing: the page's lines are cut to the wanted metrics before
``prometheus_client.parser`` reads them, so that a large vLLM page (every
histogram's buckets) costs the event loop little.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb
from burstgate_client.sidecar.config import REPORT_FIELDS, EngineKind, MetricsSettings

FIELDS = REPORT_FIELDS
PRESETS: dict[EngineKind, dict[str, tuple[str, ...]]] = {
    EngineKind.VLLM: {
        "queue_depth": ("vllm:num_requests_waiting",),
        "requests_running": ("vllm:num_requests_running",),
        "kv_cache_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        "batch_tokens": ("vllm:iteration_tokens_total",),
        "prefix_cache_hits": ("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits"),
        "prefix_cache_queries": ("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries"),
        "prefix_cache_hit_rate": ("vllm:gpu_prefix_cache_hit_rate",),
        "gpu_utilization": ("DCGM_FI_DEV_GPU_UTIL",),
    },
    EngineKind.SGLANG: {
        "queue_depth": ("sglang:num_queue_reqs",),
        "requests_running": ("sglang:num_running_reqs",),
        "kv_cache_usage": ("sglang:token_usage",),
        "prefix_cache_hits": ("sglang:cached_tokens",),
        "prefix_cache_queries": ("sglang:prompt_tokens",),
        "prefix_cache_hit_rate": ("sglang:cache_hit_rate",),
        "gpu_utilization": ("DCGM_FI_DEV_GPU_UTIL",),
    },
    EngineKind.TGI: {
        "queue_depth": ("tgi_queue_size",),
        "requests_running": ("tgi_batch_current_size",),
        "batch_tokens": ("tgi_batch_current_max_tokens",),
        "gpu_utilization": ("DCGM_FI_DEV_GPU_UTIL",),
    },
}
MAX_COUNT = 10**12  # the proto's bound on counts


@dataclass(frozen=True, slots=True)
class Series:
    """One metric family on one page, its series combined."""

    kind: str  # gauge | counter | histogram | unknown | ...
    value: float  # gauges: the sum; counters: the total; histograms: the sum
    count: float  # histograms: the count; gauges: how many series
    series: int


def names_for(settings: MetricsSettings) -> dict[str, tuple[str, ...]]:
    """The preset's names with the config's overrides (checked there)."""
    names = dict(PRESETS[settings.engine])
    for field, value in settings.names.items():
        names[field] = (value,) if isinstance(value, str) else tuple(value)
    return names


def _wanted(names: Mapping[str, tuple[str, ...]]) -> tuple[set[str], set[str]]:
    families = {n for listed in names.values() for n in listed}
    families |= {n.removesuffix("_total") for n in families}
    samples = {f + s for f in families for s in ("", "_total", "_sum", "_count", "_created")}
    return families, samples


def parse(text: str, families: set[str], samples: set[str]) -> dict[str, Series]:
    """The wanted families of an exposition page, by family name."""
    kept: list[str] = []
    for line in text.splitlines():
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[1] == "TYPE" and parts[2] in families:
                kept.append(line)
            continue
        end = len(line)
        for sep in ("{", " "):
            i = line.find(sep)
            if 0 <= i < end:
                end = i
        if line[:end] in samples:
            kept.append(line)
    out: dict[str, Series] = {}
    for family in text_string_to_metric_families("\n".join(kept) + "\n"):
        total = count = 0.0
        series = 0
        for s in family.samples:
            if family.type == "histogram":
                if s.name.endswith("_sum"):
                    total += s.value
                    series += 1
                elif s.name.endswith("_count"):
                    count += s.value
            elif s.name in (family.name, family.name + "_total"):
                total += s.value
                series += 1
        # The parser splits the series of a counter typed without its
        # ``_total`` into one untyped family each: they add up here.
        if (seen := out.get(family.name)) is not None:
            total, count, series = seen.value + total, seen.count + count, seen.series + series
        out[family.name] = Series(family.type, total, count, series)
    return out


class LoadReader:
    """Turns successive pages into reports (counters as deltas)."""

    def __init__(self, settings: MetricsSettings, *, pool: str, engine_id: str) -> None:
        self.settings = settings
        self.pool, self.engine_id = pool, engine_id
        self.names = names_for(settings)
        self._families, self._samples = _wanted(self.names)
        self._prev: dict[str, Series] = {}
        self._prev_cache: tuple[float, float] | None = None  # (hits, queries) totals

    def _find(self, page: Mapping[str, Series], field: str) -> Series | None:
        for name in self.names.get(field, ()):
            for key in (name, name.removesuffix("_total"), name + "_total"):
                if key in page and page[key].series:
                    return page[key]
        return None

    def _delta(self, field: str, now: Series | None) -> tuple[float, float] | None:
        if now is None:
            return None
        before = self._prev.get(field)
        self._prev[field] = now
        if before is None:
            return None
        dv, dc = now.value - before.value, now.count - before.count
        if dv < 0 or dc < 0:  # reset (the engine restarted): counted from zero
            dv, dc = now.value, now.count
        return dv, dc

    def _cache_delta(
        self, hits: Series | None, queries: Series | None
    ) -> tuple[float, float] | None:
        """(delta hits, delta queries) since the last page with both counters;
        if either went down (the engine restarted), both count from zero."""
        if hits is None or queries is None:
            self._prev_cache = None
            return None
        before, now = self._prev_cache, (hits.value, queries.value)
        self._prev_cache = now
        if before is None:
            return None
        dh, dq = now[0] - before[0], now[1] - before[1]
        return now if dh < 0 or dq < 0 else (dh, dq)

    def report(self, text: str) -> pb.LoadReport | None:
        """The report for this page; None without a queue depth."""
        page = parse(text, self._families, self._samples)
        found = {f: self._find(page, f) for f in FIELDS}
        queue = found["queue_depth"]
        s = self.settings
        batch = found["batch_tokens"]
        batch_tokens = 0.0
        if batch is not None and batch.kind == "histogram":
            d = self._delta("batch_tokens", batch)
            batch_tokens = d[0] / d[1] if d and d[1] > 0 else 0.0
        elif batch is not None:
            batch_tokens = batch.value
        cache = self._cache_delta(found["prefix_cache_hits"], found["prefix_cache_queries"])
        if queue is None:
            return None
        r = pb.LoadReport(
            pool=self.pool, engine_id=self.engine_id, max_batch_tokens=s.max_batch_tokens,
            queue_depth=_count(queue.value), batch_tokens=_count(batch_tokens),
            queue_capacity=s.queue_capacity,
        )  # fmt: skip
        if s.max_num_seqs is not None:
            r.max_num_seqs = s.max_num_seqs
        if (running := found["requests_running"]) is not None:
            r.requests_running = _count(running.value)
        if (kv := found["kv_cache_usage"]) is not None and kv.series:
            r.kv_cache_usage = _fraction(kv.value / kv.series)
        if self._prev_cache is not None:  # the counters are on the page
            if cache is not None and cache[1] > 0:
                r.kv_cache_miss_rate = _fraction(1 - cache[0] / cache[1])
        elif (rate := found["prefix_cache_hit_rate"]) is not None and rate.series:
            r.kv_cache_miss_rate = _fraction(1 - rate.value / rate.series)
        if (gpu := found["gpu_utilization"]) is not None and gpu.series:
            r.gpu_utilization = _fraction(gpu.value / gpu.series / 100)
        return r


def _count(v: float) -> int:
    return min(MAX_COUNT, max(0, round(v)))


def _fraction(v: float) -> float:
    return min(1.0, max(0.0, v))
