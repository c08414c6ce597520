"""The composition root: settings -> store -> service -> gRPC server. Builds
the parts, starts them in order and stops them in order; the loops, health,
doors and scale-out wiring are in this package's other modules."""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import Awaitable, Callable, Sequence
from operator import attrgetter
from typing import TYPE_CHECKING, Any

import grpc
import structlog

from controlplane.auth import KeyCache
from controlplane.clock import Clock, Sleep, real_clock, real_sleep
from controlplane.domain.cells import CellMap
from controlplane.ha.serving import Ownership
from controlplane.rpc.admin import AdminServicer
from controlplane.rpc.assembly import create_server, keepalive_options
from controlplane.rpc.dbcall import DbCaller
from controlplane.rpc.owners import ensure_shares
from controlplane.server import gateways
from controlplane.server.health import ServerHealth
from controlplane.server.loops import ConfigLoop, ExpiryLoop, notify_listener
from controlplane.server.metering import metering_for, pricing_book, start_metering
from controlplane.server.replicas import ReplicaWiring
from controlplane.service import AdmissionService, ServiceLimits
from controlplane.service.waiting import WaitingRoom
from controlplane.settings import Settings
from controlplane.startup.network import port_error
from controlplane.store.audit import AuditLog
from controlplane.store.config import ConfigRepository
from controlplane.store.db import dispose_when_idle, make_engine
from controlplane.store.keys import KeyStore
from controlplane.store.replica_lock import ReplicaGuard, lock_for
from controlplane.telemetry.gcpause import GcPauses
from controlplane.telemetry.ledger_metrics import LedgerCollector
from controlplane.telemetry.live import LiveSampler
from controlplane.telemetry.metrics import RpcCollector, RpcStats, ServerCollector

if TYPE_CHECKING:
    from controlplane.integrations.envoy.servicer import RateLimitServicer

log = structlog.get_logger("burstgate.server")


