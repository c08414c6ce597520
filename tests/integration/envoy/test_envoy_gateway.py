"""End to end: an HTTP client -> a real Envoy 1.40 (deploy/envoy/envoy.yaml)
-> the fake engine, with burstgate's ShouldRateLimit deciding on the
request path and settling on the stream-done call; the ledger on
PostgreSQL against the engine's own usage."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import text_format

from controlplane._proto.envoy.service.ratelimit.v3 import rls_pb2 as rls
from controlplane.integrations.envoy import servicer as servicer_module
from tests.integration.envoy.conftest import MODEL, Gateway
from tests.integration.ledger.conftest import ledger_rows
from tests.support import wait_until

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

FIXTURES = Path(__file__).with_name("fixtures")


def chat(base: str, tenant: str | None, rid: str | None = None, *, stream: bool = False,
         max_tokens: int = 8, prompt_tokens: int | None = None, include_usage: bool = True,
         ) -> tuple[int, dict[str, str], str]:  # fmt: skip
    body: dict[str, Any] = {
        "model": MODEL, "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "Hello there, how are you?"}],
    }  # fmt: skip
    if stream:
        body |= {"stream": True}
        if include_usage:
            body["stream_options"] = {"include_usage": True}
    headers = {"content-type": "application/json"}
    if tenant is not None:
        headers["x-tenant"] = tenant
    if rid is not None:
        headers["x-request-id"] = rid
    if prompt_tokens is not None:  # the fake engine's prompt size
        headers["x-burstgate-prompt-tokens"] = str(prompt_tokens)
    req = urllib.request.Request(base + "/v1/chat/completions", json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read().decode()


def usage_of(status: int, body: str, stream: bool) -> dict[str, int]:
    assert status == 200, body
    if not stream:
        u: dict[str, int] = json.loads(body)["usage"]
        return u
    chunks = [json.loads(line[6:]) for line in body.splitlines()
              if line.startswith("data: {")]  # fmt: skip
    last: dict[str, int] = chunks[-1]["usage"]
    return last


def row(url: str, tenant: str, rid: str) -> Any:
    rows = ledger_rows(url, f"tenant_id = '{tenant}' AND request_id = '{rid}'")
    return rows[0] if rows else None


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[rls.RateLimitRequest]]:
    """Every RateLimitRequest the plane's servicer parses (it runs in this
    process): the exact shapes a real Envoy sends."""
    seen: list[rls.RateLimitRequest] = []
    parse = servicer_module.parse  # type: ignore[attr-defined]

    def recording(request: rls.RateLimitRequest, cfg: Any) -> Any:
        copy = rls.RateLimitRequest()
        copy.CopyFrom(request)
        seen.append(copy)
        return parse(request, cfg)

    monkeypatch.setattr(servicer_module, "parse", recording)
    yield seen


@pytest.mark.parametrize(("stream", "include_usage"), [(False, True), (True, True), (True, False)],
                         ids=["whole", "streamed", "streamed-without-asking-for-usage"])
def test_admitted_then_settled_with_the_engines_usage(
    gateway: Gateway, stream: bool, include_usage: bool
) -> None:
    """A stream whose client did not ask for its usage (the openai SDK's
    default) is made to: the Lua filter adds stream_options.include_usage,
    so it is billed what it used, not nothing."""
    chosen = uuid.uuid4().hex  # the client's x-request-id: not what the ledger is keyed on
    status, headers, body = chat(gateway.base(), "acme", chosen, stream=stream, max_tokens=12,
                                 include_usage=include_usage)  # fmt: skip
    usage = usage_of(status, body, stream)
    # use_remote_address: Envoy replaced the external client's id with its
    # own, and says it in the answer (always_set_request_id_in_response)
    rid = headers["x-request-id"]
    assert rid != chosen
    # the request path's answer, as headers on the client's response
    assert headers["x-ratelimit-limit"] == "100000000"  # acme's bucket (refills at 1,000/s)
    assert int(headers["x-ratelimit-remaining"]) < 100_000_000
    rec = wait_until(lambda: row(gateway.url, "acme", rid), message="the ledger row")
    assert row(gateway.url, "acme", chosen) is None
    # reserved the configured estimate, settled with what the engine reported
    assert (rec.reserved_tokens, rec.prompt_tokens, rec.output_tokens) == (
        1024, usage["prompt_tokens"], usage["completion_tokens"],
    )  # fmt: skip


def test_over_limit_is_429_with_rate_limit_headers(gateway: Gateway) -> None:
    # tiny-1 reserves 1,024 of tiny's 1,500 and uses 608 (600 + 8): whether
    # it is settled yet or not, fewer than 1,024 are left for tiny-2
    first, first_headers, body = chat(gateway.base(), "tiny", "tiny-1", prompt_tokens=600)
    assert first == 200, body
    status, headers, refusal = chat(gateway.base(), "tiny", "tiny-2")
    assert status == 429
    assert headers["x-envoy-ratelimited"] == "true"
    assert headers["x-burstgate-reason"] == "token_rate"
    assert headers["x-ratelimit-limit"] == "1500"  # the bucket's size
    left = int(headers["x-ratelimit-remaining"])
    assert 476 <= left <= 1500 - 608
    retry = int(headers["retry-after"])
    assert 1024 - left - 1 <= retry <= 1024 - left  # a token a second refills the rest
    assert headers["x-ratelimit-reset"] == headers["retry-after"]
    # a body the openai client shows: why, and when to come back
    error = json.loads(refusal)["error"]
    assert (error["type"], error["code"]) == ("rate_limit_error", "token_rate")
    assert f"retry after {retry} s" in error["message"]
    wait_until(lambda: row(gateway.url, "tiny", first_headers["x-request-id"]),
               message="tiny-1 settled")  # fmt: skip
    # refused: never ran, never billed
    assert row(gateway.url, "tiny", headers["x-request-id"]) is None


def test_requests_burstgate_cannot_decide_are_refused(gateway: Gateway) -> None:
    status, headers, body = chat(gateway.base(), None)  # no x-tenant header
    assert status == 400  # the client's mistake, said in the OpenAI error shape
    error = json.loads(body)["error"]
    assert (error["param"], error["code"], error["type"]) == (
        "x-tenant", "no_tenant", "invalid_request_error")
    assert "no x-tenant header" in error["message"]
    status, headers, body = chat(gateway.base(), "outsider")  # outside the key's scope
    assert status == 429
    assert "outsider" in headers["x-burstgate-error"]
    assert "outsider" in json.loads(body)["error"]["message"]


def test_the_exact_requests_envoy_sends(
    gateway: Gateway, captured: list[rls.RateLimitRequest]
) -> None:
    """The request path and the stream-done call of one request, as Envoy
    1.40 sends them (fixtures/*.txtpb; BURSTGATE_RECAPTURE=1 rewrites them)."""
    status, headers, body = chat(gateway.base(), "acme", "client-chosen-id")
    usage = usage_of(status, body, False)
    rid = headers["x-request-id"]  # Envoy's own (use_remote_address)

    def ours() -> list[rls.RateLimitRequest]:  # (a late call of an earlier test may be there)
        return [r for r in captured if any(e.value == rid for e in r.descriptors[0].entries)]

    wait_until(lambda: len(ours()) >= 2, message="both calls")
    request_path, stream_done = ours()
    assert usage["total_tokens"] == stream_done.descriptors[0].hits_addend.value
    for name, msg in (("request-path", request_path), ("stream-done", stream_done)):
        for e in msg.descriptors[0].entries:  # Envoy's id differs per request
            if e.key == "request_id":
                e.value = "captured-request-id"
        path = FIXTURES / f"envoy-1.40-{name}.txtpb"
        text = text_format.MessageToString(msg)
        if os.environ.get("BURSTGATE_RECAPTURE"):
            path.write_text(text)
        assert text == path.read_text(), f"{name}: Envoy sent another shape"


def test_failure_mode_deny_when_burstgate_is_unreachable(gateway: Gateway) -> None:
    proxy = gateway.plane.proxy
    assert proxy is not None
    proxy.cut()
    try:
        deny, _, _ = chat(gateway.base("deny"), "acme", uuid.uuid4().hex)
        passed, _, body = chat(gateway.base("open"), "acme", uuid.uuid4().hex)
    finally:
        proxy.restore()
    assert deny == 500  # failure_mode_deny: true (Envoy's default status_on_error)
    assert passed == 200, body  # false: the request goes through, unlimited
    assert gateway.envoy.stat("cluster.engine.upstream_rq_completed") >= 1
