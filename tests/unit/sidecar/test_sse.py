"""The streamed answer: relayed event by event, its usage read, the usage
the client did not ask for removed, and a cut stream's output counted."""

from __future__ import annotations

import json
from typing import Any

from burstgate_client.sidecar.sse import StreamRelay, Usage, usage_of

USAGE = {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15,
         "prompt_tokens_details": {"cached_tokens": 8}}  # fmt: skip


def event(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def chunk(text: str | None, *, usage: Any = "absent", finish: str | None = None) -> bytes:
    delta = {"content": text} if text is not None else {}
    c: dict[str, Any] = {"id": "x", "object": "chat.completion.chunk",
                         "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    if usage != "absent":
        c["usage"] = usage
    return event(c)


def stream(usage_null: bool) -> list[bytes]:
    u: Any = None if usage_null else "absent"
    return [
        chunk("", usage=u), chunk(" the", usage=u), chunk(" gate", usage=u),
        chunk(" holds", usage=u), chunk(None, usage=u, finish="length"),
        event({"id": "x", "choices": [], "usage": USAGE}), b"data: [DONE]\n\n",
    ]  # fmt: skip


def test_a_client_that_asked_for_usage_gets_the_stream_unchanged() -> None:
    events = stream(usage_null=True)
    relay = StreamRelay(strip_usage=False)
    whole = b"".join(events)
    out = b"".join(relay.feed(whole[i : i + 7]) for i in range(0, len(whole), 7))  # any cuts
    assert out + relay.flush() == whole
    assert relay.usage == Usage(12, 3, 8) and relay.done and relay.text_chunks == 3


def test_the_forced_usage_is_removed_for_a_client_that_did_not_ask() -> None:
    relay = StreamRelay(strip_usage=True)
    out = b"".join(relay.feed(e) for e in stream(usage_null=True))
    datas = [line for line in out.split(b"\n\n") if line]
    assert datas[-1] == b"data: [DONE]"
    chunks = [json.loads(d[6:]) for d in datas[:-1]]
    assert len(chunks) == 5  # the usage chunk is gone
    assert all("usage" not in c for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == " the gate holds"
    assert relay.usage == Usage(12, 3, 8)  # read all the same


def test_chunks_without_a_usage_key_pass_as_they_are() -> None:
    relay = StreamRelay(strip_usage=True)
    events = stream(usage_null=False)  # vLLM leaves the key out of the other chunks
    out = b"".join(relay.feed(e) for e in events)
    assert out == b"".join(e for e in events if b'"choices": []' not in e)


def test_a_cut_stream_counts_what_it_carried() -> None:
    relay = StreamRelay(strip_usage=True)
    for e in stream(usage_null=False)[:3]:
        relay.feed(e)
    assert relay.usage is None and relay.generated_estimate == 2  # two chunks with text
    words = StreamRelay(strip_usage=True, count=lambda text: len(text.split()))
    words.feed(chunk(" the gate") + chunk(" holds"))
    assert words.generated_estimate == 3


def test_completions_text_crlf_events_and_continuous_usage() -> None:
    relay = StreamRelay(strip_usage=False)
    running = {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}
    first = b"data: " + json.dumps({"choices": [{"index": 0, "text": "a"}],
                                    "usage": running}).encode() + b"\r\n\r\n"  # fmt: skip
    assert relay.feed(first + b": keep-alive comment\n\n") == first + b": keep-alive comment\n\n"
    assert relay.usage == Usage(4, 1, 0) and relay.text_chunks == 1
    assert relay.feed(b"data: not json\n\n") == b"data: not json\n\n"
    assert relay.feed(b"data: {\"choices\"") == b""  # held until the event ends
    assert relay.flush() == b'data: {"choices"'


def test_usage_of_is_strict_about_its_shape() -> None:
    assert usage_of({"usage": USAGE}) == Usage(12, 3, 8)
    assert usage_of({"usage": None}) is None
    assert usage_of({"usage": {"prompt_tokens": "1", "completion_tokens": 2}}) is None
    bad_cached = {"prompt_tokens": 5, "completion_tokens": 2,
                  "prompt_tokens_details": {"cached_tokens": 9}}  # fmt: skip
    assert usage_of({"usage": bad_cached}) == Usage(5, 2, 0)
    assert usage_of([1]) is None


def test_the_null_usage_is_cut_out_of_the_engines_bytes_not_re_encoded() -> None:
    relay = StreamRelay(strip_usage=True)
    body = b'{"id": "x", "choices": [{"delta": {"content": "\xc3\xa9 1.50"}}]'
    assert relay.feed(b"data: " + body + b', "usage": null}\n\n') == b"data: " + body + b"}\n\n"
    first = b'data: {"usage":null,"choices":[{"text":"a"}]}\r\n\r\n'
    assert relay.feed(first) == b'data: {"choices":[{"text":"a"}]}\r\n\r\n'
    assert relay.text_chunks == 2


def test_an_event_the_cut_cannot_be_sure_of_is_re_encoded() -> None:
    relay = StreamRelay(strip_usage=True)
    for event in (
        b'data: {"choices": [{"delta": {"content": "usage"}}], "usage": null}\n\n',  # twice
        b'data: {"choices": [{"delta": {"content": "\\u00e9"}}], "usage": null}\n\n',  # \\u
        b'data: {"choices": [{"delta": {"content": "a"}}], "usage": {"x": 1}}\n\n',  # not null
    ):
        out = relay.feed(event)
        assert out.endswith(b"\n\n") and b'"usage"' not in out.split(b'"content"')[0]
        sent = json.loads(out[6:])
        expected = json.loads(event[6:])
        del expected["usage"]
        assert sent == expected


def test_whether_a_chunk_carried_output_is_what_its_pieces_say() -> None:
    from burstgate_client.sidecar.sse import _has_text, _pieces

    chunks: list[Any] = [
        {"choices": [{"delta": {"content": "a"}}]}, {"choices": [{"delta": {"content": ""}}]},
        {"choices": [{"delta": {"content": 5}}]}, {"choices": [{"delta": {}}]},
        {"choices": [{"delta": {"reasoning_content": "r"}}]},
        {"choices": [{"delta": {"reasoning_content": ["r"]}}]},
        {"choices": [{"delta": {"tool_calls": [{"id": "t"}]}}]},
        {"choices": [{"delta": {"tool_calls": []}}]}, {"choices": [{"text": "t"}]},
        {"choices": [{"text": ""}]}, {"choices": [{"delta": "x", "text": "t"}]},
        {"choices": [{"delta": None, "text": "t"}]}, {"choices": "ab"}, {"choices": None},
        {"choices": [1, {"delta": {"content": "late"}}]}, {},
    ]  # fmt: skip
    for c in chunks:
        assert _has_text(c) == bool(_pieces(c)), c


def test_a_usage_past_64_bits_is_read_as_the_standard_library_reads_it() -> None:
    relay = StreamRelay(strip_usage=False)
    big = 2**64
    relay.feed(event({"choices": [], "usage": {"prompt_tokens": big, "completion_tokens": 1}}))
    assert relay.usage == Usage(big, 1, 0)  # an int, as json.loads gives (orjson: a float)
