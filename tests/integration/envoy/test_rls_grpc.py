"""ShouldRateLimit over real gRPC, with the request shapes a real Envoy 1.40
sent (fixtures/*.txtpb, captured by test_envoy_gateway.py): the cases an
Envoy run does not reach on demand - repeated calls, check-only, usage with
no reservation, bad input, callers without a key."""

from __future__ import annotations

import functools
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import text_format

from controlplane._proto.envoy.service.ratelimit.v3 import rls_pb2 as rls
from controlplane._proto.envoy.service.ratelimit.v3 import rls_pb2_grpc as rls_grpc
from tests.integration.envoy.conftest import Gateway
from tests.integration.ledger.conftest import ledger_rows
from tests.support import wait_until

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

FIXTURES = Path(__file__).with_name("fixtures")
OK, OVER = rls.RateLimitResponse.OK, rls.RateLimitResponse.OVER_LIMIT


def shape(name: str, tenant: str, rid: str) -> rls.RateLimitRequest:
    """The captured request with this tenant and request id."""
    req = text_format.Parse((FIXTURES / f"envoy-1.40-{name}.txtpb").read_text(),
                            rls.RateLimitRequest())  # fmt: skip
    for e in req.descriptors[0].entries:
        if e.key == "tenant":
            e.value = tenant
        elif e.key == "request_id":
            e.value = rid
    return req


def usage(req: rls.RateLimitRequest, prompt: int, completion: int) -> rls.RateLimitRequest:
    d = req.descriptors[0]
    for e in d.entries:
        if e.key == "prompt_tokens":
            e.value = str(prompt)
        elif e.key == "completion_tokens":
            e.value = str(completion)
    d.hits_addend.value = prompt + completion
    return req


def headers(resp: rls.RateLimitResponse) -> dict[str, str]:
    return {h.key: h.value for h in resp.response_headers_to_add}


@pytest.fixture(scope="module")
def channel(gateway: Gateway) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(gateway.plane.direct) as ch:
        yield ch


@pytest.fixture
def rls_call(gateway: Gateway, channel: grpc.Channel) -> rls_grpc.RateLimitServiceStub:
    return rls_grpc.RateLimitServiceStub(channel)


def call(stub: rls_grpc.RateLimitServiceStub, key: str, req: rls.RateLimitRequest,
         ) -> rls.RateLimitResponse:  # fmt: skip
    out: rls.RateLimitResponse = stub.ShouldRateLimit(
        req, metadata=[("authorization", f"Bearer {key}")], timeout=10
    )
    return out


def test_reserve_repeat_settle_repeat(gateway: Gateway, rls_call: rls_grpc.RateLimitServiceStub,
                                      ) -> None:  # fmt: skip
    rid = uuid.uuid4().hex
    first = call(rls_call, gateway.key, shape("request-path", "acme", rid))
    assert first.overall_code == OK
    s = first.statuses[0]
    assert (s.code, s.current_limit.name, s.current_limit.unit) == (
        OK, "token_bucket", rls.RateLimitResponse.RateLimit.SECOND,
    )  # fmt: skip
    assert s.current_limit.requests_per_unit == 1_000  # acme's refill rate
    again = call(rls_call, gateway.key, shape("request-path", "acme", rid))
    assert again.overall_code == OK  # the same admission, not a second one
    svc = gateway.plane.srv.plane.service  # type: ignore[union-attr]
    assert svc.views.record("acme", rid) is not None
    done = usage(shape("stream-done", "acme", rid), 30, 70)
    assert call(rls_call, gateway.key, done).overall_code == OK
    assert call(rls_call, gateway.key, done).overall_code == OK  # duplicate
    rows = ledger_rows(gateway.url, f"request_id = '{rid}'")
    assert [(r.reserved_tokens, r.prompt_tokens, r.output_tokens) for r in rows] == [(1024, 30, 70)]
    # a settled id on the request path again: a new request under an old id
    reused = call(rls_call, gateway.key, shape("request-path", "acme", rid))
    assert reused.overall_code == OVER
    assert "already settled" in headers(reused)["x-burstgate-error"]


def test_usage_without_a_reservation_is_charged_once(
    gateway: Gateway, rls_call: rls_grpc.RateLimitServiceStub
) -> None:
    rid = uuid.uuid4().hex
    done = usage(shape("stream-done", "acme", rid), 5, 40)
    for _ in range(2):
        assert call(rls_call, gateway.key, done).overall_code == OK
    rows = wait_until(lambda: ledger_rows(gateway.url, f"request_id = '{rid}'"),
                      message="the booked row")  # fmt: skip
    assert [(r.prompt_tokens, r.output_tokens) for r in rows] == [(5, 40)]
    # no usage (a refused request's stream-done call): nothing booked
    nothing = usage(shape("stream-done", "acme", "never-ran"), 0, 0)
    assert call(rls_call, gateway.key, nothing).overall_code == OK
    assert ledger_rows(gateway.url, "request_id = 'never-ran'") == []


