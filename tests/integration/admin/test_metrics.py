"""/metrics scraped and parsed; values move as decisions are made."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable

import pytest
from burstgate_client._proto.burstgate.v1 import admin_pb2 as apb
from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb
from google.protobuf.field_mask_pb2 import FieldMask
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.admin.conftest import Env, code_of
from tests.support import wait_until

METRICS = {"metrics_port": 0, "metrics_sample_s": 0.05, "metrics_tenant_label_limit": 2}

# (sample name, sorted labels) -> value
Metrics = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(env: Env) -> Metrics:
    port = env.srv.plane.metrics_port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: Metrics = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(m: Metrics, name: str, **labels: str) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def buckets(m: Metrics, name: str, **labels: str) -> list[tuple[float, float]]:
    """A histogram's cumulative buckets as (upper bound, count), by bound."""
    want = sorted(labels.items())
    out = []
    for (sample, sample_labels), count in m.items():
        if sample != f"{name}_bucket":
            continue
        rest = dict(sample_labels)
        le = rest.pop("le")
        if sorted(rest.items()) == want:
            out.append((float(le), count))
    return sorted(out)


def wait_for(env: Env, check: Callable[[Metrics], bool], what: str) -> Metrics:
    """Scrape until ``check(metrics)`` holds (the sampler runs every 50 ms)."""

    def scraped() -> Metrics | None:
        m = scrape(env)
        return m if check(m) else None

    return wait_until(scraped, message=what, timeout=10)


