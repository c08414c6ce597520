"""Descriptor mapping: which entries give what, the cost, bad input."""

from __future__ import annotations

import pytest

from controlplane._proto.envoy.service.ratelimit.v3 import rls_pb2 as rls
from controlplane.integrations.envoy.config import EnvoyConfig
from controlplane.integrations.envoy.config import parse as parse_config
from controlplane.integrations.envoy.mapping import BadInput, Phase, parse

CFG = EnvoyConfig()


def request(*descriptors: dict[str, str], hits: int = 0, domain: str = "burstgate",
            per_descriptor: list[int | None] | None = None) -> rls.RateLimitRequest:  # fmt: skip
    req = rls.RateLimitRequest(domain=domain, hits_addend=hits)
    for i, entries in enumerate(descriptors):
        d = req.descriptors.add()
        for k, v in entries.items():
            d.entries.add(key=k, value=v)
        hits_i = per_descriptor[i] if per_descriptor is not None else None
        if hits_i is not None:
            d.hits_addend.value = hits_i
    return req


def test_entries_from_every_descriptor_are_read_together() -> None:
    ask = parse(request({"tenant": "acme", "request_id": "r1"}, {"lane": "premium"},
                        {"remote_address": "10.0.0.1"}), CFG)  # fmt: skip
    assert (ask.tenant, ask.lane, ask.request_id, ask.phase) == ("acme", "premium", "r1",
                                                                 Phase.REQUEST)  # fmt: skip
    assert ask.mapped == (True, True, False)  # the third is not burstgate's


def test_cost_descriptor_then_request_then_estimate() -> None:
    two = ({"tenant": "a"}, {"lane": "batch"})
    assert parse(request(*two, hits=7, per_descriptor=[None, 40]), CFG).tokens == 40
    assert parse(request(*two, hits=7), CFG).tokens == 7
    est = parse(request(*two), CFG)
    assert (est.tokens, est.cost_given) == (1024, False)
    zero = parse(request(*two, hits=7, per_descriptor=[0, None]), CFG)
    assert (zero.tokens, zero.cost_given) == (0, True)  # a check: spends nothing


def test_response_phase_with_the_usage_split() -> None:
    ask = parse(request({"tenant": "a", "request_id": "r", "phase": "response",
                         "prompt_tokens": "12", "completion_tokens": "30"},
                        per_descriptor=[42]), CFG)  # fmt: skip
    assert (ask.phase, ask.tokens, ask.prompt_tokens, ask.completion_tokens) == (
        Phase.RESPONSE, 42, 12, 30)  # fmt: skip
    # response path without hits_addend: no usage, not the estimate
    assert parse(request({"tenant": "a", "phase": "response"}), CFG).tokens == 0


def test_configured_keys_and_defaults() -> None:
    cfg = parse_config({"domain": "edge", "descriptors": {"tenant": "x-team"},
                        "defaults": {"tenant": "anonymous", "lane": "batch"}})  # fmt: skip
    assert parse(request({"x-team": "t1"}, domain="edge"), cfg).tenant == "t1"
    ask = parse(request({"request_id": "r"}, domain="edge"), cfg)
    assert (ask.tenant, ask.lane) == ("anonymous", "batch")


@pytest.mark.parametrize(
    ("req", "field", "words"),
    [
        (request({"tenant": "a"}, domain="other"), "domain", "is not 'burstgate'"),
        (request(), "descriptors", "no descriptor"),
        (request({"remote_address": "1.2.3.4"}), "descriptors", "no entry with a burstgate key"),
        (request({"request_id": "r"}), "tenant", "no defaults.tenant"),
        (request({"tenant": "a"}, {"tenant": "b"}), "tenant", "two values"),
        (request({"tenant": "a", "phase": "later"}), "phase", "'request' or 'response'"),
        (request({"tenant": "a", "request_id": "x" * 129}), "request_id", "1..128"),
        (request({"tenant": "a\n"}), "tenant", "printable"),
        (
            request({"tenant": "a", "prompt_tokens": "-1", "completion_tokens": "1"}),
            "prompt_tokens",
            "token count",
        ),
        (request({"tenant": "a", "prompt_tokens": "1"}), "completion_tokens", "both"),
    ],
)
def test_bad_input_names_the_entry(req: rls.RateLimitRequest, field: str, words: str) -> None:
    with pytest.raises(BadInput) as err:
        parse(req, CFG)
    assert err.value.field == field
    assert words in err.value.message


def test_a_retry_key_and_attempt_are_read_and_checked() -> None:
    cfg = EnvoyConfig()
    req = rls.RateLimitRequest(domain="burstgate")
    d = req.descriptors.add()
    d.entries.add(key="tenant", value="acme")
    assert (parse(req, cfg).retry_key, parse(req, cfg).attempt) == ("", 0)  # absent: a first try
    d.entries.add(key="retry_key", value="idem-1")
    d.entries.add(key="attempt", value="2")
    ask = parse(req, cfg)
    assert (ask.retry_key, ask.attempt) == ("idem-1", 2)
    for bad in ("-1", "1001", "two", "99999"):
        d.entries[2].value = bad
        with pytest.raises(BadInput) as err:
            parse(req, cfg)
        assert err.value.field == "attempt"
    d.entries[2].value = "1"
    d.entries[1].value = "x" * 129
    with pytest.raises(BadInput) as err:
        parse(req, cfg)
    assert err.value.field == "retry_key"
