"""Per-tenant and per-lane metrics of a real server, scraped over HTTP.

Two tenants (acme, beta) in two lanes each, through unary Admits and an
AdmitStream batch, some Completes; then two more tenants past the tenant
label limit (2), and an unknown tenant id. Every expected value is computed
from what the server answered on the wire (decisions, reserved tokens, the
Complete replies' charges), never written down by hand.
"""

from __future__ import annotations

import urllib.request
from collections import Counter
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import pytest
from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb
from burstgate_client.protoclient import ProtoClient, make_batch
from prometheus_client.parser import text_string_to_metric_families

from controlplane.store.db import upgrade
from tests.conftest import ServerThread
from tests.integration.ledger.conftest import ACME_PRICE, DEFAULT_PRICE, setup_db
from tests.integration.ledger.conftest import tenant as tenant_config
from tests.support import add_tenants, wait_until

# (sample name, sorted labels) -> value
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]

ADMISSION = "burstgate.v1.AdmissionService"


def scrape(srv: ServerThread) -> Samples:
    url = f"http://127.0.0.1:{srv.plane.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def scrape_until(srv: ServerThread, check: Callable[[Samples], Any], message: str) -> Samples:
    """Scrape until ``check`` holds (a stream is counted when it ends; the
    live gauges are sampled every metrics_sample_s)."""

    def scraped() -> Samples | None:
        m = scrape(srv)
        return m if check(m) else None

    return wait_until(scraped, message=message)


def series(m: Samples, name: str, *by: str) -> dict[tuple[str, ...], float]:
    """The samples of ``name`` keyed by the values of labels ``by``."""
    return {tuple(dict(labels)[b] for b in by): v for (n, labels), v in m.items() if n == name}


def value(m: Samples, name: str, **labels: str) -> float:
    return m[(name, tuple(sorted(labels.items())))]


class Expected:
    """What the metrics must say, tallied from the server's answers."""

    def __init__(self) -> None:
        self.decisions: Counter[tuple[str, str, str, str]] = Counter()
        self.admitted: Counter[tuple[str, str]] = Counter()
        self.settled: Counter[tuple[str, str]] = Counter()
        self.settled_tokens: Counter[tuple[str, str]] = Counter()
        self.charge: dict[tuple[str, str, str], Decimal] = {}
        self.cost: dict[tuple[str, str, str], Decimal] = {}
        self.lane_of: dict[tuple[str, str], str] = {}

    def decided(self, tenant: str, rid: str, lane: str, decision: int, reason: int,
                reserved: int) -> None:  # fmt: skip
        admitted = decision == pb.DECISION_ADMIT
        wire = pb.Reason.Name(pb.Reason.ValueType(reason))  # REASON_UNSPECIFIED = admitted
        name = "ok" if admitted else wire.removeprefix("REASON_").lower()
        self.decisions[(tenant, lane, "admit" if admitted else "reject", name)] += 1
        if admitted:
            self.admitted[(tenant, lane)] += reserved
            self.lane_of[(tenant, rid)] = lane

    def admit(self, c: ProtoClient, tenant: str, rid: str, **kw: Any) -> pb.AdmitResponse:
        d = c.admit(tenant, rid, **kw)
        self.decided(tenant, rid, d.lane, d.decision, d.reason, d.reserved_tokens)
        return d

    def complete(self, c: ProtoClient, tenant: str, rid: str, prompt: int, out: int) -> None:
        s = c.complete(tenant, rid, prompt_tokens=prompt, generated_tokens=out)
        lane = self.lane_of[(tenant, rid)]
        self.settled[(tenant, lane)] += 1
        self.settled_tokens[(tenant, lane)] += prompt + out
        key = (tenant, lane, s.currency)
        self.charge[key] = self.charge.get(key, Decimal(0)) + Decimal(s.user_charge)
        self.cost[key] = self.cost.get(key, Decimal(0)) + Decimal(s.actual_cost)


