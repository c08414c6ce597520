"""The autoscaling signals on a real server's /metrics (issue 32,
docs/autoscaling.md "Signals"): demand counts what users asked for over
real gRPC (admitted, held, refused for capacity) and not a tenant's own
limits; a request held by the pool gate shows as backlog until released."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb
from burstgate_client.protoclient import ProtoClient, make_batch

from tests.conftest import FakeClock, ServerThread
from tests.integration.ledger.conftest import setup_db
from tests.integration.ledger.conftest import tenant as tenant_config
from tests.integration.metrics.test_tenant_metrics import Samples, scrape_until, series, value
from tests.support import add_tenants

POOL = "a100"
NAMES = (
    "burstgate_pool_backlog_requests",
    "burstgate_pool_backlog_tokens",
    "burstgate_pool_predicted_wait_seconds",
    "burstgate_pool_demand_tokens_per_second",
    "burstgate_pool_demand_requests_per_second",
    "burstgate_pool_desired_engines",
    "burstgate_pool_desired_engines_predicted",
)


def engine(c: ProtoClient, running: int) -> None:
    """One engine of 4 sequence slots, ``running`` taken."""
    c.report_load(
        pb.LoadReport(
            pool=POOL, engine_id="e1", batch_tokens=running, max_batch_tokens=8192,
            queue_depth=0, queue_capacity=0, gpu_utilization=0.5, requests_running=running,
            max_num_seqs=4,
        )
    )  # fmt: skip


def test_demand_backlog_and_desired_engines_on_metrics(
    migrated_url: str, make_server: Callable[..., ServerThread]
) -> None:
    setup_db(migrated_url, "acme")
    add_tenants(migrated_url, tenant_config("beta", max_tokens_per_request=1000))
    # the service's clock stands still (at a whole second): the window's
    # rates are exact, however slow the machine
    srv = make_server(migrated_url, FakeClock(), metrics_port=0, metrics_sample_s=0.05)
    with ProtoClient(srv.target) as c:
        engine(c, running=0)
        # asked and admitted: two requests, 300 prompt tokens
        assert c.admit("acme", "a1", prompt_tokens=100, max_tokens=10, pool=POOL).decision == 1
        assert c.admit("acme", "a2", prompt_tokens=200, max_tokens=10, pool=POOL).decision == 1
        # a tenant's own limits: not demand
        big = c.admit("beta", "b1", prompt_tokens=5_000, max_tokens=10, pool=POOL)
        assert big.reason == pb.REASON_MAX_TOKENS
        assert c.admit("nobody", "n1", prompt_tokens=7, max_tokens=1, pool=POOL).decision != 1
        # the engine full: a batch (never waits) is refused for capacity: demand
        engine(c, running=4)
        (res,) = c.admit_stream(
            [make_batch(1, ["acme"], ["s1"], [400], [10], pool=POOL, lanes=["standard"])]
        )
        assert list(res.reason) == [pb.REASON_BACKPRESSURE]

        # a unary Admit the gate holds, on a thread: the backlog while it waits
        answers: list[Any] = []

        def wait_for_room() -> None:
            answers.append(
                c.admit("acme", "h1", prompt_tokens=1_000, max_tokens=10, lane="standard",
                        pool=POOL)
            )

        held = threading.Thread(target=wait_for_room)
        held.start()
        try:

            def holding(m: Samples) -> bool:
                return series(m, "burstgate_pool_backlog_requests", "pool", "lane").get(
                    (POOL, "standard")
                ) == 1

            m = scrape_until(srv, holding, "the held request as backlog on /metrics")
        finally:
            engine(c, running=0)  # room: it is released
            held.join(timeout=30)
        assert answers and answers[0].decision == 1
        # 1,000 held prompt tokens, nothing of the other lanes
        assert value(m, "burstgate_pool_backlog_tokens", pool=POOL, lane="standard") == 1_000
        assert value(m, "burstgate_pool_backlog_requests", pool=POOL, lane="premium") == 0
        # asked: a1, a2, s1, h1 (not b1, n1): 4 requests, 1,700 prompt tokens
        # over the 10 s window
        assert value(m, "burstgate_pool_demand_requests_per_second", pool=POOL) == 0.4
        assert value(m, "burstgate_pool_demand_tokens_per_second", pool=POOL) == 170
        # no pace learned yet: the engines reporting
        assert value(m, "burstgate_pool_desired_engines", pool=POOL) == 1
        assert value(m, "burstgate_pool_desired_engines_predicted", pool=POOL) == 1
        # every name of the contract is served
        names = {n for (n, _labels) in m}
        assert set(NAMES) - {"burstgate_pool_predicted_wait_seconds"} <= names

        def released(m: Samples) -> bool:
            return value(m, "burstgate_pool_backlog_requests", pool=POOL, lane="standard") == 0

        m = scrape_until(srv, released, "the backlog empty once released")
        # nothing held: nothing to wait behind
        assert value(m, "burstgate_pool_predicted_wait_seconds", pool=POOL, lane="standard") == 0
