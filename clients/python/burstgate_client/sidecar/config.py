"""The sidecar's configuration: a YAML file (``--config sidecar.yaml``) and
the command line's flags for the common fields, validated together.

Every error names its field the way the file spells it
(``lanes.premium.max_wait_ms: ...``), flags included (``--upstream: ...``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from burstgate_client.admin import TlsFiles
from burstgate_client.errors import InvalidArgument, excerpt

# How many tokens a request that names no max_tokens is admitted for: the
# forwarded request then carries max_tokens = what was granted, so that the
# engine cannot generate more than the reservation (docs/sidecar.md).
DEFAULT_MAX_TOKENS = 1024
# The completion spool's file name when no spool_path is given.
DEFAULT_SPOOL = "burstgate-sidecar-spool.jsonl"


class FailPolicyName(StrEnum):
    OPEN = "open"
    CLOSED = "closed"


class EngineKind(StrEnum):
    VLLM = "vllm"
    SGLANG = "sglang"
    TGI = "tgi"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LaneSettings(_Strict):
    """What the sidecar does for one lane (the control plane's lanes are
    configured there; these are the sidecar's own choices)."""

    # While the control plane is unreachable: open = forward (admitted
    # locally, settled when it is back), closed = answer 503.
    fail_policy: FailPolicyName = FailPolicyName.CLOSED
    # How long a request may be held in burstgate's gate (the Admit's
    # deadline); past it the request is refused (429, QUEUE_TIMEOUT).
    max_wait_ms: int = Field(default=2250, ge=0, le=3_600_000)


# The server's default bound is (1 - gate_release_headroom) x the lane's
# TTFT SLO (750 ms / 2.25 s / 11.25 s): the same here, so that a held
# request is answered by the server's QUEUE_TIMEOUT, not by a client timeout.
DEFAULT_LANES: dict[str, LaneSettings] = {
    "premium": LaneSettings(fail_policy=FailPolicyName.OPEN, max_wait_ms=750),
    "standard": LaneSettings(fail_policy=FailPolicyName.CLOSED, max_wait_ms=2250),
    "batch": LaneSettings(fail_policy=FailPolicyName.CLOSED, max_wait_ms=11250),
}


# The load report's fields a metric can feed (scrape.py says how each is read).
REPORT_FIELDS = ("queue_depth", "requests_running", "kv_cache_usage", "batch_tokens",
                 "prefix_cache_hits", "prefix_cache_queries", "prefix_cache_hit_rate",
                 "gpu_utilization")  # fmt: skip


class MetricsSettings(_Strict):
    """Scraping the engine's Prometheus /metrics into ReportLoad."""

    enabled: bool = True
    url: str | None = None  # default: the upstream's /metrics
    interval_s: float = Field(default=0.2, ge=0.05, le=60)
    engine: EngineKind = EngineKind.VLLM
    # Report field -> metric name(s) (the first one present wins), over the
    # engine kind's preset (scrape.py lists the presets and the fields).
    names: dict[str, str | list[str]] = {}
    engine_id: str | None = Field(default=None, min_length=1, max_length=128)  # default: host:port
    # The engine's --max-num-batched-tokens and --max-num-seqs (not on /metrics;
    # the defaults are vLLM's for online serving). With max_num_seqs the pool
    # gate lets releases into the engine's free slots; without it, every
    # release between two reports counts as one that will wait, and the gate
    # lets about two per engine per report interval through.
    max_batch_tokens: int = Field(default=8192, gt=0, le=10**12)
    max_num_seqs: int | None = Field(default=256, gt=0, le=10**12)
    queue_capacity: int = Field(default=0, ge=0, le=10**12)  # 0 = unbounded (vLLM)

    @field_validator("names")
    @classmethod
    def _fields(cls, v: dict[str, str | list[str]]) -> dict[str, str | list[str]]:
        for field, names in v.items():
            if field not in REPORT_FIELDS:
                fields = ", ".join(REPORT_FIELDS)
                raise ValueError(f"{excerpt(field)} is not a report field; one of {fields}")
            listed = [names] if isinstance(names, str) else names
            if not listed or not all(listed):
                raise ValueError(f"{field}: expected one or more metric names")
        return v


class SidecarConfig(_Strict):
    # Where to listen, and the engine (its origin: scheme://host:port).
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    upstream: str
    # Replaces the client's Authorization towards the engine (vLLM --api-key);
    # None: the client's header goes through unchanged.
    upstream_api_key: str | None = None
    upstream_timeout_s: float = Field(default=600.0, gt=0)  # between two reads of an answer
    upstream_max_connections: int = Field(default=4096, ge=1)
    max_body_bytes: int = Field(default=32 * 1024 * 1024, ge=1024)  # a request's body

    # The control plane: one address, or several replicas' comma-separated
    # ("cp-0:50051,cp-1:50051"; the SDK follows owner redirects, docs/ha.md).
    control_plane: str
    control_plane_api_key: str | None = None  # None: $BURSTGATE_API_KEY
    # TLS to the control plane (its BURSTGATE_TLS_CERT_FILE): the CA that
    # signed its certificate, and for mTLS (BURSTGATE_TLS_CLIENT_CA_FILE)
    # this sidecar's certificate and key; server_name: the name checked
    # against its certificate when the address is not that name. No CA and
    # no certificate: plaintext.
    control_plane_tls_ca: Path | None = None
    control_plane_tls_cert: Path | None = None
    control_plane_tls_key: Path | None = None
    control_plane_tls_server_name: str | None = Field(default=None, min_length=1)
    # Completes the control plane has not acknowledged, on disk (a restarted
    # sidecar delivers them): on by default at DEFAULT_SPOOL under
    # $STATE_DIRECTORY (systemd's StateDirectory=) or the working directory;
    # spool_path chooses the file; spool: false keeps them in memory only,
    # and what is pending at shutdown is lost (spool_file() says which).
    spool: bool = True
    spool_path: Path | None = None
    # One JSON line per completions request (accesslog.py): "-" = stdout,
    # else a file appended to; None = off.
    access_log: str | None = Field(default=None, min_length=1)

    # Who and where. The API key map wins over the tenant header, which is
    # off by default: whoever can send it picks the tenant that is billed,
    # so it is for a trusted gateway in front that sets it (and strips the
    # clients' own), e.g. tenant_header: x-burstgate-tenant.
    api_keys: dict[str, str] = {}
    tenant_header: str | None = None
    default_tenant: str | None = None  # neither key nor header: this tenant, else 401
    lane_header: str | None = "x-burstgate-lane"
    tenant_lanes: dict[str, str] = {}  # tenant -> its default lane (else the server's)
    pool: str = Field(default="default", min_length=1, max_length=128)
    lanes: dict[str, LaneSettings] = Field(default_factory=lambda: dict(DEFAULT_LANES))
    default_lane: LaneSettings = LaneSettings()  # a lane not listed, or none known

    # Token counts before forwarding.
    tokenizer: Path | None = None  # a HF tokenizer.json (pip install 'burstgate-client[tokenizer]')
    default_max_tokens: int = Field(default=DEFAULT_MAX_TOKENS, gt=0, le=10_000_000)

    metrics: MetricsSettings = MetricsSettings()
    drain_timeout_s: float = Field(default=30.0, ge=0)
    limits_timeout_s: float = Field(default=0.05, gt=0)  # GetLimits for the 429 headers
    unavailable_retry_after_s: int = Field(default=1, ge=0)  # 503 when fail-closed

    @field_validator("control_plane")
    @classmethod
    def _control_plane(cls, v: str) -> str:
        from burstgate_client.redirects import targets

        return ",".join(targets(v))  # ValueError when no address is left

    @field_validator("upstream")
    @classmethod
    def _origin(cls, v: str) -> str:
        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"expected http(s)://host:port, got {excerpt(v)}")
        if parts.path.rstrip("/") not in ("", "/v1") or parts.query or parts.fragment:
            raise ValueError(f"expected the engine's origin without a path, got {excerpt(v)}")
        return f"{parts.scheme}://{parts.netloc}"  # the /v1 of an OpenAI base_url is dropped

    @field_validator("tenant_header", "lane_header")
    @classmethod
    def _header(cls, v: str | None) -> str | None:
        if v is not None and (not v or not all(c.isalnum() or c in "-_" for c in v)):
            raise ValueError(f"expected an HTTP header name, got {excerpt(v)}")
        return v.lower() if v else v

    @field_validator("api_keys", "tenant_lanes")
    @classmethod
    def _non_empty(cls, v: dict[str, str]) -> dict[str, str]:
        for key, value in v.items():
            if not key or not value:
                raise ValueError(f"empty key or value: {excerpt(key)}: {excerpt(value)}")
        return v

    @field_validator("control_plane_tls_ca", "control_plane_tls_cert", "control_plane_tls_key")
    @classmethod
    def _readable(cls, v: Path | None) -> Path | None:
        # read at start-up, so that a wrong path is this error, not a failed
        # handshake on the first request
        if v is not None:
            try:
                v.read_bytes()
            except OSError as exc:
                raise ValueError(f"cannot read {v}: {exc.strerror or exc}") from None
        return v

    @model_validator(mode="after")
    def _tls_pair(self) -> SidecarConfig:
        if (self.control_plane_tls_cert is None) != (self.control_plane_tls_key is None):
            raise ValueError(
                "control_plane_tls_cert and control_plane_tls_key go together (mTLS)"
            )
        return self

    def tls_files(self) -> TlsFiles | None:
        """The SDK's TLS files for the control plane; None: plaintext."""
        if self.control_plane_tls_ca is None and self.control_plane_tls_cert is None:
            return None
        return TlsFiles(
            ca=self.control_plane_tls_ca, cert=self.control_plane_tls_cert,
            key=self.control_plane_tls_key, server_name=self.control_plane_tls_server_name,
        )  # fmt: skip

    def lane(self, name: str) -> LaneSettings:
        return self.lanes.get(name, self.default_lane)

    def spool_file(self, env: Mapping[str, str] | None = None) -> Path | None:
        """The completion spool's file: ``spool_path`` when given, else
        DEFAULT_SPOOL under ``$STATE_DIRECTORY`` (its first entry: systemd
        passes a colon-separated list) or the working directory; None when
        ``spool`` is false."""
        if not self.spool:
            return None
        if self.spool_path is not None:
            return self.spool_path
        state = (os.environ if env is None else env).get("STATE_DIRECTORY", "")
        base = Path(state.split(":")[0]) if state else Path.cwd()
        return (base / DEFAULT_SPOOL).absolute()