def test_hits_addend_zero_checks_without_spending(
    gateway: Gateway, rls_call: rls_grpc.RateLimitServiceStub
) -> None:
    req = shape("request-path", "tiny", uuid.uuid4().hex)
    req.descriptors[0].hits_addend.value = 0  # HasField: set, to zero
    svc = gateway.plane.srv.plane.service  # type: ignore[union-attr]
    before = svc.views.tenant_limits("tiny").bucket_tokens
    resp = call(rls_call, gateway.key, req)
    after = svc.views.tenant_limits("tiny").bucket_tokens
    assert after >= before  # nothing spent (the bucket only refills)
    assert resp.overall_code == (OK if before > 0 else OVER)
    assert headers(resp)["x-ratelimit-limit"] == "1500"


def test_bad_input_is_refused_and_named(gateway: Gateway, rls_call: rls_grpc.RateLimitServiceStub,
                                        ) -> None:  # fmt: skip
    req = shape("request-path", "acme", uuid.uuid4().hex)
    req.descriptors[0].entries.add(key="lane", value="no-such-lane")
    resp = call(rls_call, gateway.key, req)
    assert resp.overall_code == OVER
    assert "no-such-lane" in headers(resp)["x-burstgate-error"]
    other = shape("request-path", "acme", "x")
    other.domain = "somebody-else"
    assert "domain" in headers(call(rls_call, gateway.key, other))["x-burstgate-error"]


