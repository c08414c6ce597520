"""Wiring: settings -> store -> service -> gRPC server, plus the background
tasks that keep memory and database in step (config polling, reservation
expiry). Nothing here runs per request."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
import structlog
from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio
from prometheus_client import start_http_server

from controlplane.aiotime import within
from controlplane.clock import Clock, Sleep, real_clock, real_sleep
from controlplane.domain.policy import effective_policy
from controlplane.ha.cells import CellMap
from controlplane.ha.serving import Ownership
from controlplane.replicas import ReplicaWiring
from controlplane.rpc.assembly import (
    ADMIN_SERVICE,
    ADMISSION_SERVICE,
    LEDGER_SERVICE,
    create_server,
    keepalive_options,
)
from controlplane.rpc.dbcall import DbCaller
from controlplane.rpc.owners import ensure_shares
from controlplane.service import AdmissionService, ServiceLimits
from controlplane.service.waiting import WaitingRoom
from controlplane.settings import Settings
from controlplane.startup.errors import Exit, StartupError
from controlplane.startup.network import port_error
from controlplane.store.config import ConfigRepository
from controlplane.store.db import dispose_when_idle, make_engine
from controlplane.store.replica_lock import ReplicaGuard, lock_for
from controlplane.telemetry.gcpause import GcPauses
from controlplane.telemetry.metrics import (
    RpcCollector,
    RpcStats,
    ServerCollector,
    registry_for,
)

if TYPE_CHECKING:
    from controlplane.ledger.metering import Metering
    from controlplane.ledger.pricing import PricingBook

T = TypeVar("T")
log = structlog.get_logger("burstgate.server")

# How often open reservations are checked against the TTL.
EXPIRY_INTERVAL_S = 0.5


class ControlPlane:
    """One running control plane: service, gRPC server and background tasks."""

    def __init__(
        self,
        settings: Settings,
        *,
        clock: Clock = real_clock,
        sleep: Sleep = real_sleep,
    ) -> None:
        """``clock`` is the service's time; ``sleep`` is what the background
        loops (expiry, config poll, live sampling) wait with. Tests and
        simulations pass a ``controlplane.clock.ManualClock``'s pair, so
        those loops run when simulated time moves, not in real time."""
        self.settings = settings
        self._sleep = sleep
        # With metering, Admit quotes its multiplier from the ledger's
        # pricing windows: the book is given to the service and to metering.
        pricing: PricingBook | None = None
        if settings.ledger_enabled:
            from controlplane.domain.pricing import StepTable
            from controlplane.ledger.pricing import PricingBook

            pricing = PricingBook(settings.pricing_window_s, StepTable(settings.pricing_steps))
        self.service = AdmissionService(ServiceLimits.of(settings), clock=clock, pricing=pricing)
        self.waiting = WaitingRoom(self.service)
        self.engine = make_engine(
            settings.database_url,
            connect_timeout_s=settings.db_connect_timeout_s,
            statement_timeout_s=settings.db_statement_timeout_s,
        )
        self.db_calls = DbCaller(settings.operator_db_timeout_s)
        self.repo = ConfigRepository(self.engine)
        # One serve per SQLite database (controlplane/store/replica_lock.py):
        # taken first thing at start, checked on every config poll, given up
        # at stop (a no-op on PostgreSQL, where replicas share cells instead).
        self.replica = ReplicaGuard(lock_for(settings.database_url), self._replica_health)
        # Cell ownership (controlplane/ha, docs/ha.md): on PostgreSQL a
        # coordinator is attached at start; on SQLite every cell is ours.
        self.ownership = Ownership(None, CellMap(settings.ha_cells))
        self.replicas = ReplicaWiring(settings, self.ownership, self.service)
        self._config_pools: set[str] = set()
        self.port = 0
        self.metrics_port: int | None = None
        self._metrics_httpd: Any = None
        self._server: grpc.aio.Server | None = None
        self._health: health_aio.HealthServicer | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._db_calls: set[asyncio.Future[Any]] = set()  # see _in_thread
        self._fingerprint: tuple[Any, ...] | None = None
        self.config_reloads = 0
        self.notified_reloads = 0  # reloads a notification triggered (notify.py)
        # Admin API, auth and observability (controlplane/rpc/admin.py, controlplane/rpc/auth.py).
        from controlplane.auth import KeyCache
        from controlplane.store.audit import AuditLog
        from controlplane.store.keys import KeyStore
        from controlplane.telemetry.live import LiveSampler

        self.config_reload_failures = 0
        self.key_refresh_failures = 0
        self.key_use_failures = 0
        self._reload_lock = asyncio.Lock()  # admin writes and the poll reload in turn
        self.audit_log = AuditLog(self.engine)
        self.key_store = KeyStore(self.engine)
        self.key_cache = KeyCache(self.key_store)
        self.rpc_stats = RpcStats()
        self.live = LiveSampler(
            self.service,
            interval_s=settings.metrics_sample_s,
            tenant_label_limit=settings.metrics_tenant_label_limit,
            sleep=sleep,
        )
        # Collectors registered on /metrics at start; other packages append.
        self.gc_pauses = GcPauses()  # timed while serving (start to stop)
        self.metrics_collectors: list[Any] = [
            RpcCollector(self.rpc_stats),
            ServerCollector(self),
            self.live.collector(),
            self.gc_pauses,
            self.ownership.collector(),
        ]
        self._listen_setup()
        self._tracer_provider: Any = None
        self._metering_started = False
        # Metering (controlplane/ledger): every Complete is recorded in
        # the dual ledger; pricing windows set the multiplier Admit returns.
        self.metering: Metering | None = None
        self.envoy_rls: Any = None  # controlplane/integrations/envoy, when configured
        self._ledger_health_tasks: set[asyncio.Task[None]] = set()
        if settings.ledger_enabled:
            from controlplane.ledger.metering import Metering
            from controlplane.telemetry.ledger_metrics import LedgerCollector

            assert pricing is not None
            self.metering = Metering(
                self.service, settings, pricing, on_health=self._ledger_health,
                fencing=self.replicas.fencing,
            )  # fmt: skip
            self.metrics_collectors.append(LedgerCollector(self.metering))
            if settings.ledger_unpriced == "refuse":  # docs/operating.md, "Prices"
                self.service.price_check = self.metering.check_priced
            self.replicas.metering = self.metering

    def _listen_setup(self) -> None:
        """On PostgreSQL (unless ``listen_notify`` is off): a LISTEN
        connection (controlplane/store/notify.py). A config change wakes the
        config loop at once; a released cell wakes the HA coordinator, when
        this plane has one (controlplane/replicas.py)."""
        from controlplane.store.notify import CONFIG_CHANNEL, LEASES_CHANNEL, Listener

        self._config_wake = asyncio.Event()
        self._catalog_reloads: set[asyncio.Future[None]] = set()  # see reload_notified
        self.listener: Listener | None = None
        if not self.settings.listen_notify:
            return
        listener = Listener(self.settings.database_url, name="burstgate serve notify")
        if not listener.enabled:  # SQLite: one replica, the poll is enough
            return
        listener.on(CONFIG_CHANNEL, lambda payload: self._config_wake.set())
        listener.on(LEASES_CHANNEL, self.replicas.lease_released)
        self.listener = listener
        self.metrics_collectors.append(listener.collector())

    async def _in_thread(self, fn: Callable[[], T]) -> T:
        """``fn()`` on a worker thread, for database work of the poll loop,
        awaited for at most ``operator_db_timeout_s`` (a hung database makes
        the step fail, logged, instead of holding the loop's later steps).
        A cancelled or timed-out caller does not stop the thread, which
        keeps its pooled connection until it returns; ``stop`` waits for
        these before disposing of the engine, so no connection is handed
        back to a disposed pool (and later garbage-collected still open)."""
        fut = asyncio.ensure_future(asyncio.to_thread(fn))
        self._db_calls.add(fut)
        fut.add_done_callback(self._db_calls.discard)
        fut.add_done_callback(_swallow)
        try:
            return await within(asyncio.shield(fut), self.settings.operator_db_timeout_s)
        except TimeoutError:
            raise TimeoutError(
                f"no answer from the database within {self.settings.operator_db_timeout_s} s"
            ) from None

    async def ready_tenants(self, tenant_ids: Sequence[str]) -> None:
        """Wait (bounded: three share refreshes) until this replica holds a
        share of each tenant's limits (several replicas, or one on
        PostgreSQL: controlplane/ha/grants.py); at once otherwise. The admin
        API calls it so that a tenant it created is usable on every door,
        AdmitStream included, once the call returns."""
        await ensure_shares(self.ownership, self.service, tenant_ids)

    async def load_config(self) -> bool:
        """Reload tenants and lanes when the database changed; True if applied."""
        async with self._reload_lock:
            return await self._load_config()

    async def _load_config(self) -> bool:
        fp = await self._in_thread(self.repo.fingerprint)
        if fp == self._fingerprint:
            return False
        lanes, tenants, overrides = await self._in_thread(
            lambda: (self.repo.lanes(), self.repo.tenants(), self.repo.policy_overrides())
        )
        policy = effective_policy(self.settings.policy, overrides)
        # Applied on the event-loop thread: the fast path is not thread-safe
        # and every decision runs on this thread too.
        self.service.apply_config(tenants, lanes, policy)
        # The cells of the declared pools are coordinated from now.
        self._config_pools = set(self.service.views.declared_pools())
        self.ownership.add_pools(self._config_pools)
        self.waiting.reschedule()
        self._fingerprint = fp
        self.config_reloads += 1
        log.info("config loaded", tenants=len(tenants), lanes=[lane.name for lane in lanes])
        return True

    def _interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        from controlplane.rpc.auth import ServerInterceptor

        interceptors: list[grpc.aio.ServerInterceptor] = []
        if self.settings.tracing != "off":
            from controlplane.telemetry.tracing import server_interceptor

            tracing, self._tracer_provider = server_interceptor(self.settings)
            interceptors.append(tracing)  # outermost: the span covers auth too
        interceptors.append(
            ServerInterceptor(
                key_cache=self.key_cache,
                db=self.db_calls,
                stats=self.rpc_stats,
                admission_auth=self.settings.admission_auth,
                admission_log_sample=self.settings.admission_log_sample,
            )
        )
        return interceptors

    def _credentials(self) -> grpc.ServerCredentials | None:
        """The TLS credentials (``startup.tls`` checked the files first in
        the CLI; a file that fails here is still one line, exit 8)."""
        s = self.settings
        if s.tls_cert_file is None or s.tls_key_file is None:
            return None
        try:
            pair = [(s.tls_key_file.read_bytes(), s.tls_cert_file.read_bytes())]
            ca = s.tls_client_ca_file.read_bytes() if s.tls_client_ca_file else None
        except OSError as exc:
            raise StartupError(
                Exit.TLS, "tls_file_unusable", f"cannot read TLS file {exc.filename}: "
                f"{exc.strerror}", "check BURSTGATE_TLS_CERT_FILE, _KEY_FILE and _CLIENT_CA_FILE",
            ) from exc  # fmt: skip
        if ca is None:
            return grpc.ssl_server_credentials(pair)
        return grpc.ssl_server_credentials(pair, root_certificates=ca, require_client_auth=True)

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
        from controlplane.rpc.admin import AdminServicer

        # What needs no database first: a bad TLS file or a tracing setting
        # fails the start before the database is read.
        interceptors = self._interceptors()
        credentials = self._credentials()
        envoy_rls = self._envoy_rls()
        await self.load_config()
        await asyncio.to_thread(self.key_cache.refresh)
        await self._load_signing_keys()
        self.live.sample()
        self.replicas.share_limits(self.engine)
        if self.metering is not None:
            self._metering_started = True
            await self.metering.start()  # replays the spool before serving
            await self._restore_quota_usage()
        address = f"{self.settings.host}:{self.settings.port}"
        try:
            self._server, self.port, self._health = create_server(
                self.service,
                address,
                max_message_bytes=self.settings.max_message_bytes,
                waiting=self.waiting,
                interceptors=interceptors,
                admin=AdminServicer(
                    self, self.repo, self.key_store, self.key_cache, self.audit_log, self.db_calls
                ),
                credentials=credentials,
                ledger=self.metering,
                options=keepalive_options(self.settings),
                db=self.db_calls,
                envoy_rls=envoy_rls,
                ownership=self.ownership,
            )
        except OSError:  # taken since the CLI's probe (or TLS refused by grpc core)
            raise port_error("gRPC", self.settings.host, self.settings.port, None) from None
        # /metrics is bound before the gRPC server starts: a metrics port in
        # use fails the start before any RPC is answered.
        if self.settings.metrics_port >= 0:
            extra = list(self.metrics_collectors)
            try:
                self._metrics_httpd, _ = start_http_server(
                    self.settings.metrics_port,
                    addr=self.settings.host,
                    registry=registry_for(
                        self.service, *extra, tenant_labels=self.live.tenant_labels
                    ),
                )
            except OSError as exc:
                host, port = self.settings.host, self.settings.metrics_port
                raise port_error("metrics", host, port, exc) from None
            self.metrics_port = self._metrics_httpd.server_port
        # Before SERVING: the first coordinator tick, so the cells assigned to
        # this replica are owned when the first request comes.
        await self.replicas.start(self.engine, self.port, self._config_pools)
        await self._server.start()
        self.gc_pauses.install()
        serving = health_pb2.HealthCheckResponse.SERVING
        await self._health.set("", serving)
        await self._health.set(ADMISSION_SERVICE, serving)
        await self._health.set(ADMIN_SERVICE, serving)
        if envoy_rls is not None:
            await self._health.set(envoy_rls.service_name, serving)
        if self.metering is not None:
            self._ledger_health(self.metering.healthy)
        self._tasks = [
            asyncio.create_task(self._expiry_loop(), name="expiry"),
            asyncio.create_task(self._config_loop(), name="config-poll"),
            asyncio.create_task(self.live.run(), name="live-sampler"),
        ]
        if self.listener is not None:
            self.listener.start()  # connects on its own thread; serving does not wait
        log.info(
            "serving",
            address=f"{self.settings.host}:{self.port}",
            metrics_port=self.metrics_port,
            fastpath=self.service.implementation,
            database=self.engine.url.render_as_string(hide_password=True),
        )
        return self.port

    def epoch_for_pool(self, pool: str) -> tuple[str, int] | None:
        """(cell id, lease epoch) while this replica owns ``pool``'s cell, else
        None; on SQLite (cell, ``controlplane.ha.serving.LOCAL_EPOCH``): one
        replica, no fencing. What fenced single-writer writes carry."""
        return self.ownership.epoch_for_pool(pool)

    def _envoy_rls(self) -> Any:
        """Envoy's rate-limit service when configured (docs/envoy.md); a
        mapping file that cannot be read or validated fails the start."""
        path = self.settings.envoy_rls_config
        if path is None:
            return None
        from controlplane.domain.errors import InvalidArgument
        from controlplane.integrations.envoy.config import LiveConfig
        from controlplane.integrations.envoy.servicer import RateLimitServicer

        try:
            live = LiveConfig(path)
        except InvalidArgument as exc:
            raise StartupError(
                Exit.SETTINGS, "envoy_rls_config_invalid", f"BURSTGATE_ENVOY_RLS_CONFIG: {exc}",
                "fix the file (docs/envoy.md, \"Descriptor mapping\")",
            ) from exc  # fmt: skip
        self.envoy_rls = RateLimitServicer(
            self.service, live, self.waiting, metering=self.metering, gate=self._envoy_gate()
        )
        return self.envoy_rls

    def _envoy_gate(self) -> Any:
        """Owner gating of the RLS (forward.py): calls for a cell another
        replica owns are forwarded to it; inactive on a single replica."""
        from controlplane.integrations.envoy.forward import OwnerGate, peer_credentials

        s = self.settings
        cert, key, ca = (
            p.read_bytes() if p is not None else None
            for p in (s.tls_cert_file, s.tls_key_file, s.tls_client_ca_file)
        )
        gate = OwnerGate(self.ownership, self.service, credentials=peer_credentials(cert, key, ca))
        self.metrics_collectors.append(gate.collector())
        return gate

    async def _abort_start(self) -> None:
        """Undo a start that failed part-way (best effort: the error that
        stopped the start is what gets reported)."""
        with contextlib.suppress(Exception):
            await self.ownership.drain()
        with contextlib.suppress(Exception):
            await self.replicas.stop()
        with contextlib.suppress(Exception):
            if self._server is not None:
                await self._server.stop(0)
        with contextlib.suppress(Exception):
            if self.envoy_rls is not None:
                await self.envoy_rls.close()
        with contextlib.suppress(Exception):
            if self._metrics_httpd is not None:
                self._metrics_httpd.shutdown()
                self._metrics_httpd.server_close()
        with contextlib.suppress(Exception):
            if self.metering is not None and self._metering_started:
                await self.metering.stop()
        with contextlib.suppress(Exception):
            if self.listener is not None:
                await self.listener.stop()
        with contextlib.suppress(Exception):
            self.engine.dispose()

    async def _expiry_loop(self) -> None:
        while True:
            await self._sleep(EXPIRY_INTERVAL_S)
            self.expire_once()

    def expire_once(self) -> int:
        """One step of the expiry loop: release reservations past their TTL."""
        released = self.service.expire()
        self.waiting.reschedule()
        if released:
            log.info("reservations expired", released=released)
        return released

    async def _config_loop(self) -> None:
        if self.listener is None:
            while True:
                await self._sleep(self.settings.config_poll_s)
                await self.poll_once()
        # With LISTEN: a notification reloads at once, and the poll keeps its
        # own rhythm (its timer runs on through notified reloads). A burst
        # of notifications makes one reload, or two when some arrive while
        # it runs (it may have read before their commit); this one task
        # runs them all, so never two at once.
        poll: asyncio.Future[Any] | None = None
        try:
            while True:
                if poll is None:
                    poll = asyncio.ensure_future(self._sleep(self.settings.config_poll_s))
                woken = asyncio.ensure_future(self._config_wake.wait())
                try:
                    await asyncio.wait((poll, woken), return_when=asyncio.FIRST_COMPLETED)
                finally:
                    woken.cancel()
                if self._config_wake.is_set():
                    self._config_wake.clear()
                    await self.reload_notified()
                if poll.done():
                    poll = None
                    await self.poll_once()
        finally:
            if poll is not None:
                poll.cancel()

    async def reload_notified(self) -> None:
        """What a config notification triggers: config, keys and (with the
        ledger) the price catalog, each only if changed (fingerprints)."""
        self.notified_reloads += 1
        await self._reload_config_and_keys()
        if self.metering is not None:
            # Shielded and awaited by stop() before the ledger's engine is
            # disposed: a cancelled reload's thread would otherwise hand its
            # connection back to a disposed pool (as _in_thread's calls).
            reload = asyncio.ensure_future(self._reload_catalog(self.metering))
            self._catalog_reloads.add(reload)
            reload.add_done_callback(self._catalog_reloads.discard)
            await asyncio.shield(reload)

    @staticmethod
    async def _reload_catalog(metering: Metering) -> None:
        try:
            await metering.reload_catalog()
        except Exception as exc:  # database down: the metering poll tries again
            log.warning("price catalog reload failed; keeping the last one", error=str(exc))

    async def poll_once(self) -> None:
        """One step of the config poll: reload changed config, refresh the
        key cache, write the keys' last use. The steps are independent: a
        config that fails to load or apply must never keep a revoked key
        working, nor a key refresh that fails keep a config change from
        applying, nor a failed last-use write either of them."""
        await self._reload_config_and_keys()
        await self._save_key_use()
        if self.envoy_rls is not None:
            self.envoy_rls.config.poll()  # a changed mapping file (kept if bad)
        try:
            await self.replica.poll()  # lost and taken by another serve: health NOT_SERVING
        except Exception as exc:  # database down or slow: asked again at the next poll
            log.warning("replica lock check failed", error=str(exc))

    async def _reload_config_and_keys(self) -> None:
        try:
            await self.load_config()
        except Exception as exc:  # database down, or a config that cannot apply
            self.config_reload_failures += 1
            log.warning("config poll failed; serving last config", error=str(exc))
        started = time.monotonic()
        try:
            await self._in_thread(self.key_cache.refresh)
        except Exception as exc:  # database down: keep the keys as last read
            self.key_cache.note_refresh(False)  # unknown keys are refused at once meanwhile
            self.key_refresh_failures += 1
            log.warning("key refresh failed; serving last keys", error=str(exc))
        else:
            self.key_cache.note_refresh(True, time.monotonic() - started)
        if self.settings.admission_signing_key is None:  # a rotation reaches every replica
            try:
                await self._load_signing_keys()
            except Exception as exc:  # database down: sign with the keys as last read
                self.key_refresh_failures += 1
                log.warning("signing key refresh failed; keeping the last ones", error=str(exc))

    async def _load_signing_keys(self) -> None:
        """The keys admissions are signed with (store/signing.py): read in a
        thread, installed on the loop (the service is the loop's alone)."""
        from controlplane.store.signing import signing_keys

        keys = await self._in_thread(lambda: signing_keys(self.settings, self.engine))
        self.service.signer.install(keys)

    async def _save_key_use(self) -> None:
        """The keys used since the last poll, written as last used now (one
        UPDATE per poll, none per call). Kept for the next poll if it fails."""
        used = self.key_cache.take_used()
        if not used:
            return
        try:
            await self._in_thread(lambda: self.key_cache.save_used(used))
        except Exception as exc:  # database down: try again at the next poll
            self.key_cache.give_back(used)
            self.key_use_failures += 1
            log.warning("key last-use write failed; kept for the next poll", error=str(exc))

    async def stop(self, grace: float | None = None) -> None:
        """Graceful stop: hand the cells off first (released at once, so
        another replica takes them over), report NOT_SERVING, let in-flight
        RPCs finish."""
        await self.replicas.flush_before_drain()
        await self.ownership.drain()
        await self.replicas.stop()
        self.gc_pauses.uninstall()
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.listener is not None:
            await self.listener.stop()  # bounded: its own connection, not the engine's
            await asyncio.gather(*self._catalog_reloads, return_exceptions=True)
        if self._server is not None:
            await self._server.stop(self.settings.shutdown_grace_s if grace is None else grace)
        if self.envoy_rls is not None:
            await self.envoy_rls.close()  # after the calls that forward on them
        if self._metrics_httpd is not None:
            self._metrics_httpd.shutdown()
            self._metrics_httpd.server_close()
        if self._tracer_provider is not None:
            self._tracer_provider.shutdown()
        # Operator calls still on a database thread (a hung database) finish
        # before any engine they use is disposed (the ledger's is, next).
        await asyncio.to_thread(self.db_calls.shutdown)
        if self.metering is not None:
            await self.metering.stop()  # writes (or spools) what is queued
        if self._db_calls:  # a poll step cancelled mid-query: let its thread finish
            await asyncio.gather(*self._db_calls, return_exceptions=True)
        # HA calls (and takeover rebuilds) cancelled above may still be on
        # their threads with a connection out.
        await dispose_when_idle(self.engine, "server")
        await self.replica.release()  # last: everything this serve writes is written

    async def _restore_quota_usage(self) -> None:
        """Quota counters live in memory; after a restart, count what the
        ledger holds for the current UTC hour and day (by settlement time)."""
        assert self.metering is not None
        try:  # the same rebuild a takeover runs for its cell's pools
            restored, _, _ = await self.metering.rebuild_usage()
        except Exception as exc:  # database down: start with empty counters
            log.warning("quota usage not restored from the ledger", error=str(exc))
            return
        if restored:
            log.info("quota usage restored from the ledger", tenants=restored)

    def _replica_health(self, held: bool) -> None:
        """Replica lock lost to another serve (or back): the server's overall
        and admission health say NOT_SERVING (or SERVING), so load balancers
        and orchestrators stop sending it work; it keeps answering meanwhile."""
        if self._health is None:
            return
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if held
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in ("", ADMISSION_SERVICE):
            task = asyncio.get_running_loop().create_task(self._health.set(service, status))
            self._ledger_health_tasks.add(task)
            task.add_done_callback(self._ledger_health_tasks.discard)

    def _ledger_health(self, ok: bool) -> None:
        """Ledger health: NOT_SERVING while records are spooled
        because the database is unreachable (Admit keeps serving)."""
        if self._health is None:
            return
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if ok
            else (health_pb2.HealthCheckResponse.NOT_SERVING)
        )
        task = asyncio.get_running_loop().create_task(self._health.set(LEDGER_SERVICE, status))
        self._ledger_health_tasks.add(task)
        task.add_done_callback(self._ledger_health_tasks.discard)

    async def wait(self) -> None:
        assert self._server is not None
        await self._server.wait_for_termination()


def _swallow(fut: asyncio.Future[Any]) -> None:
    """Retrieve a background call's exception (logged by whoever awaited it,
    or nobody, after a timeout), so asyncio does not report it as lost."""
    if not fut.cancelled():
        fut.exception()


ReadyCallback = Callable[["ControlPlane"], None]


async def serve_forever(settings: Settings, *, on_ready: ReadyCallback | None = None) -> None:
    plane = ControlPlane(settings)
    await plane.start()
    # Everything built at start (modules, config, servicers) lives as long as
    # the process: move it out of the collector's sight, so full collections
    # walk only what serving creates. The request log's dict is made tracked
    # first, or it would escape the freeze while empty and be walked, entry
    # by entry, by every full collection once it fills.
    plane.service.prepare_gc_freeze()
    gc.freeze()
    if on_ready is not None:
        on_ready(plane)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down", grace_s=settings.shutdown_grace_s)
    await plane.stop()
    log.info("stopped")


def run(settings: Settings, *, on_ready: ReadyCallback | None = None) -> None:
    if sys.platform != "win32":
        import uvloop

        uvloop.run(serve_forever(settings, on_ready=on_ready))
    else:  # pragma: no cover
        asyncio.run(serve_forever(settings, on_ready=on_ready))
