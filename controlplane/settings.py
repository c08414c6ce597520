"""One typed settings object; every default lives here.

Values come from ``BURSTGATE_*`` environment variables (and a ``.env`` file if
present); a bad value is reported by its variable name at start.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from controlplane.policy import Policy

DEFAULT_SQLITE_PATH = Path("var") / "burstgate.db"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="BURSTGATE_", env_file=".env", env_nested_delimiter="__", extra="ignore"
    )

    # Storage. SQLite is the embedded default; PostgreSQL through psycopg 3
    # ("postgresql://..." is rewritten to the psycopg dialect).
    database_url: str = f"sqlite:///{DEFAULT_SQLITE_PATH}"

    # gRPC listener. Port 0 asks the OS for a free port (printed at start).
    host: str = "127.0.0.1"
    port: int = Field(default=50051, ge=0, le=65535)
    # grpc's own default receive limit; a bigger message is refused with
    # RESOURCE_EXHAUSTED before it reaches our code.
    max_message_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    # Prometheus /metrics on this port (same host); -1 disables, 0 = any free port.
    # 9464 is the port OpenTelemetry's Prometheus exporter uses by convention.
    metrics_port: int = Field(default=9464, ge=-1, le=65535)
    # Seconds SIGTERM waits for in-flight RPCs before cancelling them.
    shutdown_grace_s: float = Field(default=10.0, ge=0)

    # Admission.
    # An admitted request that is never settled gives its slot back after this.
    reservation_ttl_s: float = Field(default=600.0, gt=0)
    # A refused request_id replays its decision (duplicate=true) until its
    # retry_after has passed, but never for longer than this.
    rejection_replay_s: float = Field(default=1.0, ge=0)
    # retry_after hint for CONCURRENCY refusals: the plane cannot know when a
    # slot frees, so it suggests a short fixed wait.
    concurrency_retry_ms: int = Field(default=250, ge=0)
    # Requests from tenant ids that are not configured: refused with
    # UNKNOWN_TENANT, or, when this names a configured tenant, admitted
    # against that tenant's limits (one shared bucket for all unknown ids).
    default_tenant: str | None = None
    # Most entries one AdmitStream message may carry.
    max_batch: int = Field(default=10_000, ge=1)
    # A pool's load report counts as fresh for this long.
    load_report_stale_s: float = Field(default=10.0, gt=0)
    # How often the server re-reads tenants from the database so that
    # `burstgate tenant ...` changes reach a running server.
    config_poll_s: float = Field(default=2.0, gt=0)

    # Burst-shaping policy defaults (BURSTGATE_POLICY__BP_HARD_THRESHOLD=0.9 ...);
    # operators override them live through the admin API.
    policy: Policy = Policy()

    # Logging: "console" for people, "json" for log pipelines.
    log_format: Literal["console", "json"] = "console"
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @field_validator("database_url")
    @classmethod
    def _known_scheme(cls, v: str) -> str:
        if not v.startswith(("sqlite:", "postgresql:", "postgresql+psycopg:", "postgres:")):
            raise ValueError("must be a sqlite:/// or postgresql:// URL")
        return v


def sqlalchemy_url(url: str) -> str:
    """Normalise a user-facing URL to the SQLAlchemy dialect we ship."""
    if url.startswith("postgres://"):
        url = "postgresql://" + url[len("postgres://") :]
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url[len("postgresql://") :]
    return url