def test_a_caller_without_a_sidecar_key_is_unauthenticated(
    gateway: Gateway, rls_call: rls_grpc.RateLimitServiceStub
) -> None:
    req = shape("request-path", "acme", uuid.uuid4().hex)
    with pytest.raises(grpc.RpcError) as err:
        rls_call.ShouldRateLimit(req, timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_bad_mapping_file_fails_the_start(sqlite_url: str, tmp_path: Path) -> None:
    import asyncio

    from controlplane.server import ControlPlane
    from controlplane.settings import Settings
    from controlplane.startup.errors import StartupError
    from controlplane.store.db import upgrade

    upgrade(sqlite_url)
    bad = tmp_path / "envoy.yaml"
    bad.write_text("defaults: {estimate_tokens: 0}\n")
    settings = Settings(database_url=sqlite_url, port=0, metrics_port=-1, envoy_rls_config=bad,
                        ledger_spool_dir=tmp_path / "spool")  # fmt: skip

    async def start() -> None:
        await ControlPlane(settings).start()

    with pytest.raises(StartupError) as err:
        asyncio.run(start())
    assert err.value.code == 2
    assert "defaults.estimate_tokens" in err.value.line


def test_the_response_path_is_scoped_like_the_request_path(
    gateway: Gateway, rls_call: rls_grpc.RateLimitServiceStub
) -> None:
    """A key scoped to tiny cannot settle (or book) acme's usage: every
    ShouldRateLimit call is checked against the key's tenants, as Admit is."""
    from controlplane.domain.audit import Actor
    from controlplane.domain.keys import Role
    from controlplane.store.db import make_engine
    from controlplane.store.keys import KeyStore

    engine = make_engine(gateway.url)
    try:
        tiny_only, _ = KeyStore(engine).create_key(
            "tiny-only", Role.SIDECAR, Actor("local:test", "local"), tenants=["tiny"], pools=["*"]
        )
    finally:
        engine.dispose()
    rid = uuid.uuid4().hex
    assert call(rls_call, gateway.key, shape("request-path", "acme", rid)).overall_code == OK

    def key_known() -> bool:  # the server's key cache learns a new key soon, not at once
        probe = shape("request-path", "tiny", uuid.uuid4().hex)
        probe.descriptors[0].hits_addend.value = 0  # a check: spends nothing of tiny's
        try:
            call(rls_call, tiny_only, probe)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                return False
            raise
        return True

    wait_until(key_known, message="the new key in the server's cache")
    for phase in ("stream-done", "request-path"):
        resp = call(rls_call, tiny_only, usage(shape(phase, "acme", rid), 10, 990))
        assert resp.overall_code == OVER
        assert headers(resp)["x-burstgate-error"].startswith("tenant_id: ")
    # acme's reservation is still open: settled only by a key that covers acme
    srv = gateway.plane.srv
    assert srv is not None
    rec = srv.on_loop(lambda: srv.plane.service.views.record("acme", rid))
    assert rec is not None and rec.state == 0  # R.OPEN
    done = call(rls_call, gateway.key, usage(shape("stream-done", "acme", rid), 10, 5))
    assert done.overall_code == OK
    row = wait_until(lambda: ledger_rows(gateway.url, f"request_id = '{rid}'") or None,
                     message="acme's row")  # fmt: skip
    assert [(r.tenant_id, r.output_tokens) for r in row] == [("acme", 5)]


def said(req: rls.RateLimitRequest, what: str) -> rls.RateLimitRequest:
    """The stream-done call with the Lua filter's ``usage`` entry set to ``what``."""
    (entry,) = [e for e in req.descriptors[0].entries if e.key == "usage"]
    entry.value = what
    return req


def test_an_answer_without_usage_is_settled_at_its_reservation(
    gateway: Gateway, rls_call: rls_grpc.RateLimitServiceStub
) -> None:
    """The Lua filter says ``usage: missing`` for a successful answer that
    carried no usage (an engine that ignores include_usage): billed its
    reservation (or the chunks counted, when more), never zero."""
    for counted, billed in ((0, 1024), (2000, 2000)):
        rid = uuid.uuid4().hex
        assert call(rls_call, gateway.key, shape("request-path", "acme", rid)).overall_code == OK
        done = said(usage(shape("stream-done", "acme", rid), 0, counted), "missing")
        assert call(rls_call, gateway.key, done).overall_code == OK
        where = f"request_id = '{rid}'"
        rows = wait_until(lambda: ledger_rows(gateway.url, where) or None,  # noqa: B023
                          message="the row")  # fmt: skip
        assert [(r.reserved_tokens, r.output_tokens) for r in rows] == [(1024, billed)]
    bad = said(usage(shape("stream-done", "acme", uuid.uuid4().hex), 0, 1), "lost")
    assert headers(call(rls_call, gateway.key, bad))["x-burstgate-error"].startswith("usage: ")


def test_an_id_settled_past_the_window_is_admitted_again_and_billed(
    pg_admin_dsn: str, tmp_path: Path
) -> None:
    """Issue 30 item 4: once the plane has forgotten a settled id
    (settled_id_window_s, here 0), a request-path call with it is a new
    admission; its stream-done call was answered as a duplicate of the first
    row and never billed. Now it is booked under ``<id>#<reservation>``."""
    from controlplane.store.db import upgrade
    from tests.conftest import fresh_pg_database
    from tests.integration.envoy.conftest import DEPLOY, TENANTS, sidecar_key
    from tests.integration.sdk.conftest import planes_on

    # a plane of its own (another on the gateway's database would be its
    # replica), which forgets a settled id at its next expiry
    for url in fresh_pg_database(pg_admin_dsn):
        upgrade(url)
        key = sidecar_key(url)
        for make in planes_on(url, tmp_path):
            plane = make(*TENANTS, admission_auth=True, settled_id_window_s=0,
                         envoy_rls_config=DEPLOY / "burstgate-envoy.yaml")  # fmt: skip
            srv = plane.srv
            assert srv is not None
            with grpc.insecure_channel(plane.direct) as ch:
                stub = rls_grpc.RateLimitServiceStub(ch)
                rid, rids = uuid.uuid4().hex, []
                record = functools.partial(srv.plane.service.views.record, "acme", rid)
                for prompt, completion in ((30, 70), (20, 500)):
                    srv.on_loop(srv.plane.expire_once)  # the settled id is forgotten
                    assert srv.on_loop(record) is None
                    got = call(stub, key, shape("request-path", "acme", rid))
                    assert got.overall_code == OK
                    rec = srv.on_loop(record)
                    assert rec is not None and rec.state == 0  # open: admitted anew, not replayed
                    rids.append(rec.rid)
                    done = usage(shape("stream-done", "acme", rid), prompt, completion)
                    assert call(stub, key, done).overall_code == OK
                    assert call(stub, key, done).overall_code == OK  # repeated: once
        rows = ledger_rows(url, f"request_id LIKE '{rid}%'")
        assert [(r.request_id, r.reservation_id, r.prompt_tokens, r.output_tokens)
                for r in rows] == [(rid, rids[0], 30, 70),
                                   (f"{rid}#{rids[1]}", rids[1], 20, 500)]  # fmt: skip