def test_decisions_tokens_and_spend_by_tenant_and_lane(
    migrated_url: str, make_server: Callable[..., ServerThread]
) -> None:
    # acme is billed in USD (premium at 1.5x), everyone else in EUR; beta
    # takes at most 1,000 tokens a request.
    setup_db(migrated_url, "acme", "gamma", "delta", prices=(ACME_PRICE, DEFAULT_PRICE))
    add_tenants(migrated_url, tenant_config("beta", max_tokens_per_request=1000))
    srv = make_server(
        migrated_url, metrics_port=0, metrics_sample_s=0.05, metrics_tenant_label_limit=2
    )
    want = Expected()
    with ProtoClient(srv.target) as c:
        # acme: two in its default lane (standard), one in premium
        want.admit(c, "acme", "a1", prompt_tokens=100, max_tokens=50)
        want.admit(c, "acme", "a2", prompt_tokens=200, max_tokens=100)
        want.admit(c, "acme", "a3", prompt_tokens=100, max_tokens=50, lane="premium")
        # beta: one in batch; one too large for any bucket (refused MAX_TOKENS)
        want.admit(c, "beta", "b1", prompt_tokens=300, max_tokens=100, lane="batch")
        big = want.admit(c, "beta", "b2", prompt_tokens=2000, max_tokens=1, lane="batch")
        assert big.reason == pb.REASON_MAX_TOKENS
        # one AdmitStream batch: both tenants, both of their lanes (the batch path)
        tenants = ["acme", "beta", "acme", "beta"]
        lanes = ["standard", "standard", "premium", "batch"]
        rids = ["s1", "s2", "s3", "s4"]
        (r,) = c.admit_stream(
            [make_batch(1, tenants, rids, [10, 20, 30, 40], [5, 5, 5, 5], lanes=lanes)]
        )
        for i, (t, rid, lane) in enumerate(zip(tenants, rids, lanes, strict=True)):
            want.decided(t, rid, lane, r.decision[i], r.reason[i], r.reserved_tokens[i])
        assert list(r.decision) == [pb.DECISION_ADMIT] * 4
        for tenant, rid, prompt, out in [
            ("acme", "a1", 100, 40), ("acme", "a3", 100, 10), ("beta", "b1", 300, 100),
            ("acme", "s3", 30, 5), ("beta", "s2", 20, 1),
        ]:  # fmt: skip
            want.complete(c, tenant, rid, prompt, out)
        unknown = c.admit("nobody-xyz", "n1", prompt_tokens=1, max_tokens=1)
        assert unknown.reason == pb.REASON_UNKNOWN_TENANT

        m = scrape_until(srv, stream_ended, "the AdmitStream stream to be counted as handled")
        # Decisions by tenant, lane, decision and reason: exactly the answers.
        got = series(m, "burstgate_decisions_total", "tenant", "lane", "decision", "reason")
        unknown_key = ("__unknown__", "standard", "reject", "unknown_tenant")
        assert got.pop(unknown_key) == 1
        assert got == {k: float(n) for k, n in want.decisions.items()}
        assert len({(t, lane) for t, lane, _, _ in got}) == 4  # two tenants x two lanes
        # Tokens admitted (reserved) and settled, by tenant and lane.
        admitted = series(m, "burstgate_tenant_admitted_tokens_total", "tenant", "lane")
        assert admitted == {k: float(n) for k, n in want.admitted.items()}
        settled = series(m, "burstgate_tenant_settled_tokens_total", "tenant", "lane")
        assert settled == {k: float(n) for k, n in want.settled_tokens.items()}
        completes = series(m, "burstgate_tenant_settled_requests_total", "tenant", "lane")
        assert completes == {k: float(n) for k, n in want.settled.items()}
        # Money: the sums of the Complete replies, per tenant, lane and currency.
        charge = series(m, "burstgate_tenant_user_charge_total", "tenant", "lane", "currency")
        cost = series(m, "burstgate_tenant_actual_cost_total", "tenant", "lane", "currency")
        assert set(charge) == set(want.charge) == set(cost)
        assert {k[2] for k in charge} == {"USD", "EUR"}
        for key, total in want.charge.items():
            assert charge[key] == pytest.approx(float(total), rel=1e-12) and total > 0
            assert cost[key] == pytest.approx(float(want.cost[key]), rel=1e-12)
        # The client-chosen tenant id is nowhere in the exposition.
        assert not [k for k in m if "nobody-xyz" in str(k)]

        # Two more tenants, past the limit of two labels: counted as __other__.
        for tenant in ("gamma", "delta"):
            want.admit(c, tenant, "g1", prompt_tokens=10, max_tokens=10)
            want.admit(c, tenant, "g2", prompt_tokens=10, max_tokens=10, lane="batch")
        want.complete(c, "gamma", "g1", 10, 3)
        # gamma settled g1 (20 reserved); g2 and delta's two are open: 3 x 20
        m2 = scrape_until(
            srv,
            lambda m: (
                series(m, "burstgate_tenant_inflight_tokens", "tenant").get(("__other__",)) == 60
            ),
            "the sampler to publish __other__'s 60 in-flight tokens",
        )
    decisions = series(m2, "burstgate_decisions_total", "tenant", "lane", "decision", "reason")
    assert decisions[("__other__", "standard", "admit", "ok")] == 2
    assert decisions[("__other__", "batch", "admit", "ok")] == 2
    tenants_seen = {k[0] for k in decisions}
    assert tenants_seen == {"acme", "beta", "__other__", "__unknown__"}
    other_admitted = sum(n for (t, lane), n in want.admitted.items() if t in ("gamma", "delta"))
    admitted2 = series(m2, "burstgate_tenant_admitted_tokens_total", "tenant", "lane")
    assert admitted2[("__other__", "standard")] + admitted2[("__other__", "batch")] == (
        other_admitted
    )
    # acme's and beta's series did not move: a labelled tenant keeps its label
    for pair in want.admitted:
        if pair[0] in ("acme", "beta"):
            assert admitted2[pair] == admitted[pair]
    assert (
        series(m2, "burstgate_tenant_settled_tokens_total", "tenant", "lane")[
            ("__other__", "standard")
        ]
        == 13
    )
    eur = series(m2, "burstgate_tenant_user_charge_total", "tenant", "lane", "currency")
    assert eur[("__other__", "standard", "EUR")] == pytest.approx(
        float(want.charge[("gamma", "standard", "EUR")]), rel=1e-12
    )
    # The live gauges name the same tenants: acme and beta, the rest summed.
    inflight = series(m2, "burstgate_tenant_inflight_tokens", "tenant")
    assert set(inflight) == {("acme",), ("beta",), ("__other__",)}


