"""From a LiteLLM proxy request to burstgate's Admit and back: who pays,
which lane and pool, how many tokens, what an admission changes in the
request, and the usage LiteLLM reports. Pure functions over plain values
(the key is read by attribute, the request is LiteLLM's ``data`` dict), so
they are tested without a proxy (tests/unit/integrations/).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from burstgate_client.litellm.config import HookSettings, Rule
from burstgate_client.sidecar import headers as H
from burstgate_client.sidecar.tokens import TokenCounter

# LiteLLM call types the hook admits (chat and text completions, sync or
# async); other routes (embeddings, images, audio, ...) pass unadmitted.
CHAT_CALLS = frozenset({"completion", "acompletion"})
TEXT_CALLS = frozenset({"text_completion", "atext_completion"})


class NoTenant(Exception):
    """No rule yielded a tenant and there is no default_tenant."""


def _text(value: Any) -> str | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int | str):
        return str(value) or None
    return None


def _headers(data: Mapping[str, Any]) -> Mapping[str, Any]:
    """The request's headers as the proxy recorded them (lower-case names)."""
    for holder in (data.get("proxy_server_request"), data.get("metadata")):
        headers = holder.get("headers") if isinstance(holder, Mapping) else None
        if isinstance(headers, Mapping):
            return headers
    return {}


def read_rule(rule: Rule, key: Any, data: Mapping[str, Any]) -> str | None:
    """The value ``rule`` names, or None (absent, empty or not a string/int)."""
    if not rule.name:
        return _text(getattr(key, rule.source, None))
    if rule.source == "header":
        headers = _headers(data)
        value = headers.get(rule.name)
        if value is None:  # the proxy keeps the client's spelling
            value = next((v for k, v in headers.items() if k.lower() == rule.name), None)
        return _text(value)
    if rule.source == "request_metadata":
        source = data.get("metadata")
        # the proxy copies the client's metadata into requester_metadata too;
        # read that copy first: the proxy's own fields share "metadata"
        if isinstance(source, Mapping) and isinstance(source.get("requester_metadata"), Mapping):
            source = source["requester_metadata"]
    else:
        source = getattr(key, rule.source, None)
    return _text(source.get(rule.name)) if isinstance(source, Mapping) else None


def first_value(rules: list[Rule], key: Any, data: Mapping[str, Any]) -> str | None:
    for rule in rules:
        value = read_rule(rule, key, data)
        if value is not None:
            return value
    return None


@dataclass(frozen=True, slots=True)
class Target:
    tenant: str
    lane: str  # "" = the tenant's default lane (the server resolves it)
    model: str  # the model group the client asked for
    pool: str


def target(cfg: HookSettings, key: Any, data: Mapping[str, Any]) -> Target:
    """Tenant, lane, model and pool of a request; NoTenant when no rule and
    no default names a tenant."""
    found = first_value(cfg.tenant_from, key, data)
    if found is not None:
        tenant = cfg.tenant_map.get(found, found)
    elif cfg.default_tenant is not None:
        tenant = cfg.default_tenant
    else:
        rules = ", ".join(str(r) for r in cfg.tenant_from)
        raise NoTenant(f"no burstgate tenant for this request: tenant_from [{rules}] found "
                       "nothing and default_tenant is not set")  # fmt: skip
    lane = first_value(cfg.lane_from, key, data) or cfg.tenant_lanes.get(tenant, "")
    model = data.get("model")
    model = model if isinstance(model, str) else ""
    return Target(tenant, lane, model, cfg.pool_of(model))


# ------------------------------------------------------------------ tokens


def bytes_counter(data: Mapping[str, Any], chat: bool) -> int:
    """One token per 4 UTF-8 bytes, with the chat template's overheads
    (the sidecar's estimate)."""
    return TokenCounter().prompt_tokens(dict(data), chat)


def litellm_counter() -> Callable[[Mapping[str, Any], bool], int]:
    """litellm.token_counter with its default tokenizer: ``model=""``
    selects tiktoken's cl100k_base, which litellm ships (the model's own
    name could select a Hugging Face tokenizer, downloaded at first use).
    Falls back to the byte estimate on anything it cannot count."""
    import litellm

    def count(data: Mapping[str, Any], chat: bool) -> int:
        try:
            if chat:
                messages = data.get("messages")
                if not isinstance(messages, list):
                    return bytes_counter(data, chat)
                n = litellm.token_counter(model="", messages=messages)
            else:
                prompt = data.get("prompt")
                if isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
                    return len(prompt)  # token ids
                if not isinstance(prompt, str | list):
                    return bytes_counter(data, chat)
                n = litellm.token_counter(model="", text=prompt)
        except Exception:  # a shape litellm cannot count: estimate it instead
            return bytes_counter(data, chat)
        return max(1, int(n))

    return count


def _positive_int(data: Mapping[str, Any], name: str) -> int | None:
    value = data.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return None  # absent or bad: LiteLLM (or the provider) answers a bad one
    return value


