"""Memory protection over real gRPC: at the cap on open reservations, unary
Admit and AdmitStream entries are refused with REASON_OPEN_RESERVATIONS and a
retry_after hint, and a Complete frees a place; /metrics reports the open
count, the caps, the refusals and the process's resident memory (SQLite and
PostgreSQL, via ``migrated_url``)."""

from __future__ import annotations

import time
import urllib.request
from decimal import Decimal
from typing import Any

from burstgate_client.protoclient import ProtoClient, make_batch, pb
from prometheus_client.parser import text_string_to_metric_families

from controlplane.domain import TenantConfig
from controlplane.domain.policy import Policy
from controlplane.settings import Settings
from tests.conftest import ServerThread
from tests.support import add_tenants


def scrape(port: int | None) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_the_cap_refuses_with_its_reason_and_a_complete_frees_a_place(migrated_url: str) -> None:
    big: dict[str, Any] = {"token_rate": Decimal(10**6), "burst_tokens": 10**8}
    add_tenants(migrated_url, TenantConfig("acme", **big), TenantConfig("beta", **big))
    settings = Settings(
        database_url=migrated_url, host="127.0.0.1", port=0, metrics_port=0,
        admission_auth=False, max_open_reservations=5, max_open_reservations_per_tenant=3,
        concurrency_retry_ms=300, policy=Policy(pool_gate=False),
    )  # fmt: skip
    srv = ServerThread(settings, time.time_ns)
    try:
        with ProtoClient(srv.target) as c:
            for i in range(3):
                d = c.admit("acme", f"a{i}", prompt_tokens=10, max_tokens=10)
                assert d.decision == pb.DECISION_ADMIT
            # the same request id again is the same reservation, not a fourth
            assert c.admit("acme", "a0", prompt_tokens=10, max_tokens=10).duplicate
            d = c.admit("acme", "a3", prompt_tokens=10, max_tokens=10)
            assert (d.decision, d.reason) == (pb.DECISION_REJECT, pb.REASON_OPEN_RESERVATIONS)
            assert d.retry_after_ms == 300 and d.retryable and d.reservation_id == 0
            # a batch: beta takes the plane's last two places, then the cap binds
            batch = make_batch(1, ["beta"] * 3 + ["acme"], ["b0", "b1", "b2", "a4"], [10] * 4,
                               [10] * 4)  # fmt: skip
            (r,) = c.admit_stream([batch])
            assert list(r.reason) == [
                pb.REASON_UNSPECIFIED, pb.REASON_UNSPECIFIED,
                pb.REASON_OPEN_RESERVATIONS, pb.REASON_OPEN_RESERVATIONS,
            ]  # fmt: skip
            assert list(r.retry_after_ms) == [0, 0, 300, 300]
            assert list(r.retryable) == [False, False, True, True]
            m = scrape(srv.plane.metrics_port)
            assert m[("burstgate_open_reservations", ())] == 5
            assert m[("burstgate_open_reservations_limit", (("scope", "overall"),))] == 5
            assert m[("burstgate_open_reservations_limit", (("scope", "tenant"),))] == 3
            refused = {
                dict(labels)["tenant"]: v
                for (name, labels), v in m.items()
                if name == "burstgate_decisions_total"
                and ("reason", "open_reservations") in labels
            }
            assert refused == {"acme": 2, "beta": 1}
            assert m[("process_resident_memory_bytes", ())] > 10 * 2**20
            # a Complete frees a place, for a unary Admit and a batch entry alike
            c.complete("acme", "a1", prompt_tokens=10, generated_tokens=5)
            assert c.admit("acme", "a5", prompt_tokens=10, max_tokens=10).decision == (
                pb.DECISION_ADMIT
            )
            c.complete("beta", "b0", prompt_tokens=10, generated_tokens=5)
            (r,) = c.admit_stream([make_batch(2, ["beta"], ["b3"], [10], [10])])
            assert list(r.decision) == [pb.DECISION_ADMIT]
            assert scrape(srv.plane.metrics_port)[("burstgate_open_reservations", ())] == 5
    finally:
        srv.stop()
