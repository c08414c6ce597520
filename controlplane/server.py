"""Wiring: settings -> store -> service -> gRPC server, plus the background
tasks that keep memory and database in step (config polling, reservation
expiry). Nothing here runs per request."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from controlplane._proto.burstgate.v1 import admission_pb2, admission_pb2_grpc
from controlplane.metrics import registry_for
from controlplane.policy import effective_policy
from controlplane.rpc.admission import AdmissionServicer
from controlplane.service import AdmissionService
from controlplane.settings import Settings
from controlplane.store.db import make_engine
from controlplane.store.repo import ConfigRepository

log = structlog.get_logger("burstgate.server")

ADMISSION_SERVICE = admission_pb2.DESCRIPTOR.services_by_name["AdmissionService"].full_name
# How often open reservations are checked against the TTL.
EXPIRY_INTERVAL_S = 0.5


def create_server(
    service: AdmissionService,
    address: str = "127.0.0.1:0",
    *,
    max_message_bytes: int = 4 * 1024 * 1024,
) -> tuple[grpc.aio.Server, int, health_aio.HealthServicer]:
    """Build (not start) a gRPC server with the admission, health and
    reflection services; bind ``address`` (port 0 = a free port)."""
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.so_reuseport", 0),
        ]
    )
    admission_pb2_grpc.add_AdmissionServiceServicer_to_server(AdmissionServicer(service), server)
    health_servicer = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (ADMISSION_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot bind gRPC listener on {address}")
    return server, port, health_servicer


class ControlPlane:
    """One running control plane: service, gRPC server and background tasks."""

    def __init__(self, settings: Settings, *, clock: Callable[[], int] = time.time_ns) -> None:
        self.settings = settings
        self.service = AdmissionService(settings, clock=clock)
        self.engine = make_engine(settings.database_url)
        self.repo = ConfigRepository(self.engine)
        self.port = 0
        self.metrics_port: int | None = None
        self._metrics_httpd: Any = None
        self._server: grpc.aio.Server | None = None
        self._health: health_aio.HealthServicer | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._fingerprint: tuple[Any, ...] | None = None
        self.config_reloads = 0

    async def load_config(self) -> bool:
        """Reload tenants and lanes when the database changed; True if applied."""
        fp = await asyncio.to_thread(self.repo.fingerprint)
        if fp == self._fingerprint:
            return False
        lanes, tenants, overrides = await asyncio.to_thread(
            lambda: (self.repo.lanes(), self.repo.tenants(), self.repo.policy_overrides())
        )
        policy = effective_policy(self.settings.policy, overrides)
        # Applied on the event-loop thread: the fast path is not thread-safe
        # and every decision runs on this thread too.
        self.service.apply_config(tenants, lanes, policy)
        self._fingerprint = fp
        self.config_reloads += 1
        log.info("config loaded", tenants=len(tenants), lanes=[lane.name for lane in lanes])
        return True

    async def start(self) -> int:
        await self.load_config()
        address = f"{self.settings.host}:{self.settings.port}"
        self._server, self.port, self._health = create_server(
            self.service, address, max_message_bytes=self.settings.max_message_bytes
        )
        await self._server.start()
        serving = health_pb2.HealthCheckResponse.SERVING
        await self._health.set("", serving)
        await self._health.set(ADMISSION_SERVICE, serving)
        if self.settings.metrics_port >= 0:
            self._metrics_httpd, _ = start_http_server(
                self.settings.metrics_port,
                addr=self.settings.host,
                registry=registry_for(self.service),
            )
            self.metrics_port = self._metrics_httpd.server_port
        self._tasks = [
            asyncio.create_task(self._expiry_loop(), name="expiry"),
            asyncio.create_task(self._config_loop(), name="config-poll"),
        ]
        log.info(
            "serving",
            address=f"{self.settings.host}:{self.port}",
            metrics_port=self.metrics_port,
            fastpath=self.service.implementation,
            database=self.engine.url.render_as_string(hide_password=True),
        )
        return self.port

    async def _expiry_loop(self) -> None:
        while True:
            await asyncio.sleep(EXPIRY_INTERVAL_S)
            released = self.service.expire()
            if released:
                log.info("reservations expired", released=released)

    async def _config_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.config_poll_s)
            try:
                await self.load_config()
            except Exception as exc:  # database down: keep deciding from memory
                log.warning("config poll failed; serving last config", error=str(exc))

    async def stop(self, grace: float | None = None) -> None:
        """Graceful stop: report NOT_SERVING, let in-flight RPCs finish."""
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._server is not None:
            await self._server.stop(self.settings.shutdown_grace_s if grace is None else grace)
        if self._metrics_httpd is not None:
            self._metrics_httpd.shutdown()
            self._metrics_httpd.server_close()
        self.engine.dispose()

    async def wait(self) -> None:
        assert self._server is not None
        await self._server.wait_for_termination()


ReadyCallback = Callable[["ControlPlane"], None]


async def serve_forever(settings: Settings, *, on_ready: ReadyCallback | None = None) -> None:
    plane = ControlPlane(settings)
    await plane.start()
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