def choices(data: Mapping[str, Any], chat: bool) -> int:
    """How many completions the request generates: n (best_of for a text
    completion) times the prompts of a text-completion batch."""
    n = _positive_int(data, "n") or 1
    if not chat:
        n = max(n, _positive_int(data, "best_of") or 0)
        prompt = data.get("prompt")
        if isinstance(prompt, list) and prompt and not all(isinstance(p, int) for p in prompt):
            n *= len(prompt)
    return n


def requested_max_tokens(data: Mapping[str, Any]) -> int | None:
    """The client's per-choice cap: the smaller of max_tokens and
    max_completion_tokens, None when it gave neither."""
    fields = ("max_tokens", "max_completion_tokens")
    given = [v for v in (_positive_int(data, f) for f in fields) if v is not None]
    return min(given) if given else None


def admit_max_tokens(data: Mapping[str, Any], chat: bool, default: int) -> int:
    return (requested_max_tokens(data) or default) * choices(data, chat)


def apply_admission(
    data: dict[str, Any], *, chat: bool, granted_max_tokens: int, fallback_model: str
) -> dict[str, Any]:
    """Change an admitted request in place, and return the changes: the
    token cap (``max_tokens`` or ``max_completion_tokens``, whichever the
    client set, else ``max_tokens``) lowered to the grant divided among the
    choices (a degradation cap is part of the grant; the engine must not
    generate more than was reserved), and the model swapped for the
    degradation's fallback model group."""
    changes: dict[str, Any] = {}
    if granted_max_tokens > 0:
        per_choice = max(1, granted_max_tokens // choices(data, chat))
        fields = [f for f in ("max_tokens", "max_completion_tokens") if data.get(f) is not None]
        for field in fields or ["max_tokens"]:
            current = data.get(field)
            if not isinstance(current, int) or isinstance(current, bool) or current > per_choice:
                changes[field] = per_choice
    if fallback_model and fallback_model != data.get("model"):
        changes["model"] = fallback_model
    data.update(changes)
    return changes


# ------------------------------------------------------------------- usage


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    generated_tokens: int
    cached_tokens: int


def _get(obj: Any, name: str) -> Any:
    return obj.get(name) if isinstance(obj, Mapping) else getattr(obj, name, None)


def _count(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        return None
    return int(value)


def usage_of(response: Any, kwargs: Mapping[str, Any] | None = None) -> Usage | None:
    """The usage LiteLLM reports for a finished call: the response's
    ``usage`` (an object or a dict; for a stream, the assembled response's),
    else the standard logging payload's token counts; None when neither has
    them."""
    usage = _get(response, "usage") if response is not None else None
    prompt = _count(_get(usage, "prompt_tokens")) if usage is not None else None
    generated = _count(_get(usage, "completion_tokens")) if usage is not None else None
    cached = 0
    if usage is not None:
        details = _get(usage, "prompt_tokens_details")
        cached = (_count(_get(details, "cached_tokens")) if details is not None else None) or 0
    if (prompt is None or generated is None) and kwargs is not None:
        payload = kwargs.get("standard_logging_object")
        if isinstance(payload, Mapping):
            prompt = _count(payload.get("prompt_tokens")) if prompt is None else prompt
            generated = _count(payload.get("completion_tokens")) if generated is None else generated
    if prompt is None or generated is None:
        return None
    return Usage(prompt, generated, min(cached, prompt))


def chunk_text_count(chunk: Any) -> int:
    """1 when a streamed chunk carries generated text (a decoding step:
    at least one token), else 0: the count of a stream cut before its
    usage came (the sidecar's rule)."""
    for choice in _get(chunk, "choices") or ():
        delta = _get(choice, "delta")
        text = _get(delta, "content") if delta is not None else _get(choice, "text")
        if isinstance(text, str) and text:
            return 1
    return 0


def unix_ns(value: Any) -> int:
    """A LiteLLM start/end time (a datetime, naive = local time, or epoch
    seconds) in Unix ns; 0 when it is neither."""
    if isinstance(value, datetime):
        return int(value.timestamp() * 1e9)
    if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
        return int(value * 1e9)
    return 0



# What a retry sends again unchanged: the parts of the request that name it.
_RETRY_FIELDS = ("model", "messages", "prompt", "max_tokens", "max_completion_tokens")


def retry_of(data: Mapping[str, Any], tenant: str) -> tuple[str, int]:
    """(retry key, attempt) of a proxy request, as the sidecar reads them
    (sidecar/headers.py ``retry_of``): the client's ``Idempotency-Key``,
    else a digest of the tenant and the request's own fields; the attempt
    from the openai client's ``x-stainless-retry-count``."""
    headers = {str(k).lower(): v for k, v in _headers(data).items() if isinstance(v, str)}
    body = json.dumps({k: data.get(k) for k in _RETRY_FIELDS}, sort_keys=True, default=str)
    return H.retry_of(headers, tenant, body.encode())
