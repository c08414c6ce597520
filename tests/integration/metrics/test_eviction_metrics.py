"""Issue 37: a pool's prefix-cache miss rate and the KV-cache eviction advice
its load reports are answered with, on a real server's /metrics (beside the
ReportLoad answers that carry the advice to the sidecars)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb
from burstgate_client.protoclient import ProtoClient

from tests.conftest import FakeClock, ServerThread
from tests.integration.metrics.test_tenant_metrics import Samples, scrape_until

POOL = "gpu-a"  # declared in the test policy (tests/conftest.py)
MISS = "burstgate_pool_kv_cache_miss_rate"
EVICT = "burstgate_pool_evict_below_reuse_per_second"


def report(c: ProtoClient, engine_id: str, max_batch: int, **kw: Any) -> pb.LoadReportAck:
    ack: pb.LoadReportAck = c.report_load(pb.LoadReport(
        pool=POOL, engine_id=engine_id, max_batch_tokens=max_batch, queue_capacity=256, **kw
    ))  # fmt: skip
    return ack


def of(m: Samples, name: str) -> float | None:
    return m.get((name, (("pool", POOL),)))


def test_miss_rate_and_eviction_advice_per_pool_on_metrics(
    migrated_url: str, make_server: Callable[..., ServerThread]
) -> None:
    # the clock stands still: no report goes stale while the test runs
    srv = make_server(migrated_url, FakeClock(), metrics_port=0, metrics_sample_s=0.05)
    with ProtoClient(srv.target) as c:
        # an engine that does not measure its prefix cache: no miss-rate series
        idle = report(c, "e0", 1000)
        m = scrape_until(srv, lambda m: of(m, EVICT) is not None, "the pool's advice")
        assert of(m, MISS) is None
        assert of(m, EVICT) == idle.evict_below_reuse_per_s == 0.30
        # two that do: their rates weighted by batch capacity, (0.2 + 3 x 0.6) / 4
        report(c, "e1", 1000, kv_cache_miss_rate=0.2)
        quiet = report(c, "e2", 3000, kv_cache_miss_rate=0.6)
        m = scrape_until(srv, lambda m: of(m, MISS) is not None, "the pool's miss rate")
        assert of(m, MISS) == pytest.approx(0.5)
        assert of(m, EVICT) == quiet.evict_below_reuse_per_s
        # the pool full: the advice drops (keep more), on the metric as in the answer
        for e, cap in (("e0", 1000), ("e1", 1000), ("e2", 3000)):
            busy = report(c, e, cap, batch_tokens=cap, queue_depth=512, kv_cache_miss_rate=0.9)
        assert busy.evict_below_reuse_per_s == 0.05
        m = scrape_until(srv, lambda m: of(m, EVICT) == 0.05, "the busy pool's advice")
        assert of(m, MISS) == pytest.approx(0.9)
