"""Reading a completions request and what is changed before the engine
gets it: the grant's cap, the fallback model, include_usage; nothing else."""

from __future__ import annotations

import json
from typing import Any

import pytest
from burstgate_client.sidecar.rewrite import BadRequest, forwarded_body, parse


def raw(body: Any) -> bytes:
    return json.dumps(body).encode()


def forward(body: dict[str, Any], *, chat: bool = True, granted: int = 0, fallback: str = "",
            default: int = 1024) -> dict[str, Any]:  # fmt: skip
    req = parse(raw(body), chat=chat)
    sent = forwarded_body(req, granted_max_tokens=granted, fallback_model=fallback,
                          default_max=default)  # fmt: skip
    out: dict[str, Any] = json.loads(sent)
    return out


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_a_request_within_its_grant_is_forwarded_byte_for_byte() -> None:
    body = b'{"model": "m",  "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50}'
    req = parse(body, chat=True)
    assert req.max_tokens == 50 and req.choices == 1 and not req.stream
    assert forwarded_body(req, granted_max_tokens=50, fallback_model="", default_max=9) is body


def test_max_tokens_is_capped_to_the_grant() -> None:
    assert forward({**CHAT, "max_tokens": 500}, granted=120)["max_tokens"] == 120


def test_the_field_the_client_used_is_the_one_capped() -> None:
    out = forward({**CHAT, "max_completion_tokens": 500}, granted=100)
    assert out["max_completion_tokens"] == 100 and "max_tokens" not in out
    both = forward({**CHAT, "max_completion_tokens": 300, "max_tokens": 80}, granted=100)
    assert both["max_completion_tokens"] == 100 and both["max_tokens"] == 80


def test_a_request_without_max_tokens_gets_the_grant() -> None:
    req = parse(raw(CHAT), chat=True)
    assert req.max_tokens is None and req.admit_max_tokens(700) == 700
    assert forward(CHAT, granted=700)["max_tokens"] == 700
    assert forward(CHAT, granted=0, default=333)["max_tokens"] == 333  # no grant figure


def test_choices_share_the_grant() -> None:
    req = parse(raw({**CHAT, "n": 3, "max_tokens": 100}), chat=True)
    assert req.choices == 3 and req.admit_max_tokens(1) == 300
    assert forward({**CHAT, "n": 3, "max_tokens": 100}, granted=150)["max_tokens"] == 50
    batch = parse(raw({"model": "m", "prompt": ["a", "b"], "max_tokens": 10, "best_of": 2}),
                  chat=False)  # fmt: skip
    assert batch.choices == 4 and batch.admit_max_tokens(1) == 40
    ids = parse(raw({"model": "m", "prompt": [1, 2, 3], "max_tokens": 10}), chat=False)
    assert ids.choices == 1  # one prompt of token ids


def test_degradation_rewrites_the_model() -> None:
    out = forward({**CHAT, "max_tokens": 10}, granted=10, fallback="small")
    assert out["model"] == "small" and out["messages"] == CHAT["messages"]


def test_streams_get_include_usage_and_keep_their_other_options() -> None:
    req = parse(raw({**CHAT, "stream": True, "max_tokens": 5}), chat=True)
    assert req.stream and not req.client_wants_usage
    out = forward({**CHAT, "stream": True, "max_tokens": 5,
                   "stream_options": {"continuous_usage_stats": False}}, granted=5)  # fmt: skip
    assert out["stream_options"] == {"continuous_usage_stats": False, "include_usage": True}
    asked = parse(raw({**CHAT, "stream": True, "stream_options": {"include_usage": True},
                       "max_tokens": 5}), chat=True)  # fmt: skip
    assert asked.client_wants_usage
    same = forwarded_body(asked, granted_max_tokens=5, fallback_model="", default_max=1)
    assert same is asked.raw


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        (b"[1, 2]", None),
        (raw({**CHAT, "max_tokens": 0}), "max_tokens"),
        (raw({**CHAT, "max_tokens": "10"}), "max_tokens"),
        (raw({**CHAT, "max_completion_tokens": True}), "max_completion_tokens"),
        (raw({**CHAT, "n": -1}), "n"),
        (raw({**CHAT, "model": 5}), "model"),
        (raw({**CHAT, "stream": "yes"}), "stream"),
        (raw({**CHAT, "stream_options": []}), "stream_options"),
    ],
)
def test_bad_requests_name_the_field(body: bytes, param: str | None) -> None:
    with pytest.raises(BadRequest) as err:
        parse(body, chat=True)
    assert err.value.param == param
    if param:
        assert param in str(err.value)