def _method(kind: str, method: str, code: str) -> tuple[tuple[str, str], ...]:
    return tuple(
        sorted(
            {
                "grpc_type": kind, "grpc_service": ADMISSION, "grpc_method": method,
                "grpc_code": code,
            }.items()
        )
    )  # fmt: skip


def stream_ended(m: Samples) -> bool:
    return ("grpc_server_handled_total", _method("bidi_stream", "AdmitStream", "OK")) in m


def test_grpc_metrics_use_the_conventional_names_and_labels(
    sqlite_url: str, make_server: Callable[..., ServerThread]
) -> None:
    upgrade(sqlite_url)  # (the gRPC layer is the same whatever the database)
    setup_db(sqlite_url, "acme")
    srv = make_server(sqlite_url, metrics_port=0)
    with ProtoClient(srv.target) as c:
        for i in range(3):
            c.admit("acme", f"r{i}", prompt_tokens=10, max_tokens=10)
        c.complete("acme", "r0", prompt_tokens=10, generated_tokens=1)
        with pytest.raises(Exception) as err:  # never admitted: NOT_FOUND
            c.complete("acme", "nope", prompt_tokens=10, generated_tokens=1)
        assert "NOT_FOUND" in str(err.value)
        batches = [make_batch(i, ["acme"] * 2, [f"s{i}a", f"s{i}b"], [5, 5], [5, 5])
                   for i in range(4)]  # fmt: skip
        assert len(list(c.admit_stream(batches))) == 4

    m = scrape_until(srv, stream_ended, "the AdmitStream stream to be counted as handled")

    def of(name: str, kind: str, method: str) -> float:
        labels = {"grpc_type": kind, "grpc_service": ADMISSION, "grpc_method": method}
        return value(m, name, **labels)

    handled = "grpc_server_handled_total"
    assert value(m, handled, **dict(_method("unary", "Admit", "OK"))) == 3
    assert value(m, handled, **dict(_method("unary", "Complete", "OK"))) == 1
    assert value(m, handled, **dict(_method("unary", "Complete", "NotFound"))) == 1  # Go's spelling
    assert of("grpc_server_started_total", "unary", "Admit") == 3
    assert of("grpc_server_started_total", "unary", "Complete") == 2
    assert of("grpc_server_handling_seconds_count", "unary", "Admit") == 3
    assert of("grpc_server_handling_seconds_count", "unary", "Complete") == 2
    assert of("grpc_server_msg_received_total", "unary", "Complete") == 2
    assert of("grpc_server_msg_sent_total", "unary", "Complete") == 1  # the failed call sent none
    # One stream of four batches, each answered.
    assert value(m, handled, **dict(_method("bidi_stream", "AdmitStream", "OK"))) == 1
    assert of("grpc_server_started_total", "bidi_stream", "AdmitStream") == 1
    assert of("grpc_server_msg_received_total", "bidi_stream", "AdmitStream") == 4
    assert of("grpc_server_msg_sent_total", "bidi_stream", "AdmitStream") == 4
    assert of("grpc_server_handling_seconds_count", "bidi_stream", "AdmitStream") == 1
    buckets = sorted(
        (float(dict(labels)["le"]), v)
        for (name, labels), v in m.items()
        if name == "grpc_server_handling_seconds_bucket" and dict(labels)["grpc_method"] == "Admit"
    )
    assert buckets[-1] == (float("inf"), 3) and [v for _, v in buckets] == sorted(
        v for _, v in buckets
    )
    # The old, unconventional family is gone.
    assert not [k for k in m if k[0].startswith("burstgate_grpc_server")]
    # The standard process, platform and GC collectors are on the registry.
    assert value(m, "process_resident_memory_bytes") > 10 * 2**20
    assert value(m, "process_cpu_seconds_total") > 0
    assert value(m, "process_open_fds") > 0
    assert [k for k in m if k[0] == "python_info"]
    assert value(m, "python_gc_collections_total", generation="0") >= 0
    # The ledger's group commits as a histogram (the Complete above was one).
    assert value(m, "burstgate_ledger_batch_duration_seconds_count") >= 1
    assert value(m, "burstgate_ledger_batch_duration_seconds_bucket", le="+Inf") == value(
        m, "burstgate_ledger_batch_duration_seconds_count"
    )
    assert value(m, "burstgate_ledger_batch_duration_seconds_sum") > 0
    assert value(m, "burstgate_lane_wait_target_seconds", lane="premium") == 0.2
