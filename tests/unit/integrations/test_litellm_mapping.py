"""The LiteLLM hook's mapping, without a proxy: tenant, lane and pool
rules over a LiteLLM key and request, token counts, what an admission
changes in the request body, the usage LiteLLM reports, refusals as
LiteLLM's exceptions, and one settlement per admission."""

from __future__ import annotations

from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import pytest
from burstgate_client.litellm import mapping as M
from burstgate_client.litellm.config import HookSettings, Rule
from burstgate_client.litellm.refusal import refusal_error
from burstgate_client.litellm.settle import Ticket, Tickets
from burstgate_client.sdk import FailPolicy
from burstgate_client.sdk.model import offline_admission
from fastapi import HTTPException
from litellm.exceptions import RateLimitError
from litellm.proxy._types import UserAPIKeyAuth
from litellm.types.utils import ModelResponse, Usage

KEY = UserAPIKeyAuth(api_key="sk-1", team_id="team-7", key_alias="alias-7", user_id="u1",
                     metadata={"burstgate_lane": "batch", "tenant": "acme"},
                     team_metadata={"burstgate_lane": "premium"})  # fmt: skip


def request(**kw: Any) -> dict[str, Any]:
    data: dict[str, Any] = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}
    data.update(kw)
    return data


def cfg(**kw: Any) -> HookSettings:
    return HookSettings(**kw)


# ------------------------------------------------------------------- rules


@pytest.mark.parametrize(("rule", "want"), [
    ("team_id", "team-7"), ("key_alias", "alias-7"), ("user_id", "u1"), ("end_user_id", None),
    ("metadata.tenant", "acme"), ("metadata.missing", None),
    ("team_metadata.burstgate_lane", "premium"),
])  # fmt: skip
def test_rules_read_the_key(rule: str, want: str | None) -> None:
    assert M.read_rule(Rule.parse(rule), KEY, request()) == want


def test_rules_read_the_request() -> None:
    data = request(metadata={"requester_metadata": {"lane": "batch"}, "lane": "other",
                             "headers": {"x-burstgate-lane": "premium"}})  # fmt: skip
    assert M.read_rule(Rule.parse("request_metadata.lane"), KEY, data) == "batch"
    assert M.read_rule(Rule.parse("header.X-Burstgate-Lane"), KEY, data) == "premium"
    server = request(proxy_server_request={"headers": {"X-Tenant": "t9"}})
    assert M.read_rule(Rule.parse("header.x-tenant"), KEY, server) == "t9"
    # values that are not text are not used: the next rule is
    odd = UserAPIKeyAuth(api_key="k", metadata={"tenant": {"a": 1}, "n": 7})
    assert M.read_rule(Rule.parse("metadata.tenant"), odd, request()) is None
    assert M.read_rule(Rule.parse("metadata.n"), odd, request()) == "7"


def test_target_tenant_lane_and_pool() -> None:
    c = cfg(tenant_from=["end_user_id", "team_id"], tenant_map={"team-7": "acme"},
            pools={"gpt-4o": "gpu-a"})  # fmt: skip
    t = M.target(c, KEY, request())
    assert t == M.Target("acme", "batch", "gpt-4o", "gpu-a")  # key metadata's lane
    # the request's metadata asks first; then the key's, then the team's
    asked = M.target(c, KEY, request(metadata={"requester_metadata": {"burstgate_lane": "x"}}))
    assert asked.lane == "x"
    bare = UserAPIKeyAuth(api_key="k", team_id="beta")
    assert M.target(c, bare, request(model="small")) == M.Target("beta", "", "small", "small")
    lanes = cfg(tenant_lanes={"beta": "batch"}, default_pool="shared")
    assert M.target(lanes, bare, request()) == M.Target("beta", "batch", "gpt-4o", "shared")


