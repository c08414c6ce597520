"""Reading a completions request and what is changed before the engine
gets it: the grant's cap, the fallback model, include_usage; nothing else."""

from __future__ import annotations

import json
from typing import Any

import pytest
from burstgate_client.sidecar.rewrite import BadRequest, forwarded_body, parse
from hypothesis import given, settings
from hypothesis import strategies as st


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


# --- orjson's reading against the standard library's -------------------------


def reference(raw_body: bytes, chat: bool = True) -> Any:
    """What the standard library's reading alone made of a body: the parsed
    object, or the refusal's (message, param)."""
    from burstgate_client.sidecar import rewrite

    try:
        body = json.loads(raw_body, object_pairs_hook=rewrite._object)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return ("the request body is not valid JSON (UTF-8)", None)
    except RecursionError:
        return (f"the request body nests deeper than {rewrite.MAX_DEPTH} levels", None)
    except BadRequest as exc:
        return (str(exc), exc.param)
    if not isinstance(body, dict):
        return ("the request body must be a JSON object", None)
    if rewrite._depth(body) > rewrite.MAX_DEPTH:
        return (f"the request body nests deeper than {rewrite.MAX_DEPTH} levels", None)
    return body


def reading(raw_body: bytes) -> Any:
    """The sidecar's reading (orjson first): the object, or the refusal."""
    from burstgate_client.sidecar import rewrite

    try:
        return rewrite._load(raw_body)[0]
    except BadRequest as exc:
        return (str(exc), exc.param)


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "m", "model": "n"}',  # a repeated key
        b'{"a": {"k": 1, "k": 2}}',  # nested
        b'{"a": "x:y", "b": 1, "b": 2, "c": "::"}',  # colons in strings beside it
        b'{"a": "\\u003a", "b": 1, "b": 2}',  # an escaped colon and a repeat
        b'{"a": "\\u003a", "b": 1}',  # an escaped colon alone: accepted
        b'{"k:": 1, "k:": 2}',  # colons in the repeated keys
        b'{"a": [{"x": 1}, {"x": 1, "x": 1}]}',
        b'{"a": NaN, "b": 1e400, "c": 123456789012345678901234567890}',
        b'{"a": "\\ud800"}',
        b'{"a": -9223372036854775809, "b": 18446744073709551616}',  # orjson: floats
        b'{"a": 1.0000000000000000000001}',
        b"\xef\xbb\xbf{}",
        b"[" * 70 + b"]" * 70,
        b'{"a": ' + b"[" * 64 + b"]" * 64 + b"}",
        b'{"a": ' + b"[" * 63 + b"]" * 63 + b"}",
        b'{"a": "' + b"[" * 80 + b'"}',  # brackets in a string are not depth
        b"\xff",
        b"",
        b"null",
    ],
)
def test_the_reading_is_the_standard_librarys(body: bytes) -> None:
    assert reading(body) == reference(body)


def test_a_body_read_by_orjson_is_written_back_by_it_with_the_same_value() -> None:
    req = parse(raw({**CHAT, "stream": True, "messages": [{"role": "user", "content": "é:"}]}),
                chat=True)  # fmt: skip
    assert req.plain
    sent = forwarded_body(req, granted_max_tokens=5, fallback_model="", default_max=1)
    assert json.loads(sent) == {**req.body, "max_tokens": 5,
                                "stream_options": {"include_usage": True}}  # fmt: skip
    odd = parse(b'{"model": "m", "messages": [], "temperature": NaN}', chat=True)
    assert not odd.plain  # the standard library's: written back by it (NaN as it came)
    assert b"NaN" in forwarded_body(odd, granted_max_tokens=5, fallback_model="", default_max=1)


json_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(["", ":", "a:b", "usage", "é"]),
    st.text(max_size=8),
)  # fmt: skip
KEYS = st.sampled_from(["a", "b", "k:", ":", "model", "é"])
json_tree = st.recursive(
    json_leaf,
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.lists(st.tuples(KEYS, inner), max_size=4)),  # pairs: repeats kept
    max_leaves=20,
)  # fmt: skip


def text_of(tree: Any) -> str:
    """JSON text of a tree whose objects are lists of (key, value) pairs (so
    a key may repeat), with random escapes of ':' in strings."""
    if isinstance(tree, list) and tree and all(isinstance(p, tuple) for p in tree):
        return "{" + ", ".join(f"{text_of(k)}: {text_of(v)}" for k, v in tree) + "}"
    if isinstance(tree, list):
        return "[" + ",".join(text_of(v) for v in tree) + "]"
    if isinstance(tree, str):
        out = json.dumps(tree, ensure_ascii=len(tree) % 2 == 0)
        return out.replace(":", "\\u003a") if len(tree) % 3 == 0 else out
    return json.dumps(tree)


@given(st.lists(st.tuples(KEYS, json_tree), max_size=5))
@settings(max_examples=300, deadline=None)
def test_random_bodies_are_read_as_the_standard_library_reads_them(pairs: Any) -> None:
    body = text_of(pairs) if pairs else "{}"
    assert reading(body.encode()) == reference(body.encode())