def spool_line(spool: Path | None) -> str:
    """The start-up line that says where the completion spool is."""
    if spool is None:
        return ("completion spool: off (spool: false / --no-spool): Completes not delivered "
                "at shutdown are lost")  # fmt: skip
    return (f"completion spool: {spool} (Completes the control plane has not acknowledged "
            "are kept there and delivered after a restart)")  # fmt: skip


# Command-line flags -> the config field they set.
FLAG_FIELDS = {
    "upstream": "--upstream", "control_plane": "--control-plane", "host": "--host",
    "port": "--port", "pool": "--pool", "tokenizer": "--tokenizer",
    "control_plane_api_key": "--api-key", "default_tenant": "--default-tenant",
    "spool_path": "--spool", "spool": "--no-spool", "access_log": "--access-log",
    "control_plane_tls_ca": "--tls-ca", "control_plane_tls_cert": "--tls-cert",
    "control_plane_tls_key": "--tls-key", "control_plane_tls_server_name": "--tls-server-name",
}  # fmt: skip


def load(path: Path | None = None, **flags: Any) -> SidecarConfig:
    """The file's settings (if any), the flags that are not None over them.
    Raises InvalidArgument naming the field (or the flag)."""
    raw: dict[str, Any] = {}
    where = "config"
    if path is not None:
        where = str(path)
        try:
            loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise InvalidArgument("--config", f"cannot read {path}: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise InvalidArgument("--config", f"{path} is not valid YAML: {exc}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise InvalidArgument("--config", f"{path}: expected a mapping at the top level")
        raw = dict(loaded or {})
    from_flag = {k for k, v in flags.items() if v is not None}
    if flags.get("spool") is False and flags.get("spool_path") is not None:
        raise InvalidArgument("--no-spool", "cannot be given with --spool PATH")
    raw.update({k: v for k, v in flags.items() if v is not None})
    # The flags override the file's spool settings as a pair.
    if "spool_path" in from_flag:
        raw["spool"] = True
    elif "spool" in from_flag:
        raw.pop("spool_path", None)
    for name in ("upstream", "control_plane"):
        if name not in raw:
            raise InvalidArgument(FLAG_FIELDS[name], f"required (or `{name}:` in --config)")
    cert, key = raw.get("control_plane_tls_cert"), raw.get("control_plane_tls_key")
    if (cert is None) != (key is None):  # (the model says so too, without naming a field)
        missing = "control_plane_tls_key" if key is None else "control_plane_tls_cert"
        given = "control_plane_tls_cert" if key is None else "control_plane_tls_key"
        field = FLAG_FIELDS[missing] if given in from_flag else f"{where}: {missing}"
        raise InvalidArgument(field, f"required with {FLAG_FIELDS[given]} (mTLS takes both)")
    try:
        cfg = SidecarConfig.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        field = FLAG_FIELDS.get(loc, loc) if loc in from_flag else f"{where}: {loc}"
        message = first["msg"].removeprefix("Value error, ")
        raise InvalidArgument(field, message) from None
    if not cfg.spool and cfg.spool_path is not None:
        raise InvalidArgument(f"{where}: spool", "false, but spool_path is set: drop one")
    return cfg