def test_no_tenant() -> None:
    nobody = UserAPIKeyAuth(api_key="k")
    with pytest.raises(M.NoTenant, match=r"tenant_from \[team_id, key_alias\]"):
        M.target(cfg(tenant_from=["team_id", "key_alias"]), nobody, request())
    assert M.target(cfg(default_tenant="shared"), nobody, request()).tenant == "shared"


# ------------------------------------------------------------------ tokens


def test_token_counts() -> None:
    text = "Tell me about bursts. " * 8  # 176 bytes
    chat = request(messages=[{"role": "user", "content": text}])
    assert M.bytes_counter(chat, True) == 44 + 4 + 3
    count = M.litellm_counter()
    assert count(chat, True) == 48  # tiktoken's cl100k_base, with the chat template
    assert count({"prompt": text}, False) == 41
    assert count({"prompt": [1, 2, 3]}, False) == 3  # token ids
    odd = {"messages": "not a list"}
    assert count(odd, True) == M.bytes_counter(odd, True)  # what litellm cannot count: bytes


def test_admitted_tokens_and_choices() -> None:
    assert M.admit_max_tokens(request(max_tokens=100), True, 1024) == 100
    assert M.admit_max_tokens(request(max_tokens=100, max_completion_tokens=50), True, 1) == 50
    assert M.admit_max_tokens(request(n=3), True, 1024) == 3072
    assert M.admit_max_tokens({"prompt": ["a", "b"], "best_of": 2, "max_tokens": 10},
                              False, 1) == 40  # fmt: skip
    assert M.admit_max_tokens(request(max_tokens=True), True, 7) == 7  # not an int: the default


# ------------------------------------------------------------- degradation


def test_apply_admission_caps_and_swaps() -> None:
    data = request(max_tokens=100, max_completion_tokens=90, n=2)
    changes = M.apply_admission(data, chat=True, granted_max_tokens=16, fallback_model="small")
    assert changes == {"max_tokens": 8, "max_completion_tokens": 8, "model": "small"}
    assert (data["max_tokens"], data["max_completion_tokens"], data["model"]) == (8, 8, "small")


def test_apply_admission_leaves_what_fits() -> None:
    data = request(max_tokens=10)
    assert M.apply_admission(data, chat=True, granted_max_tokens=10, fallback_model="") == {}
    # no cap given: the grant becomes max_tokens (the engine must not exceed it)
    data = request()
    assert M.apply_admission(data, chat=True, granted_max_tokens=1024,
                             fallback_model="gpt-4o") == {"max_tokens": 1024}  # fmt: skip
    assert data["model"] == "gpt-4o"


# ------------------------------------------------------------------- usage


def test_usage_of_a_response_and_of_the_logging_payload() -> None:
    r = ModelResponse(usage=Usage(prompt_tokens=20, completion_tokens=5, total_tokens=25,
                                  prompt_tokens_details={"cached_tokens": 16}))  # fmt: skip
    assert M.usage_of(r) == M.Usage(20, 5, 16)
    assert M.usage_of({"usage": {"prompt_tokens": 3, "completion_tokens": 4}}) == M.Usage(3, 4, 0)
    payload = {"standard_logging_object": {"prompt_tokens": 9, "completion_tokens": 2}}
    assert M.usage_of(SimpleNamespace(usage=None), payload) == M.Usage(9, 2, 0)
    assert M.usage_of(None, {}) is None
    assert M.usage_of({"usage": {"prompt_tokens": -1, "completion_tokens": 4}}) is None


def test_stream_chunks_and_times() -> None:
    text = {"choices": [{"delta": {"content": " word"}}]}
    assert M.chunk_text_count(text) == 1
    assert M.chunk_text_count({"choices": [{"delta": {"content": ""}}]}) == 0
    assert M.chunk_text_count({"choices": []}) == 0
    t = datetime(2026, 1, 1, tzinfo=UTC)
    assert M.unix_ns(t) == int(t.timestamp()) * 10**9
    assert M.unix_ns(1.5) == 1_500_000_000 and M.unix_ns(None) == 0


# ---------------------------------------------------------------- refusals


