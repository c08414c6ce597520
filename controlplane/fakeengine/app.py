"""The fake engine's HTTP API: the OpenAI-compatible subset vLLM serves.

- ``POST /v1/chat/completions`` and ``POST /v1/completions``, streamed
  (server-sent events, ``data: {...}`` chunks then ``data: [DONE]``; with
  ``stream_options.include_usage`` every chunk carries ``"usage": null``
  and a last chunk with no choices carries the usage) and not;
- ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (metrics.py).

How many tokens a request gets (so that a replay reproduces a trace):
the ``x-burstgate-output-tokens`` header when given, capped by
``max_tokens`` (``max_completion_tokens`` for chat) when that is given too;
else ``max_tokens``; else the server's ``default_max_tokens``. The answer's
``finish_reason`` is ``length`` when the cap decided, else ``stop``.
``x-burstgate-prompt-tokens`` sets the prompt's token count (else text.py
estimates it). Errors are OpenAI-style bodies (``error.message``, ``type``,
``param``, ``code``) with vLLM's statuses: 400 for a bad request, 404 for an
unknown model.

HTTP stack: aiohttp (server and client in one well-kept package; the
sidecar and the load generator use it too).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from controlplane.fakeengine.live import LiveEngine, LiveRequest, RequestTooLong
from controlplane.fakeengine.metrics import EngineMetrics
from controlplane.fakeengine.text import PrefixCache, chat_prompt, estimate_tokens, words

OUTPUT_TOKENS_HEADER = "x-burstgate-output-tokens"
PROMPT_TOKENS_HEADER = "x-burstgate-prompt-tokens"
MAX_HINT_TOKENS = 10_000_000


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str = "fake-llama"
    seed: int = 0
    default_max_tokens: int = 256


@dataclass(frozen=True, slots=True)
class Parsed:
    chat: bool
    prompt_text: str
    prompt_tokens: int
    output_tokens: int
    finish_reason: str
    stream: bool
    include_usage: bool
    request_seed: int | None
    n_choices: int


def _error(exc: BadRequest) -> web.Response:
    kind = "invalid_request_error" if exc.status < 500 else "server_error"
    body = {"error": {"message": str(exc), "type": kind, "param": exc.param,
                      "code": exc.code}}  # fmt: skip
    return web.json_response(body, status=exc.status)


def _int_field(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BadRequest(f"{name} must be a positive integer, got {value!r}", name)
    return value


def _hint(request: web.Request, header: str) -> int | None:
    raw = request.headers.get(header)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if not 0 <= value <= MAX_HINT_TOKENS:
        raise BadRequest(f"header {header}: expected 0..{MAX_HINT_TOKENS}, got {raw[:40]!r}")
    return value


def _prompt_text(body: dict[str, Any], chat: bool) -> str:
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list", "messages")
        parts: list[str] = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise BadRequest(f"messages[{i}] must be an object with a role", "messages")
            content = m.get("content", "")
            if isinstance(content, list):  # content parts: the text ones count
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            if content is not None and not isinstance(content, str):
                raise BadRequest(f"messages[{i}].content must be a string or parts", "messages")
            parts.append(f"{m['role']}: {content or ''}")
        return chat_prompt(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise BadRequest("prompt must be a string", "prompt")
    return prompt


def parse(request: web.Request, body: Any, chat: bool, cfg: EngineConfig) -> Parsed:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model = body.get("model")
    if model != cfg.model:
        raise BadRequest(f"The model `{model}` does not exist.", "model", 404, "model_not_found")
    n = _int_field(body, "n") or 1
    if n != 1:
        raise BadRequest("only n=1 is supported by the fake engine", "n")
    text = _prompt_text(body, chat)
    cap = _int_field(body, "max_completion_tokens") if chat else None
    cap = cap or _int_field(body, "max_tokens")
    hint = _hint(request, OUTPUT_TOKENS_HEADER)
    if hint is not None:
        output = min(max(1, hint), cap) if cap else max(1, hint)
        reason = "length" if cap is not None and hint >= cap else "stop"
    else:
        output = cap or cfg.default_max_tokens
        reason = "length"
    prompt_hint = _hint(request, PROMPT_TOKENS_HEADER)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream must be a boolean", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise BadRequest("stream_options must be an object", "stream_options")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise BadRequest("seed must be an integer", "seed")
    return Parsed(
        chat=chat,
        prompt_text=text,
        prompt_tokens=max(1, prompt_hint) if prompt_hint is not None else estimate_tokens(text),
        output_tokens=output,
        finish_reason=reason,
        stream=stream,
        include_usage=stream and options.get("include_usage") is True,
        request_seed=seed,
        n_choices=n,
    )


class FakeEngineApp:
    """The aiohttp application around one :class:`LiveEngine`."""

    def __init__(self, live: LiveEngine, cfg: EngineConfig) -> None:
        self.live = live
        self.cfg = cfg
        self.metrics = EngineMetrics(live, cfg.model)
        p = live.params
        self.cache = PrefixCache(p.block_size, p.kv_blocks)
        self.app = web.Application(client_max_size=8 * 1024 * 1024)
        self.app.router.add_post("/v1/chat/completions", self.chat)
        self.app.router.add_post("/v1/completions", self.completions)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/metrics", self.scrape)

    async def health(self, _: web.Request) -> web.Response:
        return web.Response(text="")

    async def scrape(self, _: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.metrics.registry),
            headers={"Content-Type": CONTENT_TYPE_LATEST},
        )

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{
            "id": self.cfg.model, "object": "model", "created": int(time.time()),
            "owned_by": "burstgate", "root": self.cfg.model, "parent": None,
            "max_model_len": self.live.params.kv_capacity_tokens,
        }]})  # fmt: skip

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, chat=False)

    async def _complete(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        try:
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise BadRequest("the request body is not valid JSON") from None
            req = parse(request, body, chat, self.cfg)
            cached = self.cache.lookup_and_insert(req.prompt_text, req.prompt_tokens)
            live = self.live.submit(req.prompt_tokens, req.output_tokens, cached)
        except RequestTooLong as exc:
            return _error(BadRequest(
                f"This model's maximum context length is {self.live.params.kv_capacity_tokens} "
                f"tokens; {exc}", "messages" if chat else "prompt",
            ))  # fmt: skip
        except BadRequest as exc:
            return _error(exc)
        self.metrics.prompt(req.prompt_tokens, cached)
        text = words(req.output_tokens, seed=self.cfg.seed, request_seed=req.request_seed,
                     prompt=req.prompt_text)  # fmt: skip
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        try:
            if req.stream:
                return await self._stream(request, req, live, text, ident)
            await self._wait(live)
        except BaseException:
            self.live.abort(live)  # the client went away (or the server stops)
            self.metrics.finished("abort")
            raise
        self.metrics.finished(req.finish_reason)
        return web.json_response(self._whole(req, live, "".join(text), ident))

    @staticmethod
    async def _wait(live: LiveRequest) -> None:
        while await live.tokens.get() is not None:
            pass

    def _usage(self, req: Parsed, live: LiveRequest) -> dict[str, Any]:
        return {
            "prompt_tokens": req.prompt_tokens,
            "completion_tokens": req.output_tokens,
            "total_tokens": req.prompt_tokens + req.output_tokens,
            "prompt_tokens_details": {"cached_tokens": live.cached_tokens},
        }

    def _whole(self, req: Parsed, live: LiveRequest, text: str, ident: str) -> dict[str, Any]:
        created = int(time.time())
        if req.chat:
            choice: dict[str, Any] = {
                "index": 0, "message": {"role": "assistant", "content": text},
                "logprobs": None, "finish_reason": req.finish_reason,
            }  # fmt: skip
            kind = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None,
                      "finish_reason": req.finish_reason}  # fmt: skip
            kind = "text_completion"
        return {"id": ident, "object": kind, "created": created, "model": self.cfg.model,
                "choices": [choice], "usage": self._usage(req, live)}  # fmt: skip

    async def _stream(
        self, request: web.Request, req: Parsed, live: LiveRequest, text: list[str], ident: str
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})  # fmt: skip
        await resp.prepare(request)
        created = int(time.time())
        kind = "chat.completion.chunk" if req.chat else "text_completion"

        async def send(choices: list[dict[str, Any]], usage: Any = None) -> None:
            chunk: dict[str, Any] = {"id": ident, "object": kind, "created": created,
                                     "model": self.cfg.model, "choices": choices}  # fmt: skip
            if req.include_usage:
                chunk["usage"] = usage
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")

        def choice(piece: str, finish: str | None) -> dict[str, Any]:
            if req.chat:
                delta = {"content": piece} if piece or finish is None else {}
                return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {"index": 0, "text": piece, "logprobs": None, "finish_reason": finish}

        if req.chat:  # the role comes first, as vLLM sends it
            await send([{"index": 0, "delta": {"role": "assistant", "content": ""},
                         "logprobs": None, "finish_reason": None}])  # fmt: skip
        sent = 0
        while (new := await live.tokens.get()) is not None:
            await send([choice("".join(text[sent : sent + new]), None)])
            sent += new
        await send([choice("", req.finish_reason)])
        if req.include_usage:
            await send([], self._usage(req, live))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        self.metrics.finished(req.finish_reason)
        return resp
