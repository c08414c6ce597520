"""The engine's answer: usage from a whole response, and a streamed one
(server-sent events) relayed event by event.

A stream is forwarded as it comes, one write per read from the engine.
Each ``data: {...}`` event is read for two things: the usage (the last
chunk, with ``choices: []``, when ``stream_options.include_usage`` is set;
any chunk with a usage counts, so vLLM's continuous usage works too), and the
output seen so far, in case the stream is cut before the usage comes (a
client that goes away): then the output is counted with the tokenizer when
one is configured, else as the number of chunks that carried text (vLLM
sends one per decoding step, each with at least one token).

When the sidecar forced ``include_usage`` on a client that did not ask for
it, the usage chunk is dropped and the ``"usage": null`` of the other chunks
removed, so the client gets the stream it asked for.

Events are never re-encoded: what the client gets is the engine's bytes,
less, where it must be, the ``"usage": null`` member cut out of them (an
event too unusual to cut safely, which no engine sends, is re-encoded). Each
event is read with orjson (the stream's hot loop: the standard library's
decoder, its encoder and their Python layers were most of the sidecar's CPU
per streamed request); a payload orjson refuses is read by the standard
library, so what counts as a chunk is unchanged.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

_EVENT_END = re.compile(rb"\r?\n\r?\n")
# The "usage": null member of a chunk, with the comma that joins it to the
# member before it, else to the one after it.
_NULL_USAGE_AFTER = re.compile(rb',\s*"usage"\s*:\s*null')
_NULL_USAGE_FIRST = re.compile(rb'"usage"\s*:\s*null\s*,?')


# 19 digits in a row: maybe an integer past 64 bits, which orjson would read
# as a float where the standard library reads an int.
LONG_DIGITS = re.compile(rb"\d{19}")


def loads(data: bytes) -> Any:
    """A JSON value as the standard library reads it: orjson, else (NaN,
    long integers, lone surrogates, other encodings) the standard library,
    which raises ValueError (JSONDecodeError, UnicodeDecodeError) as before."""
    if LONG_DIGITS.search(data) is None:
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            pass
    return json.loads(data)


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


def usage_of(obj: Any) -> Usage | None:
    """The ``usage`` of a response or chunk (None when absent or malformed)."""
    usage = obj.get("usage") if isinstance(obj, dict) else None
    if not isinstance(usage, dict):
        return None
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return None
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    cached = cached if isinstance(cached, int) and 0 <= cached <= prompt else 0
    return Usage(max(0, prompt), max(0, completion), cached)


def _pieces(chunk: dict[str, Any]) -> list[str]:
    """The output text of a chunk's choices (chat deltas or completions text)."""
    out: list[str] = []
    for choice in chunk.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        if isinstance(delta, dict):
            for key in ("content", "reasoning_content"):
                if isinstance(delta.get(key), str) and delta[key]:
                    out.append(delta[key])
            if delta.get("tool_calls"):
                out.append(json.dumps(delta["tool_calls"]))
        elif isinstance(choice.get("text"), str) and choice["text"]:
            out.append(choice["text"])
    return out


def _has_text(chunk: dict[str, Any]) -> bool:
    """``bool(_pieces(chunk))`` without building the pieces (no tokenizer:
    only whether the chunk carried output counts)."""
    for choice in chunk.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        if isinstance(delta, dict):
            content = delta.get("content")
            if content and isinstance(content, str):
                return True
            reasoning = delta.get("reasoning_content")
            if (reasoning and isinstance(reasoning, str)) or delta.get("tool_calls"):
                return True
        else:
            text = choice.get("text")
            if text and isinstance(text, str):
                return True
    return False


class StreamRelay:
    """Feed it the engine's bytes; it returns what to send the client."""

    def __init__(self, *, strip_usage: bool, count: Callable[[str], int] | None = None) -> None:
        self.strip_usage = strip_usage
        self._count = count
        self._buffer = b""
        self.usage: Usage | None = None
        self.text_chunks = 0
        self._text: list[str] = []
        self.done = False  # data: [DONE] seen

    @property
    def generated_estimate(self) -> int:
        """Output tokens seen so far (for a stream cut before its usage)."""
        if self._count is not None:
            return self._count("".join(self._text))
        return self.text_chunks

    def feed(self, data: bytes) -> bytes:
        self._buffer += data
        out: list[bytes] = []
        pos = 0
        for m in _EVENT_END.finditer(self._buffer):
            event = self._buffer[pos : m.end()]
            pos = m.end()
            kept = self._event(event)
            if kept is not None:
                out.append(kept)
        self._buffer = self._buffer[pos:]
        return b"".join(out)

    def flush(self) -> bytes:
        """What is left unterminated at the end of the stream, as it came."""
        rest, self._buffer = self._buffer, b""
        return rest

    def _event(self, event: bytes) -> bytes | None:
        if not event.startswith(b"data:"):
            return event  # comments, other fields: as they are
        payload = event[5:].strip()
        if payload == b"[DONE]":
            self.done = True
            return event
        try:
            chunk = loads(payload)
        except ValueError:  # JSONDecodeError, UnicodeDecodeError
            return event
        if not isinstance(chunk, dict):
            return event
        if self._count is None:
            if _has_text(chunk):
                self.text_chunks += 1
        elif pieces := _pieces(chunk):
            self.text_chunks += 1
            self._text.extend(pieces)
        if "usage" not in chunk:
            return event
        usage = usage_of(chunk)
        if usage is not None:
            self.usage = usage
        if not self.strip_usage:
            return event
        if usage is not None and not chunk.get("choices"):
            return None  # the usage chunk the client did not ask for
        if chunk["usage"] is None and (cut := _cut_null_usage(event)) is not None:
            return cut
        del chunk["usage"]
        return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"


def _cut_null_usage(event: bytes) -> bytes | None:
    """The event without its top-level ``"usage": null`` member, cut out of
    its bytes; None when the cut is not certainly that member. With no
    ``\\u`` escape in the event, the top-level key the caller found is
    written out as ``"usage"``; when that text occurs once, it is that key
    (any other occurrence, a nested key or a string, would be a second)."""
    if event.count(b'"usage"') != 1 or b"\\u" in event:
        return None
    m = _NULL_USAGE_AFTER.search(event) or _NULL_USAGE_FIRST.search(event)
    if m is None:
        return None
    return event[: m.start()] + event[m.end() :]
