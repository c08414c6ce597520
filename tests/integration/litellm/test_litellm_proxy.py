"""burstgate in LiteLLM's proxy, end to end: the official openai client ->
a real ``litellm`` proxy process with the callback line of docs/litellm.md -> the
fake engine, with the real control plane on PostgreSQL deciding and
metering. Every request the engine served is in the ledger with the usage
LiteLLM reported; refusals are LiteLLM's own 429s."""

from __future__ import annotations

import threading
import time
from typing import Any

import openai
import pytest
from burstgate_client.protoclient import ProtoClient
from burstgate_client.sdk import pb

from tests.integration.ledger.conftest import ledger_rows
from tests.integration.litellm.conftest import Stack
from tests.support import wait_until

pytestmark = [pytest.mark.postgres, pytest.mark.slow]
PROMPT = "Tell me about bursts. " * 8


def chat(client: openai.OpenAI, call_id: str, **kw: Any) -> Any:
    kw.setdefault("messages", [{"role": "user", "content": PROMPT}])
    kw.setdefault("model", "fake-llama")
    headers = {"x-litellm-call-id": call_id, **kw.pop("extra_headers", {})}
    return client.chat.completions.with_raw_response.create(extra_headers=headers, **kw)


def test_admitted_requests_are_billed_with_litellms_usage(stack: Stack) -> None:
    client = stack.client()
    raw = chat(client, "plain-1", max_tokens=12)
    plain = raw.parse()
    assert plain.usage.completion_tokens == 12
    assert raw.headers["x-burstgate-pricing-multiplier"] == "1.000000"
    # a stream whose client asked for the usage, and one that did not
    chunks = list(client.chat.completions.create(
        model="fake-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=9,
        stream=True, stream_options={"include_usage": True},
        extra_headers={"x-litellm-call-id": "stream-usage"}))  # fmt: skip
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 9
    bare = list(client.chat.completions.create(
        model="fake-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=7,
        stream=True, extra_headers={"x-litellm-call-id": "stream-bare"}))  # fmt: skip
    assert all(c.usage is None for c in bare)  # LiteLLM strips what it added
    got = stack.rows("plain-1", "stream-usage", "stream-bare")
    a, s, b = got["plain-1"], got["stream-usage"], got["stream-bare"]
    assert (a.tenant_id, a.lane, a.model, a.pool) == ("acme", "standard", "fake-llama",
                                                      "fake-llama")  # fmt: skip
    assert (a.prompt_tokens, a.output_tokens) == (plain.usage.prompt_tokens, 12)
    assert (s.prompt_tokens, s.output_tokens) == (chunks[-1].usage.prompt_tokens, 9)
    assert b.output_tokens == 7
    assert a.exec_start_ns < a.end_ns  # LiteLLM's timings of the call