class ControlPlane:
    """One running control plane: service, gRPC server and background tasks."""

    def __init__(
        self, settings: Settings, *, clock: Clock = real_clock, sleep: Sleep = real_sleep
    ) -> None:
        """``clock`` is the service's time; ``sleep`` is what the background
        loops (expiry, config poll, live sampling) wait with. Tests and
        simulations pass a ``controlplane.clock.ManualClock``'s pair, so
        those loops run when simulated time moves, not in real time."""
        s = self.settings = settings
        pricing = pricing_book(s)
        self.service = AdmissionService(ServiceLimits.of(s), clock=clock, pricing=pricing)
        self.waiting = WaitingRoom(self.service)
        self.engine = make_engine(
            s.database_url, connect_timeout_s=s.db_connect_timeout_s,
            statement_timeout_s=s.db_statement_timeout_s,
        )  # fmt: skip
        self.db_calls = DbCaller(s.operator_db_timeout_s)  # operator RPCs
        self.repo = ConfigRepository(self.engine)
        self.health = ServerHealth()
        # One serve per SQLite database (controlplane/store/replica_lock.py):
        # taken first thing at start, checked on every config poll, given up
        # at stop (a no-op on PostgreSQL, where replicas share cells instead).
        self.replica = ReplicaGuard(lock_for(s.database_url), self.health.replica)
        # Cell ownership (controlplane/ha, docs/ha.md): on PostgreSQL a
        # coordinator is attached at start; on SQLite every cell is ours.
        self.ownership = Ownership(None, CellMap(s.ha_cells))
        self.replicas = ReplicaWiring(s, self.ownership, self.service)
        # Admin API, auth and observability (rpc/admin.py, rpc/interceptor.py).
        self.audit_log = AuditLog(self.engine)
        self.key_store = KeyStore(self.engine)
        self.key_cache = KeyCache(self.key_store)
        self.rpc_stats = RpcStats()
        self.live = LiveSampler(
            self.service, interval_s=s.metrics_sample_s,
            tenant_label_limit=s.metrics_tenant_label_limit, sleep=sleep,
        )  # fmt: skip
        self.gc_pauses = GcPauses()  # timed while serving (start to stop)
        self.metering = metering_for(s, self.service, pricing, self.replicas, self.health.ledger)
        self.expiry = ExpiryLoop(self.service, self.waiting, sleep)
        self.config = ConfigLoop(
            s, service=self.service, waiting=self.waiting, ownership=self.ownership,
            repo=self.repo, engine=self.engine, key_cache=self.key_cache, replica=self.replica,
            metering=self.metering, sleep=sleep,
        )  # fmt: skip
        self.listener = notify_listener(s, self.config.wake.set, self.replicas.lease_released)
        # Collectors registered on /metrics at start (the Envoy gate adds its own).
        self.metrics_collectors: list[Any] = [
            RpcCollector(self.rpc_stats), ServerCollector(self.config), self.live.collector(),
            self.gc_pauses, self.ownership.collector(),
        ]  # fmt: skip
        if self.listener is not None:
            self.metrics_collectors.append(self.listener.collector())
        if self.metering is not None:
            self.metrics_collectors.append(LedgerCollector(self.metering))
        self.envoy_rls: RateLimitServicer | None = None  # when configured (docs/envoy.md)
        self.port = 0
        self.metrics_port: int | None = None
        self._metrics_httpd: Any = None
        self._tracer_provider: Any = None
        self._server: grpc.aio.Server | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._metering_started = False

    # The loops' counters, read off the plane by the admin API (GetStatus) and the tests.
    config_reloads = property(attrgetter("config.config_reloads"))
    config_reload_failures = property(attrgetter("config.config_reload_failures"))
    key_refresh_failures = property(attrgetter("config.key_refresh_failures"))
    notified_reloads = property(attrgetter("config.notified_reloads"))
    key_use_failures = property(attrgetter("config.key_use.failures"))

    async def load_config(self) -> bool:
        """Reload tenants and lanes when the database changed; True if applied."""
        return await self.config.load_config()

    async def poll_once(self) -> None:
        await self.config.poll_once()

    def expire_once(self) -> int:
        return self.expiry.once()

    async def ready_tenants(self, tenant_ids: Sequence[str]) -> None:
        """Wait (bounded: three share refreshes) until this replica holds a
        share of each tenant's limits (several replicas, or one on
        PostgreSQL: controlplane/ha/shares.py); at once otherwise. The admin
        API calls it so that a tenant it created is usable on every door,
        AdmitStream included, once the call returns."""
        await ensure_shares(self.ownership, self.service, tenant_ids)

    def epoch_for_pool(self, pool: str) -> tuple[str, int] | None:
        """(cell id, lease epoch) while this replica owns ``pool``'s cell, else
        None; on SQLite (cell, ``controlplane.ha.serving.LOCAL_EPOCH``): one
        replica, no fencing. What fenced single-writer writes carry."""
        return self.ownership.epoch_for_pool(pool)

    async def start(self) -> int:
        """Take the replica lock (ReplicaLockHeld when another serve has this
        database: nothing is bound), then start serving. A start that fails
        part-way stops what it started (the gRPC server, /metrics, the
        ledger) before the error is raised, so the process can exit."""
        await self.replica.acquire()
        try:
            return await self._start()
        except BaseException:
            await self._abort_start()
            await self.replica.release()
            raise

    async def _start(self) -> int:
        s = self.settings
        # What needs no database first: a bad TLS file or a tracing setting
        # fails the start before the database is read.
        interceptors, self._tracer_provider = gateways.interceptors(
            s, self.key_cache, self.db_calls, self.rpc_stats
        )
        credentials = gateways.credentials(s)
        self.envoy_rls = gateways.envoy_rls(
            s, self.service, self.waiting, self.ownership, self.metering, self.metrics_collectors
        )
        if self.envoy_rls is not None:
            self.config.envoy_config = self.envoy_rls.config
        await self.load_config()
        await asyncio.to_thread(self.key_cache.refresh)
        await self.config.load_signing_keys()
        self.live.sample()
        self.replicas.share_limits(self.engine)
        if self.metering is not None:
            self._metering_started = True
            await start_metering(self.metering)  # before serving
        admin = AdminServicer(
            self, self.repo, self.key_store, self.key_cache, self.audit_log, self.db_calls
        )
        try:
            self._server, self.port, self.health.servicer = create_server(
                self.service, f"{s.host}:{s.port}", max_message_bytes=s.max_message_bytes,
                waiting=self.waiting, interceptors=interceptors, admin=admin,
                credentials=credentials, ledger=self.metering, options=keepalive_options(s),
                db=self.db_calls, envoy_rls=self.envoy_rls, ownership=self.ownership,
            )  # fmt: skip
        except OSError:  # taken since the CLI's probe (or TLS refused by grpc core)
            raise port_error("gRPC", s.host, s.port, None) from None
        # /metrics is bound before the gRPC server starts: a metrics port in
        # use fails the start before any RPC is answered.
        self._metrics_httpd = gateways.serve_metrics(
            s, self.service, list(self.metrics_collectors), self.live.tenant_labels
        )
        if self._metrics_httpd is not None:
            self.metrics_port = self._metrics_httpd.server_port
        # Before SERVING: the first coordinator tick, so the cells assigned to
        # this replica are owned when the first request comes.
        await self.replicas.start(self.engine, self.port, self.config.pools)
        await self._server.start()
        self.gc_pauses.install()
        await self.health.serving(self.envoy_rls, self.metering)
        self._tasks = [
            asyncio.create_task(self.expiry.run(), name="expiry"),
            asyncio.create_task(self.config.run(notified=self.listener is not None),
                                name="config-poll"),
            asyncio.create_task(self.live.run(), name="live-sampler"),
        ]  # fmt: skip
        if self.listener is not None:
            self.listener.start()  # connects on its own thread; serving does not wait
        log.info(
            "serving", address=f"{s.host}:{self.port}", metrics_port=self.metrics_port,
            fastpath=self.service.implementation,
            database=self.engine.url.render_as_string(hide_password=True),
        )  # fmt: skip
        return self.port

    async def _abort_start(self) -> None:
        """Undo a start that failed part-way (best effort: the error that
        stopped the start is what gets reported)."""
        server, metering, listener = self._server, self.metering, self.listener
        steps: list[Callable[[], Awaitable[Any] | None]] = [
            self.ownership.drain,
            self.replicas.stop,
            lambda: server.stop(0) if server is not None else None,
            lambda: self.envoy_rls.close() if self.envoy_rls is not None else None,
            lambda: gateways.close_metrics(self._metrics_httpd),
            lambda: metering.stop() if metering is not None and self._metering_started else None,
            lambda: listener.stop() if listener is not None else None,
            self.engine.dispose,
        ]
        for step in steps:
            with contextlib.suppress(Exception):
                pending = step()
                if pending is not None:
                    await pending

    def freeze_gc(self) -> None:
        """Once serving: move everything built at start (modules, config,
        servicers: ~130k tracked objects) out of the collector's sight, so a
        full collection walks only what serving creates. Without it every
        full collection walks them all, a 60-70 ms pause of the event loop
        (and of every decision) on the benchmark machine. The request log's
        dict is made tracked first, or it would escape the freeze while
        empty and be walked, entry by entry, by every full collection once
        it fills. Whatever serves a plane calls this (``burstgate serve``'s
        process, the gRPC benchmark's server)."""
        self.service.prepare_gc_freeze()
        gc.freeze()

    async def stop(self, grace: float | None = None) -> None:
        """Graceful stop: hand the cells off first (released at once, so
        another replica takes them over), report NOT_SERVING, let in-flight
        RPCs finish."""
        await self.replicas.flush_before_drain()
        await self.ownership.drain()
        await self.replicas.stop()
        self.gc_pauses.uninstall()
        await self.health.shutting_down()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.listener is not None:
            await self.listener.stop()  # bounded: its own connection, not the engine's
            await self.config.catalog_reloads_done()
        if self._server is not None:
            await self._server.stop(self.settings.shutdown_grace_s if grace is None else grace)
        if self.envoy_rls is not None:
            await self.envoy_rls.close()  # after the calls that forward on them
        gateways.close_metrics(self._metrics_httpd)
        if self._tracer_provider is not None:
            self._tracer_provider.shutdown()
        # Operator calls still on a database thread (a hung database) finish
        # before any engine they use is disposed (the ledger's is, next).
        await asyncio.to_thread(self.db_calls.shutdown)
        if self.metering is not None:
            await self.metering.stop()  # writes (or spools) what is queued
        await self.config.calls.finish()  # a poll step cancelled mid-query: let its thread finish
        # HA calls (and takeover rebuilds) cancelled above may still be on
        # their threads with a connection out.
        await dispose_when_idle(self.engine, "server")
        await self.replica.release()  # last: everything this serve writes is written

    async def wait(self) -> None:
        assert self._server is not None
        await self._server.wait_for_termination()