def admission(**kw: Any) -> Any:
    base = dict(admitted=False, reason="token_rate", retry_after_ms=1500, retryable=True,
                bucket_remaining=3, hourly_remaining=-1, daily_remaining=-1, offline=False,
                quota_exhausted=False, granted_max_tokens=0)  # fmt: skip
    return SimpleNamespace(**(base | kw))


def test_a_rate_refusal_is_litellms_rate_limit_error() -> None:
    e = refusal_error(admission(), tenant="acme", request_id="r1", model="gpt-4o", limits=None,
                      unavailable_retry_after_ms=1000)  # fmt: skip
    assert isinstance(e, HTTPException) and isinstance(e, RateLimitError)
    assert e.status_code == 429 and e.headers is not None
    assert e.headers["retry-after"] == "2" and e.headers["retry-after-ms"] == "1500"
    assert e.headers["x-burstgate-reason"] == "token_rate"
    assert "acme" in str(e.detail) and "r1" in str(e.detail)


@pytest.mark.parametrize(("reason", "status"), [
    ("max_tokens", 400), ("unknown_tenant", 401), ("tenant_disabled", 403),
])  # fmt: skip
def test_other_refusals_keep_their_status(reason: str, status: int) -> None:
    e = refusal_error(admission(reason=reason), tenant="acme", request_id="r1", model="m",
                      limits=None, unavailable_retry_after_ms=1000)  # fmt: skip
    assert e.status_code == status and not isinstance(e, RateLimitError)


def test_fail_closed_is_503_with_retry_after() -> None:
    a = offline_admission("r1", FailPolicy.CLOSED, 10, 250)
    e = refusal_error(a, tenant="acme", request_id="r1", model="m", limits=None,
                      unavailable_retry_after_ms=1000)  # fmt: skip
    assert e.status_code == 503 and e.headers is not None and e.headers["retry-after"] == "1"


# -------------------------------------------------------------- settlement


def test_a_ticket_is_taken_once() -> None:
    t = Tickets()
    t.open(Ticket("acme", "r1", 10))
    first, second = t.take("r1"), t.take("r1")
    assert first is not None and first.request_id == "r1" and second is None
    assert t.take(None) is None and t.get(42) is None


def test_what_a_stream_showed() -> None:
    ticket = Ticket("acme", "r1", 10)
    ticket.streamed_chunks = 4
    assert ticket.seen() == M.Usage(10, 4, 0)  # the estimate and the text chunks
    ticket.streamed_usage = M.Usage(12, 5, 0)
    assert ticket.seen() == M.Usage(12, 5, 0)  # the usage chunk, when it came


def test_tickets_never_settled_are_forgotten() -> None:
    t = Tickets(ttl_s=10)
    t.open(Ticket("acme", "old", 1, admitted_mono=100.0))
    t.open(Ticket("acme", "new", 1, admitted_mono=111.0))
    assert "old" not in t and "new" in t and len(t) == 1


def test_a_retry_is_known_by_its_idempotency_key_or_its_body() -> None:
    def data(content: str, **headers: str) -> dict[str, Any]:
        return {"model": "m", "messages": [{"role": "user", "content": content}],
                "max_tokens": 5, "proxy_server_request": {"headers": headers}}  # fmt: skip

    first = M.retry_of(data("hi", **{"x-stainless-retry-count": "0"}), "acme")
    again = M.retry_of(data("hi", **{"X-Stainless-Retry-Count": "2"}), "acme")
    assert first[1] == 0 and again == (first[0], 2)  # the same body: the same key
    assert M.retry_of(data("hi"), "beta")[0] != first[0]  # another tenant's
    assert M.retry_of(data("bye"), "acme")[0] != first[0]  # another request
    keyed = M.retry_of(data("hi", **{"Idempotency-Key": "idem-7",
                                     "x-stainless-retry-count": "x"}), "acme")  # fmt: skip
    assert keyed == ("idem-7", 0)  # not a count: a first attempt