@pytest.mark.parametrize("env", [METRICS], indirect=True)
def test_metrics_move_with_decisions(env: Env) -> None:
    m0 = scrape(env)
    assert value(m0, "burstgate_fastpath_info", implementation=env.srv.plane.service.implementation)
    assert value(m0, "burstgate_config_reloads_total") >= 1
    assert value(m0, "burstgate_config_reload_failures_total") == 0
    round_trips: list[float] = []  # client-side, around each Admit

    def timed_admit(tenant: str, rid: str, prompt: int) -> pb.AdmitResponse:
        t0 = time.perf_counter()
        try:
            return env.admit(tenant, rid, prompt=prompt)
        finally:
            round_trips.append(time.perf_counter() - t0)

    for i in range(5):
        assert timed_admit("acme", f"r{i}", 500).decision == pb.DECISION_ADMIT
    assert timed_admit("beta", "huge", 10_001).reason == pb.REASON_MAX_TOKENS  # > 2 bursts
    env.admission().Complete(
        pb.CompleteRequest(tenant_id="acme", request_id="r0", prompt_tokens=500)
    )
    env.admission().ReportLoad(
        pb.LoadReport(
            pool="a100", engine_id="e1", batch_tokens=900, max_batch_tokens=1000,
            queue_depth=50, queue_capacity=100, kv_cache_miss_rate=0.5, gpu_utilization=0.9,
        )
    )  # fmt: skip
    code_of(lambda: env.client("bgk_nope_nope").list_tenants())
    # Both in one sample: the sampler may run between the Complete and the ReportLoad.
    m = wait_for(
        env,
        lambda m: value(m, "burstgate_inflight_tokens") == 2000
        and value(m, "burstgate_pool_engines_reporting", pool="a100") == 1,
        "2,000 tokens in flight and the load report sampled",
    )
    decided = "burstgate_decisions_total"
    assert value(m, decided, tenant="acme", lane="standard", decision="admit", reason="ok") == 5
    assert (
        value(m, decided, tenant="beta", lane="standard", decision="reject", reason="max_tokens")
        == 1
    )
    assert value(m, "burstgate_decision_duration_seconds_count", method="Admit") == 6
    # The server times each decision inside the call, so every observation is
    # at most the round trip the client saw around it (same process, same
    # perf_counter clock): a bucket at or above the slowest round trip holds
    # all six, and the sum is positive but no more than the round trips' sum.
    # Seconds in the wrong unit, or a lost or double observation, break this.
    admit_buckets = buckets(m, "burstgate_decision_duration_seconds", method="Admit")
    bounds = [le for le, _ in admit_buckets]
    counts = [n for _, n in admit_buckets]
    assert bounds[-1] == float("inf") and len(bounds) > 1
    assert counts == sorted(counts) and counts[-1] == 6  # cumulative, ends at the count
    covering = next(n for le, n in admit_buckets if le >= max(round_trips))
    assert covering == 6, (admit_buckets, round_trips)
    total = value(m, "burstgate_decision_duration_seconds_sum", method="Admit")
    assert 0 < total <= sum(round_trips)
    handled = "grpc_server_handled_total"
    svc = {"grpc_type": "unary", "grpc_service": "burstgate.v1.AdmissionService"}
    assert value(m, handled, **svc, grpc_method="Admit", grpc_code="OK") == 6
    assert value(m, handled, **svc, grpc_method="Complete", grpc_code="OK") == 1
    assert value(m, "burstgate_auth_failures_total", reason="invalid") == 1
    assert value(m, "burstgate_inflight_requests") == 4
    assert value(m, "burstgate_tenants") == 2
    assert value(m, "burstgate_pool_engines_reporting", pool="a100") == 1
    assert 0.5 < value(m, "burstgate_pool_backpressure_score", pool="a100") <= 1
    assert value(m, "burstgate_pool_pricing_multiplier", pool="a100") == 1.0
    assert value(m, "burstgate_open_reservations") == 4
    # Per-tenant series while the tenant count is within the limit (2).
    assert value(m, "burstgate_tenant_inflight_tokens", tenant="acme") == 2000
    assert value(m, "burstgate_tenant_hourly_used_tokens", tenant="acme") == 2500
    # An admin change counts a reload and the admin RPC.
    env.admin.call(
        "UpdateTenant",
        apb.UpdateTenantRequest(
            tenant=apb.Tenant(tenant_id="acme", burst_tokens=20_000),
            update_mask=FieldMask(paths=["burst_tokens"]),
        ),
    )
    env.admin.call(
        "CreateTenant",
        apb.CreateTenantRequest(
            tenant=apb.Tenant(tenant_id="gamma", token_rate="1", burst_tokens=1)
        ),
    )
    m2 = wait_for(env, lambda m: value(m, "burstgate_tenants") == 3, "3 tenants")
    assert (
        value(m2, "burstgate_config_reloads_total")
        == value(m, "burstgate_config_reloads_total") + 2
    )
    adm = {"grpc_type": "unary", "grpc_service": "burstgate.v1.AdminService"}
    assert value(m2, handled, **adm, grpc_method="UpdateTenant", grpc_code="OK") == 1
    assert value(m2, handled, **adm, grpc_method="ListTenants", grpc_code="Unauthenticated") == 1
    # Three tenants > the limit of 2: acme and beta keep the label they had,
    # gamma's state is counted under __other__.
    tenants = {dict(k[1]).get("tenant") for k in m2 if k[0] == "burstgate_tenant_inflight_tokens"}
    assert tenants == {"acme", "beta", "__other__"}
    assert value(m2, "burstgate_tenant_inflight_tokens", tenant="__other__") == 0


@pytest.mark.parametrize("env", [METRICS], indirect=True)
def test_gc_pauses_are_a_histogram_per_generation(env: Env) -> None:
    import gc

    before = value(scrape(env), "burstgate_gc_pause_seconds_count", generation="2")
    env.srv.on_loop(gc.collect)  # a full collection while serving
    m = scrape(env)
    assert value(m, "burstgate_gc_pause_seconds_count", generation="2") >= before + 1
    assert value(m, "burstgate_gc_pause_seconds_sum", generation="2") > 0
    counts = [c for _, c in buckets(m, "burstgate_gc_pause_seconds", generation="2")]
    assert counts == sorted(counts) and counts[-1] >= 1  # cumulative, +Inf last
    assert env.srv.plane.gc_pauses.longest_s > 0
