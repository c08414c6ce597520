"""Reading an OpenAI completions request and rewriting it for the engine.

What the sidecar changes in an admitted request, and nothing else:
- ``max_tokens`` (or ``max_completion_tokens``, whichever the client used;
  ``max_tokens`` when it named none) is capped to what the admission granted
  (divided among the choices: ``n`` times the prompts of a batch), so the engine
  cannot generate more than was reserved; a degradation cap is part of the
  grant;
- ``model`` becomes the degradation's fallback model, when there is one;
- a streamed request gets ``stream_options.include_usage = true``, so that
  the last chunk carries the usage the settlement needs (sse.py strips that
  chunk again when the client did not ask for it).
An unchanged request is forwarded byte for byte; a changed one is encoded
with orjson when it was read with it (the same JSON value; non-ASCII text
as UTF-8 rather than ``\\u`` escapes).

The body is read with orjson (C; the standard library with a hook per
object cost several times more per request). orjson takes the last of a
repeated key, reads an integer past 64 bits as a float, and its refusals are
not the standard library's, so a body it refuses, one with a run of 19
digits, or one where a repeated key cannot be ruled out (see
``_unique_and_shallow``), is read again the standard library's way: every
body is accepted or refused, and with the same message, as before.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import orjson

from burstgate_client.sidecar.sse import LONG_DIGITS
from burstgate_client.sidecar.tokens import prompt_count


class BadRequest(Exception):
    """A request the sidecar cannot admit as sent: 400, OpenAI-style."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    raw: bytes
    body: dict[str, Any]
    chat: bool
    model: str
    stream: bool
    client_wants_usage: bool  # stream_options.include_usage was true already
    max_tokens: int | None  # per choice, as the client asked (None: not given)
    choices: int  # n x the prompts (a /v1/completions batch)
    plain: bool = False  # read by orjson: only what it can write back (no NaN, no big ints)

    def admit_max_tokens(self, default: int) -> int:
        """Tokens to ask the admission for: every choice at its max."""
        return (self.max_tokens or default) * self.choices


def _positive_int(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BadRequest(f"{name} must be a positive integer, got {json.dumps(value)[:40]}", name)
    return value


# Deeper than any OpenAI request needs (a tool's JSON schema nests a few
# levels): a deeper body is refused before anything walks it (token counting,
# the rewrite for the engine), which Python's recursion would fail on.
MAX_DEPTH = 64


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refused when a key repeats (which value an engine
    would take is undefined)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise BadRequest(f"the request body repeats the key {key[:40]!r}")
            seen.add(key)
    return out


def _depth(value: Any) -> int:
    """How deeply ``value`` nests (iteratively: no recursion of our own)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict | list):
            deepest = max(deepest, d)
            if d > MAX_DEPTH:
                return d
            stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def _unique_and_shallow(raw: bytes, body: Any) -> bool:
    """Whether ``body`` (orjson's reading of ``raw``) repeats no key and
    nests at most MAX_DEPTH levels. Keys: every member of the text has one
    structural colon, so the colons of ``raw`` are its members plus the
    colons inside its strings; orjson's value has as many keys and string
    colons exactly when no member was dropped, i.e. no key repeated (a drop
    loses its key and never adds a colon). A colon can hide in a string as
    ``\\u003a``, which this count would miss: such a body is not judged here."""
    if b"\\u003" in raw:
        return False
    counted, deepest, stack = 0, 0, [(body, 1)]
    while stack:
        v, d = stack.pop()
        if type(v) is dict:
            deepest = max(deepest, d)
            counted += len(v)
            for k, x in v.items():
                counted += k.count(":")
                if type(x) is str:
                    counted += x.count(":")
                elif type(x) is dict or type(x) is list:
                    stack.append((x, d + 1))
        elif type(v) is list:
            deepest = max(deepest, d)
            for x in v:
                if type(x) is str:
                    counted += x.count(":")
                elif type(x) is dict or type(x) is list:
                    stack.append((x, d + 1))
        if deepest > MAX_DEPTH:
            return False
    return counted == raw.count(b":")


def _load(raw: bytes) -> tuple[dict[str, Any], bool]:
    """The body as an object, and whether orjson read it (else the standard
    library did, refusing repeated keys). Raises BadRequest."""
    if LONG_DIGITS.search(raw) is None:  # else orjson could read an int as a float
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
        else:
            if type(body) is dict and _unique_and_shallow(raw, body):
                return body, True
    try:
        body = json.loads(raw, object_pairs_hook=_object)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BadRequest("the request body is not valid JSON (UTF-8)") from None
    except RecursionError:
        raise BadRequest(f"the request body nests deeper than {MAX_DEPTH} levels") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if _depth(body) > MAX_DEPTH:
        raise BadRequest(f"the request body nests deeper than {MAX_DEPTH} levels")
    return body, False


def parse(raw: bytes, *, chat: bool) -> CompletionRequest:
    body, plain = _load(raw)
    model = body.get("model", "")
    if not isinstance(model, str):
        raise BadRequest("model must be a string", "model")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream must be a boolean", "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest("stream_options must be an object", "stream_options")
    cap = _positive_int(body, "max_completion_tokens") if chat else None
    given = _positive_int(body, "max_tokens")
    if cap is not None:
        given = min(cap, given) if given is not None else cap
    n = _positive_int(body, "n") or 1
    best_of = None if chat else _positive_int(body, "best_of")
    per_prompt = max(n, best_of or 0)  # best_of candidates are generated, then n returned
    return CompletionRequest(
        raw=raw, body=body, chat=chat, model=model, stream=stream,
        client_wants_usage=bool(options and options.get("include_usage") is True),
        max_tokens=given, choices=per_prompt * (1 if chat else prompt_count(body)), plain=plain,
    )  # fmt: skip


def forwarded_body(
    req: CompletionRequest, *, granted_max_tokens: int, fallback_model: str, default_max: int
) -> bytes:
    """The body to send the engine (see the module's docstring)."""
    total = granted_max_tokens if granted_max_tokens > 0 else req.admit_max_tokens(default_max)
    per_choice = max(1, total // req.choices)
    changes: dict[str, Any] = {}
    fields = [f for f in ("max_tokens", "max_completion_tokens") if req.body.get(f) is not None]
    for field in fields or ["max_tokens"]:
        current = req.body.get(field)
        if current is None or current > per_choice:
            changes[field] = per_choice
    if fallback_model and fallback_model != req.model:
        changes["model"] = fallback_model
    if req.stream and not req.client_wants_usage:
        changes["stream_options"] = {**(req.body.get("stream_options") or {}),
                                     "include_usage": True}  # fmt: skip
    if not changes:
        return req.raw
    if req.plain:
        return orjson.dumps({**req.body, **changes})
    return json.dumps({**req.body, **changes}, separators=(",", ":")).encode()
