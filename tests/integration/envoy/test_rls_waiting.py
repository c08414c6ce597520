"""ShouldRateLimit with ``max_wait_ms`` > 0 (docs/envoy.md, "Descriptor
mapping"): a request-path call the tenant cannot take now waits in
burstgate's queue, and is answered OK when a settlement makes room, or
OVER_LIMIT when its wait (the mapping's bound, or the call's own deadline,
whichever is first) runs out; a waiting call spends nothing."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from controlplane._proto.envoy.service.ratelimit.v3 import rls_pb2 as rls
from controlplane._proto.envoy.service.ratelimit.v3 import rls_pb2_grpc as rls_grpc
from tests.integration.sdk.conftest import Plane, planes_on, tenant
from tests.support import wait_until

pytestmark = pytest.mark.slow

OK, OVER = rls.RateLimitResponse.OK, rls.RateLimitResponse.OVER_LIMIT
MAPPING = """\
domain: burstgate
descriptors: {tenant: tenant, request_id: request_id, phase: phase}
defaults: {estimate_tokens: 100}
max_wait_ms: 30000
"""


@pytest.fixture
def plane(migrated_url: str, tmp_path: Path) -> Iterator[Plane]:
    mapping = tmp_path / "burstgate-envoy.yaml"
    mapping.write_text(MAPPING)
    for make in planes_on(migrated_url, tmp_path):
        # one request at a time: the second waits for the first's settlement
        yield make(tenant("one", max_concurrency=1, max_wait_ms=60_000, max_queued=10),
                   envoy_rls_config=mapping)  # fmt: skip


def ask(rid: str, *, response: bool = False, tokens: int = 0) -> rls.RateLimitRequest:
    req = rls.RateLimitRequest(domain="burstgate")
    d = req.descriptors.add()
    d.entries.add(key="tenant", value="one")
    d.entries.add(key="request_id", value=rid)
    if response:
        d.entries.add(key="phase", value="response")
        d.hits_addend.value = tokens
    return req


def waiting(plane: Plane) -> int:
    srv = plane.srv
    assert srv is not None
    n: int = srv.on_loop(lambda: srv.plane.service.waiting)
    return n


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    return t, out


def test_a_held_call_is_answered_when_a_settlement_makes_room(plane: Plane) -> None:
    with grpc.insecure_channel(plane.direct) as ch:
        stub = rls_grpc.RateLimitServiceStub(ch)
        assert stub.ShouldRateLimit(ask("a"), timeout=10).overall_code == OK
        t, out = in_thread(lambda: stub.ShouldRateLimit(ask("b"), timeout=20))
        wait_until(lambda: waiting(plane) == 1, message="the server to hold b")
        assert t.is_alive() and not out
        # a's stream-done call settles it: b takes its place
        assert stub.ShouldRateLimit(ask("a", response=True, tokens=30), timeout=10
                                    ).overall_code == OK  # fmt: skip
        t.join(timeout=20)
        assert [r.overall_code for r in out] == [OK]
        assert waiting(plane) == 0


def test_a_held_call_past_its_deadline_is_over_limit_and_leaves_the_queue(plane: Plane) -> None:
    with grpc.insecure_channel(plane.direct) as ch:
        stub = rls_grpc.RateLimitServiceStub(ch)
        assert stub.ShouldRateLimit(ask("a"), timeout=10).overall_code == OK
        # Envoy's call timeout (here 0.5 s) bounds the wait before the mapping's 30 s:
        # burstgate answers 50 ms inside it (ANSWER_MARGIN_S), so Envoy gets an answer
        late = stub.ShouldRateLimit(ask("b"), timeout=0.5)
        assert late.overall_code == OVER
        headers = {h.key: h.value for h in late.response_headers_to_add}
        assert "retry-after" in headers
        wait_until(lambda: waiting(plane) == 0, message="b to leave the queue")
        # nothing was reserved for b: once a is settled, c is admitted at once
        assert stub.ShouldRateLimit(ask("a", response=True, tokens=30), timeout=10
                                    ).overall_code == OK  # fmt: skip
        assert stub.ShouldRateLimit(ask("c"), timeout=10).overall_code == OK
