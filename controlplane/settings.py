"""One typed settings object; every default lives here.

Values come from ``BURSTGATE_*`` environment variables (and a ``.env`` file if
present); a bad value is reported by its variable name at start.
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
    database_url: str = f"sqlite:///{DEFAULT_SQLITE_PATH}"

    # Bounds on the database (docs/operating.md, "When the database is down").
    # PostgreSQL: libpq's connect_timeout for every new connection, and a
    # server-side statement_timeout on the server's connections (0 = none).
    db_connect_timeout_s: int = Field(default=5, ge=1)
    db_statement_timeout_s: float = Field(default=30.0, ge=0)
    # The longest an operator RPC (AdminService, LedgerService) waits for the
    # database before it answers UNAVAILABLE; the config poll's steps are
    # bounded by it too. A hung database never answers, so without this bound
    # an operator call waits as long as the outage.
    operator_db_timeout_s: float = Field(default=5.0, gt=0)

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
    # Keepalive (README "Keepalive"; grpc core's channel options, in ms).
    # The server pings a connection after this long without traffic and
    # closes it when the ack takes longer than the timeout: a sidecar that
    # vanished without a FIN (pod killed, node lost) frees its connection and
    # streams within ~40 s, and the pings keep idle connections open through
    # load balancers and NATs (idle timeouts of minutes).
    keepalive_time_ms: int = Field(default=30_000, ge=1_000)
    keepalive_timeout_ms: int = Field(default=10_000, ge=1_000)
    # Client pings arriving closer together than this (with nothing sent by
    # the server in between) are strikes; the third ends the connection
    # (GOAWAY ENHANCE_YOUR_CALM "too_many_pings"). Half of the shortest
    # client interval the README allows (1 s), so timer jitter never counts.
    keepalive_min_ping_interval_ms: int = Field(default=500, ge=0)

    # Admission.
    # An admitted request that is never settled gives its slot back after this.
    reservation_ttl_s: float = Field(default=600.0, gt=0)
    # A completed request_id is remembered this long after its Complete (a
    # repeated Admit replays the admission, a repeated Complete answers
    # duplicate=true); then it is forgotten: a later Admit with the same id is
    # decided anew and a later Complete gets NOT_FOUND. The reservation TTL
    # above bounds only the unsettled ones, so memory follows the settlement
    # rate x this window, not x the TTL. Never longer than the TTL.
    settled_id_window_s: float = Field(default=120.0, ge=0)
    # A refused request_id replays its decision (duplicate=true) until its
    # retry_after has passed, but never for longer than this.
    rejection_replay_s: float = Field(default=1.0, ge=0)
    # Refused requests with a TTFT deadline remembered (their first arrival,
    # under their retry key, for the longest lane SLO) so that a retry is
    # judged against its first attempt's deadline (service/retries.py); the
    # oldest are forgotten past this many. ~150 bytes each.
    retry_memory: int = Field(default=262_144, ge=0)
    # retry_after hint for CONCURRENCY (and OPEN_RESERVATIONS) refusals: the
    # plane cannot know when a slot frees, so it suggests a short fixed wait.
    concurrency_retry_ms: int = Field(default=250, ge=0)
    # Memory protection: most open (admitted, unsettled) reservations held at
    # once, overall and per tenant; past either an Admit is refused with
    # OPEN_RESERVATIONS. Each costs a request-table row until Complete or the
    # TTL (~280 B compiled, BENCHMARKS.md): 1,000,000 is ~280 MB. 0 = no cap.
    max_open_reservations: int = Field(default=1_000_000, ge=0)
    max_open_reservations_per_tenant: int = Field(default=100_000, ge=0)
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
    # On PostgreSQL, also LISTEN for config changes (and lease releases) so
    # they apply at once; the poll stays the safety net. Turn off where
    # LISTEN cannot work: CockroachDB, or a transaction-pooling proxy
    # (PgBouncer in transaction mode) between server and database.
    listen_notify: bool = True

    # Autoscaling signals (docs/autoscaling.md, "Signals"): the share of an
    # engine's learned work rate a pool should run at, and how long a new
    # engine takes to serve (the horizon of burstgate_pool_desired_engines_predicted).
    autoscale_target_utilization: float = Field(default=0.8, gt=0, le=1)
    autoscale_engine_startup_s: float = Field(default=120.0, ge=0)

    # Burst-shaping policy defaults (BURSTGATE_POLICY__BP_HARD_THRESHOLD=0.9 ...);
    # operators override them live through the admin API.
    policy: Policy = Policy()

    # Logging: "console" for people, "json" for log pipelines.
    log_format: Literal["console", "json"] = "console"
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    # --- Admin API, security and observability (docs/operating.md) ---
    # The admin API (burstgate.v1.AdminService) always requires an API key.
    # The admission API requires a per-sidecar token (a key with role
    # "sidecar") unless this is off; `burstgate demo` turns it off.
    admission_auth: bool = True
    # TLS for the gRPC port (admission and admin alike): server certificate
    # and key (PEM). With tls_client_ca_file set, clients must present a
    # certificate signed by that CA (mTLS).
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    tls_client_ca_file: Path | None = None
    # The key admissions are signed with (docs/ha.md, "Signed admissions"):
    # 64+ hex digits (32+ random bytes, e.g. `openssl rand -hex 32`). Unset
    # (the default): a key created once in the database, shared by every
    # replica of it. When set, every replica must get the same value;
    # `_previous` is still accepted (rotation: the old key moves there).
    admission_signing_key: SecretStr | None = None
    admission_signing_key_previous: SecretStr | None = None
    # Fraction of admission RPCs (Admit, Complete, ReportLoad, AdmitStream
    # streams) that get an access log line; admin RPCs are always logged.
    # A line costs more CPU than the decision itself, hence off by default.
    admission_log_sample: float = Field(default=0.0, ge=0, le=1)
    # How often live gauges (in-flight tokens, per-pool backpressure, per-tenant
    # state) are sampled on the event loop for /metrics.
    metrics_sample_s: float = Field(default=1.0, gt=0)
    # Tenants with a `tenant` label value of their own (the first to be
    # counted); later ones share "__other__", so the label's cardinality is
    # bounded by config; 0 = every tenant under "__other__".
    metrics_tenant_label_limit: int = Field(default=50, ge=0)
    # OpenTelemetry tracing of the gRPC server (needs the `otel` extra): off,
    # console (spans printed to stderr) or otlp (to otlp_endpoint). Nothing
    # is exported unless configured here.
    tracing: Literal["off", "console", "otlp"] = "off"
    otlp_endpoint: str = "http://127.0.0.1:4317"
    tracing_service_name: str = "burstgate"

    # Envoy's rate-limit service (envoy.service.ratelimit.v3.RateLimitService)
    # on the same port, with this descriptor mapping file (docs/envoy.md);
    # unset = not served. The file is re-read when it changes.
    envoy_rls_config: Path | None = None

    # --- Metering: dual ledger, pricing windows, margin warnings (docs/ledger.md) ---
    # Record every Complete in the ledger and acknowledge it only once durable.
    # Off: Complete settles in memory only (no ledger, no money figures).
    ledger_enabled: bool = True
    # Local append-only spool for acknowledged records while the database is
    # unreachable or slow; replayed into it on recovery and at start. Unset:
    # "<sqlite file>.ledger-spool", or var/ledger-spool/<host>-<port>-<db>.
    ledger_spool_dir: Path | None = None
    # Bound of the spool (bytes): past it Complete answers UNAVAILABLE and
    # changes nothing. 256 MiB is about a million records.
    ledger_spool_max_bytes: int = Field(default=256 * 1024 * 1024, ge=4096)
    # Most records in one group commit (COPY / executemany + COMMIT).
    ledger_batch_max: int = Field(default=10_000, ge=1)
    # A ledger batch not committed after this long (s) is taken for a hung
    # database: its records go to the spool (fsynced, then acknowledged) and
    # so does every later batch until the database answers again. The wait
    # grows to 4x the median of recent batch times when the database is
    # merely busy, but never beyond ledger_db_timeout_s. (0.5 s: a healthy
    # PostgreSQL on a loaded 2-core machine was seen past 0.25 s now and then,
    # and each such batch flips the ledger to spooling for a retry period.)
    ledger_hang_after_s: float = Field(default=0.5, gt=0)
    ledger_db_timeout_s: float = Field(default=5.0, gt=0)
    # While spooling, how often (s) the database is tried again.
    ledger_retry_s: float = Field(default=1.0, gt=0)
    # Currency of a request priced at zero because the price catalog has no entry.
    ledger_default_currency: str = Field(default="USD", pattern=r"^[A-Z]{3}$")
    # A (tenant, model) the price catalog cannot price (no entry, and no
    # default ('*', '*') entry: the configured default price). "book": its
    # Completes are booked at 0, flagged (price_id 0), counted in
    # burstgate_ledger_unpriced_records_total and warned of once per tenant and
    # model. "refuse": Admit refuses it FAILED_PRECONDITION naming model
    # before anything is reserved (work already done is still booked).
    ledger_unpriced: Literal["book", "refuse"] = "book"
    # Complete refuses usage above this many times what was admitted (prompt,
    # or granted max_tokens) plus 1,024 tokens: a sidecar bug, not a bill.
    complete_max_overrun_ratio: float = Field(default=4.0, ge=1)
    # Pricing windows (SPEC section 4): whole seconds, aligned to the Unix epoch.
    pricing_window_s: int = Field(default=300, ge=1, le=86_400)
    # Step table as [threshold, multiplier] pairs, ascending: a window whose
    # cache-miss rate is above a threshold sets its multiplier for the next
    # window (the highest matched wins; else 1). JSON in the environment:
    # BURSTGATE_PRICING_STEPS='[["0.30","1.20"],["0.50","1.50"]]'.
    pricing_steps: list[tuple[Decimal, Decimal]] = [(Decimal("0.30"), Decimal("1.20"))]
    # Margin warning when a tenant's actual cost exceeds ratio x its user
    # charge over a pricing window (and over any period on demand).
    margin_warning_ratio: Decimal = Field(default=Decimal("1.15"), gt=0)

    # --- Scale-out (docs/ha.md; PostgreSQL only, ignored on SQLite) ---
    # What other replicas and clients dial to reach this one (host:port).
    # Unset: host:port of the gRPC listener, a wildcard host (0.0.0.0, ::)
    # replaced by this machine's hostname (``Settings.advertised``).
    advertise_address: str | None = None
    # This replica's member id in ha_members; unset: hostname-pid-random.
    ha_member_id: str | None = Field(default=None, min_length=1, max_length=200)
    # Cell lease time to live (s), renewed every ttl/3; a replica dead this
    # long loses its cells. The margin is how much earlier a replica stops
    # trusting its own lease (its clock against the database's).
    ha_lease_ttl_s: float = Field(default=5.0, gt=0, le=300)
    ha_margin_s: float = Field(default=1.0, ge=0)
    # A lone replica (the last member list it read had no other live member)
    # takes and renews its leases and tenant shares for this long instead,
    # so it keeps deciding through a database outage this long (less the
    # margin); the price: a replacement that starts under a new member id
    # after it crashed waits this long for its cells (docs/ha.md, "Database
    # outages"). A value at or below ha_lease_ttl_s turns this off.
    ha_lone_lease_ttl_s: float = Field(default=30.0, gt=0, le=3600)
    # Explicit cells: JSON object cell id -> list of pools
    # (BURSTGATE_HA_CELLS='{"eu": ["eu-1", "eu-2"]}'); pools not listed are
    # each a cell of their own, named after the pool.
    ha_cells: dict[str, list[str]] | None = None
    # A cell with no request routed to this replica for this long (and
    # nothing in flight in its pools) is released, and its lease row no
    # longer renewed; the next request claims it again (docs/ha.md, "Idle
    # cells"). Never shorter than reservation_ttl_s, so every reservation
    # admitted in the cell has ended first (``ha_cell_idle_release_s``).
    ha_cell_idle_s: float = Field(default=900.0, gt=0)
    # A test and diagnostic aid, off by default: append this replica's lease
    # validity intervals and fenced pricing-window writes to this file as
    # JSON lines (controlplane/ha/trace.py), so a harness can check across
    # processes that no cell had two owners at once.
    ha_trace_file: Path | None = None

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
