"""One typed settings object; every default lives here.

Values come from ``BURSTGATE_*`` environment variables (and a ``.env`` file if
present); a bad value is reported by its variable name at start.

Long because: one field per setting, each with the description that
docs/configuration.md is generated from (tools/configdoc.py).
"""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from controlplane.domain.cells import CellMap
from controlplane.domain.policy import Policy

DEFAULT_SQLITE_PATH = Path("var") / "burstgate.db"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="BURSTGATE_", env_file=".env", env_nested_delimiter="__", extra="ignore"
    )

    # Storage. SQLite is the embedded default; PostgreSQL through psycopg 3
    # ("postgresql://..." is rewritten to the psycopg dialect).
    database_url: str = Field(
        default=f"sqlite:///{DEFAULT_SQLITE_PATH}",
        description="`sqlite:///path` or `postgresql://user@host/db` (psycopg 3).",
    )

    # Bounds on the database (docs/operating.md, "When the database is down").
    db_connect_timeout_s: int = Field(
        default=5,
        ge=1,
        description=(
            "PostgreSQL: libpq's `connect_timeout` for every new connection (server and CLI)."
        ),
    )
    db_statement_timeout_s: float = Field(
        default=30.0,
        ge=0,
        description=(
            "PostgreSQL: server-side `statement_timeout` on the server's connections; 0 = none."
        ),
    )
    # A hung database never answers, so without this bound an operator call
    # waits as long as the outage.
    operator_db_timeout_s: float = Field(
        default=5.0,
        gt=0,
        description=(
            "Longest an operator RPC (admin and ledger APIs) waits for the database before it "
            "answers `UNAVAILABLE` / `DATABASE_UNAVAILABLE`; also bounds each step of the "
            "config poll."
        ),
    )

    host: str = Field(default="127.0.0.1", description="Address of the gRPC listener.")
    port: int = Field(
        default=50051,
        ge=0,
        le=65535,
        description="Port of the gRPC listener; 0 = any free port (printed at start).",
    )
    # grpc's own default receive limit.
    max_message_bytes: int = Field(
        default=4 * 1024 * 1024,
        ge=1024,
        description="Largest gRPC message; a bigger one is refused `RESOURCE_EXHAUSTED` by grpc.",
    )
    # 9464 is the port OpenTelemetry's Prometheus exporter uses by convention.
    metrics_port: int = Field(
        default=9464,
        ge=-1,
        le=65535,
        description="Port of Prometheus `/metrics` (same host); -1 = off, 0 = any free port.",
    )
    shutdown_grace_s: float = Field(
        default=10.0,
        ge=0,
        description="On SIGTERM health turns `NOT_SERVING` and in-flight RPCs get this long.",
    )
    # Keepalive (docs/api.md, "Keepalive"): a sidecar that vanished without a
    # FIN (pod killed, node lost) frees its connection and streams within
    # ~40 s, and the pings keep idle connections open through load balancers
    # and NATs (idle timeouts of minutes).
    keepalive_time_ms: int = Field(
        default=30_000,
        ge=1_000,
        description="The server pings a connection after this long without traffic.",
    )
    keepalive_timeout_ms: int = Field(
        default=10_000,
        ge=1_000,
        description="The server closes a connection whose ping ack takes longer than this.",
    )
    # Half of the shortest client interval docs/api.md allows (1 s), so timer
    # jitter never counts.
    keepalive_min_ping_interval_ms: int = Field(
        default=500,
        ge=0,
        description=(
            "Client pings closer together than this (nothing sent by the server in between) are "
            "strikes; the third ends the connection (GOAWAY `ENHANCE_YOUR_CALM`)."
        ),
    )

    # Admission.
    reservation_ttl_s: float = Field(
        default=600.0,
        gt=0,
        description=(
            "An admitted request never settled is released after this, without a refund; "
            "a later Complete gets `NOT_FOUND`."
        ),
    )
    # The reservation TTL bounds only the unsettled ids, so memory follows the
    # settlement rate x this window, not x the TTL.
    settled_id_window_s: float = Field(
        default=120.0,
        ge=0,
        description=(
            "How long a settled request id is remembered after its Complete (a repeated Admit "
            "replays, a repeated Complete answers `duplicate=true`); never longer than the "
            "reservation TTL."
        ),
    )
    rejection_replay_s: float = Field(
        default=1.0,
        ge=0,
        description=(
            "Longest a refusal is replayed (`duplicate=true`) for a repeated request id; "
            "it replays only until its `retry_after_ms` has passed."
        ),
    )
    retry_memory: int = Field(
        default=262_144,
        ge=0,
        description=(
            "Refused requests remembered under their retry key so that a retry is judged against "
            "its first attempt's deadline; the oldest are forgotten past this many (~150 B each)."
        ),
    )
    # The plane cannot know when a slot frees, so it suggests a short fixed wait.
    concurrency_retry_ms: int = Field(
        default=250,
        ge=0,
        description="`retry_after_ms` hint of `CONCURRENCY` and `OPEN_RESERVATIONS` refusals.",
    )
    # Each open reservation costs a request-table row until Complete or the
    # TTL (~280 B compiled, docs/benchmarks-history.md): 1,000,000 is ~280 MB.
    max_open_reservations: int = Field(
        default=1_000_000,
        ge=0,
        description=(
            "Most open (admitted, unsettled) reservations at once, all tenants; then "
            "`OPEN_RESERVATIONS`. 0 = no cap."
        ),
    )
    max_open_reservations_per_tenant: int = Field(
        default=100_000,
        ge=0,
        description="Most open reservations at once for one tenant; 0 = no cap.",
    )
    default_tenant: str | None = Field(
        default=None,
        description=(
            "Tenant whose limits apply to unknown tenant ids (one shared bucket); "
            "unset: unknown ids are refused `UNKNOWN_TENANT`."
        ),
    )
    max_batch: int = Field(
        default=10_000, ge=1, description="Most entries one `AdmitStream` batch may carry."
    )
    load_report_stale_s: float = Field(
        default=10.0,
        gt=0,
        description="Age after which an engine's load report is stale.",
    )
    config_poll_s: float = Field(
        default=2.0,
        gt=0,
        description=(
            "How often the server re-reads tenants, lanes and policy from the database "
            "(the safety net behind `LISTEN/NOTIFY` on PostgreSQL)."
        ),
    )
    # LISTEN cannot work on CockroachDB or behind a transaction-pooling proxy.
    listen_notify: bool = Field(
        default=True,
        description=(
            "PostgreSQL: listen for config changes and lease releases so they apply at once "
            "(one more connection per server); "
            "`false` behind PgBouncer in transaction mode or on CockroachDB."
        ),
    )

    # Autoscaling signals (docs/autoscaling.md, "Signals").
    autoscale_target_utilization: float = Field(
        default=0.8,
        gt=0,
        le=1,
        description="Share of an engine's learned work rate a pool should run at.",
    )
    autoscale_engine_startup_s: float = Field(
        default=120.0,
        ge=0,
        description=(
            "How long a new engine takes to serve: the horizon of "
            "`burstgate_pool_desired_engines_predicted`."
        ),
    )

    # Operators override these live through the admin API.
    policy: Policy = Field(
        default=Policy(),
        description=(
            "Burst-shaping policy defaults, one variable per key "
            "(`BURSTGATE_POLICY__<KEY>`, listed below)."
        ),
    )

    log_format: Literal["console", "json"] = Field(
        default="console",
        description="`console` for people, `json` for log pipelines (use it in production).",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        default="info", description="Lowest level logged; `debug` adds tracebacks."
    )

    # --- Admin API, security and observability (docs/operating.md) ---
    # The admin API always requires an API key; `burstgate demo` turns
    # admission auth off.
    admission_auth: bool = Field(
        default=True,
        description=(
            "The admission API requires a `sidecar` key (`authorization: Bearer ...`); "
            "`burstgate demo` turns it off."
        ),
    )
    tls_cert_file: Path | None = Field(
        default=None, description="Server certificate (PEM) for the gRPC port; set with the key."
    )
    tls_key_file: Path | None = Field(
        default=None, description="Server private key (PEM, unencrypted) for the gRPC port."
    )
    tls_client_ca_file: Path | None = Field(
        default=None,
        description="mTLS: clients must present a certificate signed by this CA (PEM).",
    )
    # docs/security.md, "What is signed".
    admission_signing_key: SecretStr | None = Field(
        default=None,
        description=(
            "Key admissions are signed with (64+ hex digits, e.g. `openssl rand -hex 32`), the "
            "same on every replica; unset: a key made once in the database."
        ),
    )
    admission_signing_key_previous: SecretStr | None = Field(
        default=None,
        description="The previous signing key, still accepted while keys rotate.",
    )
    # A line costs more CPU than the decision itself, hence off by default.
    admission_log_sample: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description=(
            "Fraction of admission RPCs that get an access-log line; admin RPCs are always logged."
        ),
    )
    metrics_sample_s: float = Field(
        default=1.0,
        gt=0,
        description="How often live gauges (in-flight tokens, pools, tenants) are sampled.",
    )
    # Bounds the `tenant` label's cardinality by config.
    metrics_tenant_label_limit: int = Field(
        default=50,
        ge=0,
        description=(
            "Tenants with a `tenant` label value of their own (the first counted); later ones "
            "share `__other__`. 0 = all under `__other__`."
        ),
    )
    tracing: Literal["off", "console", "otlp"] = Field(
        default="off",
        description=(
            "OpenTelemetry tracing of the gRPC server (needs the `otel` extra): off, console "
            "(stderr) or otlp."
        ),
    )
    otlp_endpoint: str = Field(
        default="http://127.0.0.1:4317", description="Where `otlp` tracing sends spans."
    )
    tracing_service_name: str = Field(
        default="burstgate", description="The traces' `service.name`."
    )

    envoy_rls_config: Path | None = Field(
        default=None,
        description=(
            "Descriptor mapping file: serve Envoy's rate-limit service on the gRPC port "
            "(re-read when it changes); unset = not served."
        ),
    )

    # --- Metering: dual ledger, pricing windows, margin warnings (docs/ledger.md) ---
    ledger_enabled: bool = Field(
        default=True,
        description=(
            "Record every Complete in the ledger, acknowledged once durable; off: settle in "
            "memory only (no money figures)."
        ),
    )
    ledger_spool_dir: Path | None = Field(
        default=None,
        description=(
            "Local append-only spool for acknowledged records while the database is unreachable; "
            'unset: "<sqlite file>.ledger-spool", or var/ledger-spool/<host>-<port>-<db>.'
        ),
    )
    # 256 MiB is about a million records.
    ledger_spool_max_bytes: int = Field(
        default=256 * 1024 * 1024,
        ge=4096,
        description=(
            "Bound of the spool; past it Complete answers `UNAVAILABLE` and changes nothing."
        ),
    )
    ledger_batch_max: int = Field(
        default=10_000, ge=1, description="Most records in one ledger group commit."
    )
    # 0.5 s: a healthy PostgreSQL on a loaded 2-core machine was seen past
    # 0.25 s now and then, and each such batch flips the ledger to spooling
    # for a retry period.
    ledger_hang_after_s: float = Field(
        default=0.5,
        gt=0,
        description=(
            "A ledger batch not committed after this long is taken for a hung database and "
            "spooled (the wait grows to 4x recent batch times, up to the ledger timeout)."
        ),
    )
    ledger_db_timeout_s: float = Field(
        default=5.0, gt=0, description="Longest wait for a ledger batch on a busy database."
    )
    ledger_retry_s: float = Field(
        default=1.0, gt=0, description="While spooling, how often the database is tried again."
    )
    ledger_default_currency: str = Field(
        default="USD",
        pattern=r"^[A-Z]{3}$",
        description="Currency of a request priced at zero for want of a catalog entry.",
    )
    ledger_unpriced: Literal["book", "refuse"] = Field(
        default="book",
        description=(
            "A (tenant, model) with no price: `book` at 0, flagged and warned of, or `refuse` "
            "at Admit (`FAILED_PRECONDITION` naming `model`)."
        ),
    )
    # Usage far above what was admitted is a sidecar bug, not a bill.
    complete_max_overrun_ratio: float = Field(
        default=4.0,
        ge=1,
        description=(
            "Complete refuses usage above this many times what was admitted plus 1,024 tokens."
        ),
    )
    pricing_window_s: int = Field(
        default=300,
        ge=1,
        le=86_400,
        description="Length of a pricing window, aligned to the Unix epoch.",
    )
    pricing_steps: list[tuple[Decimal, Decimal]] = Field(
        default=[(Decimal("0.30"), Decimal("1.20"))],
        description=(
            "[threshold, multiplier] pairs, ascending: a window whose miss rate is above a "
            'threshold sets the next window\'s multiplier (JSON: `[["0.30","1.20"]]`).'
        ),
    )
    margin_warning_ratio: Decimal = Field(
        default=Decimal("1.15"),
        gt=0,
        description="Warn when a tenant's actual cost passes this ratio of its user charge.",
    )

    # --- Scale-out (docs/ha.md; PostgreSQL only, ignored on SQLite) ---
    advertise_address: str | None = Field(
        default=None,
        description=(
            "host:port other replicas and clients dial for this one; unset: the listener's, a "
            "wildcard host replaced by the hostname."
        ),
    )
    ha_member_id: str | None = Field(
        default=None,
        min_length=1,
        max_length=200,
        description=(
            "This replica's member id (a restart is a new member); unset: hostname-pid-random."
        ),
    )
    ha_lease_ttl_s: float = Field(
        default=5.0,
        gt=0,
        le=300,
        description=(
            "Cell lease time to live, renewed every TTL/3; a dead replica's cells move after it."
        ),
    )
    # Clock-rate safety: the replica's clock against the database's.
    ha_margin_s: float = Field(
        default=1.0,
        ge=0,
        description=(
            "How much earlier than the TTL a replica stops trusting its lease; below two thirds "
            "of the TTL."
        ),
    )
    # The price: a replacement under a new member id after a crash waits this
    # long for its cells.
    ha_lone_lease_ttl_s: float = Field(
        default=30.0,
        gt=0,
        le=3600,
        description=(
            "A lone replica's lease and share TTL: how long it keeps deciding through a database "
            "outage; at or below the lease TTL: off."
        ),
    )
    ha_cells: dict[str, list[str]] | None = Field(
        default=None,
        description=(
            'JSON `{"cell": ["pool", ...]}` grouping pools into cells; other pools are each a '
            "cell of their own."
        ),
    )
    # Never shorter than reservation_ttl_s (``ha_cell_idle_release_s``), so
    # every reservation admitted in the cell has ended first.
    ha_cell_idle_s: float = Field(
        default=900.0,
        gt=0,
        description="PostgreSQL: a cell with no request for this long is released.",
    )
    ha_trace_file: Path | None = Field(
        default=None,
        description=(
            "Test and diagnostic aid: append lease validity intervals and fenced writes here as "
            "JSON lines."
        ),
    )

    @field_validator("admission_signing_key", "admission_signing_key_previous")
    @classmethod
    def _signing_key(cls, v: SecretStr | None) -> SecretStr | None:
        if v is None:
            return v
        text = v.get_secret_value().strip()
        try:
            raw = bytes.fromhex(text)
        except ValueError:
            raise ValueError("must be hex digits (e.g. `openssl rand -hex 32`)") from None
        if len(raw) < 32:
            raise ValueError(f"must be at least 32 bytes (64 hex digits), got {len(raw)}")
        return SecretStr(text)

    @field_validator("advertise_address")
    @classmethod
    def _advertise(cls, v: str | None) -> str | None:
        if v is None:
            return None
        v = v.strip()
        host, sep, port = v.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
            raise ValueError(f"must be host:port with a port in 1..65535, got {v!r}")
        if host.strip("[]") in ("0.0.0.0", "::", ""):
            raise ValueError(f"must name a host others can dial, not a wildcard: {v!r}")
        return v

    @field_validator("ha_cells")
    @classmethod
    def _cells(cls, v: dict[str, list[str]] | None) -> dict[str, list[str]] | None:
        if v is not None:
            CellMap(v)  # raises ValueError naming the cell and pool
        return v

    @model_validator(mode="after")
    def _ha_timing(self) -> Settings:
        if not self.ha_margin_s < self.ha_lease_ttl_s * 2 / 3:
            # a renew every ttl/3 must land before the local validity ends
            raise ValueError(
                f"BURSTGATE_HA_MARGIN_S ({self.ha_margin_s:g}) must be below two thirds of "
                f"BURSTGATE_HA_LEASE_TTL_S ({self.ha_lease_ttl_s:g})"
            )
        return self

    @property
    def ha_cell_idle_release_s(self) -> float:
        """The idle time after which a cell is released: ``ha_cell_idle_s``,
        at least the reservation TTL."""
        return max(self.ha_cell_idle_s, self.reservation_ttl_s)

    def advertised(self, port: int | None = None) -> str:
        """The address other replicas and clients dial (``port``: the bound
        one, when the setting's port is 0)."""
        if self.advertise_address:
            return self.advertise_address
        import socket

        host = self.host
        if host.strip("[]") in ("0.0.0.0", "::", ""):
            host = socket.gethostname()
        elif ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"{host}:{self.port if port is None else port}"

    def member_id(self) -> str:
        """This replica's member id (the setting, else hostname-pid-random)."""
        if self.ha_member_id:
            return self.ha_member_id
        import os
        import secrets
        import socket

        return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"

    @field_validator("pricing_steps")
    @classmethod
    def _steps(cls, v: list[tuple[Decimal, Decimal]]) -> list[tuple[Decimal, Decimal]]:
        from controlplane.domain.pricing import StepTable

        StepTable(v)  # raises ValueError naming the problem
        return v

    @model_validator(mode="after")
    def _tls_pair(self) -> Settings:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError(
                "BURSTGATE_TLS_CERT_FILE and BURSTGATE_TLS_KEY_FILE must be set together"
            )
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError(
                "BURSTGATE_TLS_CLIENT_CA_FILE (mTLS) needs BURSTGATE_TLS_CERT_FILE and "
                "BURSTGATE_TLS_KEY_FILE"
            )
        return self

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