def test_refusal_is_litellms_429_with_retry_after(stack: Stack) -> None:
    client = stack.client("sk-tiny")  # 1 token/s, a burst of 400
    chat(client, "tiny-1", messages=[{"role": "user", "content": "x"}], max_tokens=300)
    with pytest.raises(openai.RateLimitError) as err:
        chat(client, "tiny-2", messages=[{"role": "user", "content": "x"}], max_tokens=300)
    resp = err.value.response
    assert resp.status_code == 429
    h = resp.headers
    wait_ms = int(h["retry-after-ms"])
    assert wait_ms > 100_000 and int(h["retry-after"]) == -(-wait_ms // 1000)
    # the refill comes long after the lane's SLO: a retry cannot be in time
    assert h["x-burstgate-reason"] == "token_rate" and h["x-should-retry"] == "false"
    assert h["x-ratelimit-limit-tokens"] == "400"
    assert "tiny" in resp.json()["error"]["message"]
    assert set(stack.rows("tiny-1")) == {"tiny-1"}  # nothing booked for the refused one


def test_a_request_burstgate_holds_runs_when_the_holder_leaves(stack: Stack) -> None:
    """Tenant g runs one request at a time: the second waits in burstgate's
    queue (not on the engine) until the first one's client disconnects,
    which LiteLLM reports and the hook settles."""
    client = stack.client("sk-g")
    holder = client.chat.completions.create(
        model="fake-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=20_000,
        stream=True, extra_headers={"x-litellm-call-id": "g-holder"})  # fmt: skip
    it = iter(holder)
    next(it), next(it)  # in flight on the engine
    held: dict[str, Any] = {}

    def second() -> None:
        held["raw"] = chat(stack.client("sk-g"), "g-held", max_tokens=3)

    t = threading.Thread(target=second)
    t.start()
    srv = stack.plane.srv
    assert srv is not None
    wait_until(lambda: srv.on_loop(lambda: srv.plane.service.waiting) == 1 or None,
               message="burstgate to hold the second request")  # fmt: skip
    assert "raw" not in held
    holder.close()  # the client leaves mid-stream
    t.join(timeout=60)
    raw = held["raw"]
    assert raw.parse().usage.completion_tokens == 3
    assert int(raw.headers["x-burstgate-queue-wait-ms"]) > 0
    got = stack.rows("g-holder", "g-held")
    assert 0 < got["g-holder"].output_tokens < 20_000  # what it generated before it was cut
    assert got["g-held"].arrival_ns < got["g-held"].exec_start_ns


def test_a_degraded_pool_caps_tokens_and_swaps_the_model(stack: Stack) -> None:
    with ProtoClient(stack.plane.direct) as c:
        c.report_load(pb.LoadReport(pool="busy", engine_id="e0", batch_tokens=100,
                                    max_batch_tokens=8000, max_num_seqs=256,
                                    gpu_utilization=0.99))  # fmt: skip
    raw = chat(stack.client("sk-d"), "d-1", model="fake-busy", max_tokens=100)
    done = raw.parse()
    assert done.usage.completion_tokens == 8  # the policy's degrade_max_tokens
    assert raw.headers["x-burstgate-degraded"] == "max_tokens=8; model=fake-small"
    assert raw.headers["x-litellm-model-group"] == "fake-small"
    row = stack.rows("d-1")["d-1"]
    assert (row.pool, row.model, row.output_tokens) == ("busy", "fake-busy", 8)


def test_a_key_without_a_tenant_is_refused(stack: Stack) -> None:
    with pytest.raises(openai.PermissionDeniedError) as err:
        chat(stack.client("sk-nobody"), "nobody-1", max_tokens=3)
    assert "tenant_from [team_id]" in err.value.response.json()["error"]["message"]


def test_unreachable_control_plane_fails_open_or_closed_by_lane(stack: Stack) -> None:
    proxy = stack.plane.proxy
    assert proxy is not None
    proxy.cut()
    try:
        # standard fails closed: 503 with retry-after, nothing sent to the engine
        with pytest.raises(openai.InternalServerError) as err:
            chat(stack.client(), "down-standard", max_tokens=3)
        assert err.value.response.status_code == 503
        assert err.value.response.headers["x-burstgate-reason"] == "unavailable"
        assert int(err.value.response.headers["retry-after"]) >= 1
        # premium (the key's metadata) fails open: served, settled when it is back
        raw = chat(stack.client("sk-acme-premium"), "down-premium", max_tokens=4)
        assert raw.parse().usage.completion_tokens == 4
        assert raw.headers["x-burstgate-offline"] == "true"
    finally:
        proxy.restore()
    row = stack.rows("down-premium")["down-premium"]
    assert (row.lane, row.output_tokens) == ("premium", 4)
    assert not ledger_rows(stack.plane.url, "request_id = 'down-standard'")  # refused: none


def test_a_retry_past_its_first_attempts_deadline_is_refused_for_good(stack: Stack) -> None:
    """The openai client's retry of a refused request (the same body,
    ``x-stainless-retry-count`` 1) is judged against its first attempt's
    deadline (docs/gate.md): once that has passed it is refused with
    ``x-should-retry: false`` even though the bucket has refilled; the same
    body as a first attempt is a new request."""
    client = stack.client("sk-r")  # 100 tokens/s, a burst of 400, no waiting
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 300}
    chat(client, "r-1", **body)
    with pytest.raises(openai.RateLimitError) as err:
        chat(client, "r-2", **body)
    h = err.value.response.headers
    # the bucket refills within the standard lane's SLO: a retry may be in time
    assert (h["x-burstgate-reason"], h["x-should-retry"]) == ("token_rate", "true")
    time.sleep(3.2)  # past the first attempt's deadline (3 s); the bucket is full again
    with pytest.raises(openai.RateLimitError) as err:
        chat(client, "r-3", **body, extra_headers={"x-stainless-retry-count": "1"})
    h = err.value.response.headers
    assert (h["x-burstgate-reason"], h["x-should-retry"]) == ("backpressure", "false")
    assert chat(client, "r-4", **body).parse().usage.completion_tokens == 300
    assert set(stack.rows("r-1", "r-4")) == {"r-1", "r-4"}  # nothing booked for the refused


def test_a_stream_reports_its_first_token(stack: Stack) -> None:
    srv = stack.plane.srv
    assert srv is not None

    def samples() -> int:
        n: int = srv.on_loop(lambda: srv.plane.service.views.ttft_samples("fake-llama"))
        return n

    before = samples()
    list(stack.client().chat.completions.create(
        model="fake-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=20,
        stream=True, extra_headers={"x-litellm-call-id": "first-token-1"}))  # fmt: skip
    stack.rows("first-token-1")
    wait_until(lambda: samples() == before + 1 or None, message="the first token's report")
    chat(stack.client(), "first-token-2", max_tokens=5)  # not streamed: no first token known
    stack.rows("first-token-2")
    assert samples() == before + 1
