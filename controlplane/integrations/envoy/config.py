"""The Envoy rate-limit service's configuration: a YAML file
(``BURSTGATE_ENVOY_RLS_CONFIG``) saying which descriptor entries carry the
tenant, lane, pool, model and request id, and the defaults (docs/envoy.md,
"Descriptor mapping").

The file is read at start (a bad file fails the start, naming the field) and
again by :class:`LiveConfig` whenever it changes on disk: a change is live at
the next call, a file that no longer parses is logged and the last good
mapping kept, as envoyproxy/ratelimit does with its own YAML.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from controlplane.domain.errors import InvalidArgument

log = structlog.get_logger("burstgate.envoy")

# What a request is reserved for when neither the request nor a descriptor
# sets hits_addend (the sidecar's default for a request without max_tokens).
DEFAULT_ESTIMATE_TOKENS = 1024
# Envoy's own default rate-limit call timeout is 20 ms: by default nothing
# waits in burstgate's queue (a held call would outlive it).
MAX_WAIT_LIMIT_MS = 60_000


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Keys(_Strict):
    """Descriptor entry keys (``RateLimitDescriptor.Entry.key``) burstgate
    reads; each may sit in any descriptor of the request."""

    tenant: str = Field(default="tenant", min_length=1)
    lane: str = Field(default="lane", min_length=1)
    pool: str = Field(default="pool", min_length=1)
    model: str = Field(default="model", min_length=1)
    request_id: str = Field(default="request_id", min_length=1)
    # "request" (default: reserve / check) or "response" (settle); Envoy's
    # apply_on_stream_done rate limit adds ("phase", "response").
    phase: str = Field(default="phase", min_length=1)
    # Optional split of the real usage on the response path (else the
    # hits_addend is booked as generated tokens).
    prompt_tokens: str = Field(default="prompt_tokens", min_length=1)
    completion_tokens: str = Field(default="completion_tokens", min_length=1)
    # Optional, request path: what stays the same across a request's
    # retries (the client's Idempotency-Key) and which attempt this is (the
    # openai client's x-stainless-retry-count): a retry is judged against
    # its first attempt's deadline (AdmitRequest.retry_key / attempt).
    retry_key: str = Field(default="retry_key", min_length=1)
    attempt: str = Field(default="attempt", min_length=1)
    # Optional, response path: "reported" (the split or hits_addend is the
    # answer's usage), "missing" (a successful answer carried no usage: it
    # is settled at its reservation, or at the usage given when more, never
    # at zero), "none" (an error or a refusal: nothing was generated).
    usage: str = Field(default="usage", min_length=1)

    @model_validator(mode="after")
    def _distinct(self) -> Keys:
        seen: dict[str, str] = {}
        for field, key in self.model_dump().items():
            if key in seen:
                raise ValueError(f"{field} and {seen[key]} name the same entry key {key!r}")
            seen[key] = field
        return self


class Defaults(_Strict):
    # The tenant when no entry carries one (None: such a request is refused).
    tenant: str | None = Field(default=None, min_length=1, max_length=128)
    lane: str = ""  # "" = the tenant's default lane
    pool: str = ""  # "" = the tenant's or lane's pool
    estimate_tokens: int = Field(default=DEFAULT_ESTIMATE_TOKENS, ge=1, le=1_000_000_000)


class EnvoyConfig(_Strict):
    # The filter's ``domain``; a request for another domain is refused.
    domain: str = Field(default="burstgate", min_length=1)
    descriptors: Keys = Keys()
    defaults: Defaults = Defaults()
    # How long a reserving call may wait in burstgate's lane queue (0 = answer
    # at once). Envoy's call timeout must be longer (docs/envoy.md).
    max_wait_ms: int = Field(default=0, ge=0, le=MAX_WAIT_LIMIT_MS)
    # x-ratelimit-limit/-remaining/-reset (and retry-after when over limit)
    # in response_headers_to_add.
    response_headers: bool = True


def parse(raw: Any, where: str = "envoy config") -> EnvoyConfig:
    """Validate a parsed YAML document; errors name ``where:field.path``."""
    try:
        return EnvoyConfig.model_validate(raw if raw is not None else {})
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"]) or "(top level)"
        raise InvalidArgument(f"{where}:{loc}", first["msg"]) from exc


def load(path: Path) -> EnvoyConfig:
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise InvalidArgument(str(path), f"cannot read the Envoy RLS config: {exc}") from exc
    return parse(raw, str(path))


@dataclass(frozen=True, slots=True)
class _Stamp:
    mtime_ns: int
    size: int
    inode: int


def _stamp(path: Path) -> _Stamp | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return _Stamp(st.st_mtime_ns, st.st_size, st.st_ino)


class LiveConfig:
    """The mapping in force, re-read when the file changes (``poll``)."""

    def __init__(self, path: Path | None, config: EnvoyConfig | None = None) -> None:
        self.path = path
        self._stamp = _stamp(path) if path is not None else None
        self.current = config if config is not None else (load(path) if path else EnvoyConfig())
        self.reloads = 0
        self.reload_failures = 0

    def poll(self) -> bool:
        """Re-read the file if it changed; True when a new mapping applies.
        A file that fails keeps the last good mapping (logged, counted)."""
        if self.path is None:
            return False
        stamp = _stamp(self.path)
        if stamp is None or stamp == self._stamp:
            return False
        self._stamp = stamp
        try:
            new = load(self.path)
        except InvalidArgument as exc:
            self.reload_failures += 1
            log.warning("envoy rls config not reloaded; keeping the last good one", error=str(exc))
            return False
        if new != self.current:
            self.current = new
            self.reloads += 1
            log.info("envoy rls config reloaded", path=str(self.path))
            return True
        return False
