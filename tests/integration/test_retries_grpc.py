"""Retries and first tokens over gRPC (docs/gate.md): a retry under its
retry key is judged against its first attempt's deadline on Admit and on
AdmitStream; the new fields are validated at the edge; Complete takes the
first token's time. A real server on a free port, SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from decimal import Decimal
from typing import Any

import grpc
import pytest
from burstgate_client.protoclient import ProtoClient, pb

from controlplane.domain import TenantConfig
from tests.support import add_tenants

MS = 1_000_000


@pytest.fixture
def served(migrated_url: str, make_server: Callable[..., Any], clock: Any) -> Iterator[Any]:
    # max_wait_ms 0: refusals come at once, nothing waits on the fake clock
    add_tenants(
        migrated_url,
        TenantConfig(tenant_id="acme", token_rate=Decimal(1000), burst_tokens=1000,
                     max_wait_ms=0),
    )  # fmt: skip
    srv = make_server(migrated_url, clock=clock)
    with ProtoClient(srv.target) as c:
        yield srv, c


def admit(c: ProtoClient, rid: str, key: str, attempt: int, prompt: int) -> pb.AdmitResponse:
    resp: pb.AdmitResponse = c.stub.Admit(
        pb.AdmitRequest(tenant_id="acme", request_id=rid, prompt_tokens=prompt, retry_key=key,
                        attempt=attempt), timeout=5,
    )  # fmt: skip
    return resp


def test_a_retry_past_its_first_deadline_is_refused_even_with_room(
    served: Any, clock: Any
) -> None:
    _, c = served
    assert admit(c, "all", "", 0, 1000).decision == pb.DECISION_ADMIT
    first = admit(c, "k.0", "k", 0, 500)  # the bucket is empty: refused
    assert first.reason == pb.REASON_TOKEN_RATE and first.retryable  # 0.5 s: in time
    clock.advance(2_300 * MS)  # the bucket refilled; past the standard lane's 2.25 s
    retry = admit(c, "k.1", "k", 1, 500)
    assert (retry.reason, retry.retryable) == (pb.REASON_BACKPRESSURE, False)
    # a first attempt under the same key is a new request: admitted
    assert admit(c, "k2.0", "k", 0, 500).decision == pb.DECISION_ADMIT


def test_a_batch_judges_its_keyed_retries_alike(served: Any, clock: Any) -> None:
    _, c = served
    batch = pb.AdmitBatch(batch_id=1, tenant_id=["acme"] * 2, request_id=["all", "b.0"],
                          prompt_tokens=[1000, 500], max_tokens=[0, 0], retry_key=["", "b"],
                          attempt=[0, 0])  # fmt: skip
    (r,) = c.admit_stream([batch])
    assert list(r.reason) == [pb.REASON_UNSPECIFIED, pb.REASON_TOKEN_RATE]
    clock.advance(2_300 * MS)
    batch = pb.AdmitBatch(batch_id=2, tenant_id=["acme"] * 2, request_id=["b.1", "fresh"],
                          prompt_tokens=[500, 500], max_tokens=[0, 0], retry_key=["b", ""],
                          attempt=[1, 0])  # fmt: skip
    (r,) = c.admit_stream([batch])
    assert list(r.reason) == [pb.REASON_BACKPRESSURE, pb.REASON_UNSPECIFIED]
    assert list(r.retryable) == [False, False]  # (an admission is not retryable either)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"attempt": 1_001}, "attempt"),
        ({"retry_key": "k" * 129}, "retry_key"),
        ({"retry_key": "a\nb"}, "retry_key"),
    ],
)
def test_bad_retry_fields_are_invalid_argument_naming_them(
    served: Any, fields: dict[str, Any], named: str
) -> None:
    srv, c = served
    before = srv.on_loop(lambda: srv.plane.service.views.tenant_state("acme"))
    with pytest.raises(grpc.RpcError) as err:
        c.stub.Admit(pb.AdmitRequest(tenant_id="acme", request_id="r", prompt_tokens=1,
                                     **fields), timeout=5)  # fmt: skip
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(named)
    assert srv.on_loop(lambda: srv.plane.service.views.tenant_state("acme")) == before
    batch = pb.AdmitBatch(batch_id=1, tenant_id=["acme"] * 2, request_id=["a", "b"],
                          prompt_tokens=[1, 1], max_tokens=[0, 0], retry_key=["k"])  # fmt: skip
    with pytest.raises(grpc.RpcError) as err:
        list(c.admit_stream([batch]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("batch 1: retry_key")


def test_complete_takes_the_first_tokens_time_in_its_window(served: Any, clock: Any) -> None:
    _, c = served
    assert admit(c, "a", "", 0, 10).decision == pb.DECISION_ADMIT
    now = clock()
    for first, named in ((now - 10**18, "first_token_unix_ns"), (now + 5 * MS, "first_token")):
        req = pb.CompleteRequest(tenant_id="acme", request_id="a", prompt_tokens=10,
                                 generated_tokens=1, exec_start_unix_ns=now + 10 * MS,
                                 first_token_unix_ns=first)  # fmt: skip
        with pytest.raises(grpc.RpcError) as err:
            c.stub.Complete(req, timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith(named)
    clock.advance(50 * MS)
    done = c.stub.Complete(pb.CompleteRequest(
        tenant_id="acme", request_id="a", prompt_tokens=10, generated_tokens=1,
        exec_start_unix_ns=now, first_token_unix_ns=now + 30 * MS,
        exec_end_unix_ns=now + 40 * MS), timeout=5)  # fmt: skip
    assert done.actual_tokens == 11 and not done.duplicate


# ------------------------------------------------------------ Envoy's RLS door

ENVOY_MAPPING = "domain: burstgate\ndefaults: {estimate_tokens: 500}\n"


def rls_ask(rid: str, key: str, attempt: str) -> Any:
    from controlplane._proto.envoy.service.ratelimit.v3 import rls_pb2 as rls

    req = rls.RateLimitRequest(domain="burstgate")
    d = req.descriptors.add()
    d.entries.add(key="tenant", value="acme")
    d.entries.add(key="request_id", value=rid)
    if key:
        d.entries.add(key="retry_key", value=key)
    if attempt:
        d.entries.add(key="attempt", value=attempt)
    return req


def test_envoy_rls_judges_a_retry_by_its_key_and_attempt(
    migrated_url: str, make_server: Callable[..., Any], clock: Any, tmp_path: Any
) -> None:
    from controlplane._proto.envoy.service.ratelimit.v3 import rls_pb2 as rls
    from controlplane._proto.envoy.service.ratelimit.v3 import rls_pb2_grpc as rls_grpc

    mapping = tmp_path / "burstgate-envoy.yaml"
    mapping.write_text(ENVOY_MAPPING)
    add_tenants(
        migrated_url,
        TenantConfig(tenant_id="acme", token_rate=Decimal(1000), burst_tokens=1000,
                     max_wait_ms=0),
    )  # fmt: skip
    srv = make_server(migrated_url, clock=clock, envoy_rls_config=mapping)
    over = rls.RateLimitResponse.OVER_LIMIT
    with grpc.insecure_channel(srv.target) as ch:
        stub = rls_grpc.RateLimitServiceStub(ch)

        def ask(rid: str, key: str = "", attempt: str = "") -> tuple[int, dict[str, str]]:
            r = stub.ShouldRateLimit(rls_ask(rid, key, attempt), timeout=5)
            return r.overall_code, {h.key: h.value for h in r.response_headers_to_add}

        assert ask("all")[0] == rls.RateLimitResponse.OK  # 500 of the 1,000-token bucket
        assert ask("all2")[0] == rls.RateLimitResponse.OK  # the bucket is empty now
        code, h = ask("k.0", "idem-1", "0")  # refused by the bucket: 0.5 s, in time
        assert (code, h["x-burstgate-reason"], h["x-should-retry"]) == (over, "token_rate", "true")
        clock.advance(2_300 * MS)  # the bucket refilled; past the standard lane's 2.25 s
        code, h = ask("k.1", "idem-1", "1")
        assert (code, h["x-burstgate-reason"], h["x-should-retry"]) == (
            over, "backpressure", "false"
        )
        # the same id as a first attempt of its own key: admitted
        assert ask("k2.0", "idem-2", "0")[0] == rls.RateLimitResponse.OK
        # a bad attempt count is named, and spends nothing
        before = srv.on_loop(lambda: srv.plane.service.views.tenant_state("acme"))
        code, h = ask("k.2", "idem-1", "many")
        assert code == over and h["x-burstgate-error"].startswith("attempt:")
        assert srv.on_loop(lambda: srv.plane.service.views.tenant_state("acme")) == before
