"""What the server reports on the gRPC health service: SERVING once started,
NOT_SERVING for the whole server while another serve holds its database's
replica lock, and for the ledger while its records are spooled."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio

from controlplane.ledger.metering import Metering
from controlplane.rpc.assembly import ADMIN_SERVICE, ADMISSION_SERVICE, LEDGER_SERVICE

if TYPE_CHECKING:
    from controlplane.integrations.envoy.servicer import RateLimitServicer

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class ServerHealth:
    """Status changes of the health servicer, which exists once the gRPC
    server is built; a change before that is dropped (nothing is served)."""

    def __init__(self) -> None:
        self.servicer: health_aio.HealthServicer | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def serving(self, envoy_rls: RateLimitServicer | None, metering: Metering | None) -> None:
        """Started: every service SERVING (Envoy's RLS when served), the
        ledger's as its metering is."""
        assert self.servicer is not None
        services = ["", ADMISSION_SERVICE, ADMIN_SERVICE]
        if envoy_rls is not None:
            services.append(envoy_rls.service_name)
        for service in services:
            await self.servicer.set(service, SERVING)
        if metering is not None:
            self.ledger(metering.healthy)

    def replica(self, held: bool) -> None:
        """Replica lock lost to another serve (or back): the server's overall
        and admission health say NOT_SERVING (or SERVING), so load balancers
        and orchestrators stop sending it work; it keeps answering meanwhile."""
        for service in ("", ADMISSION_SERVICE):
            self._set(service, SERVING if held else NOT_SERVING)

    def ledger(self, ok: bool) -> None:
        """Ledger health: NOT_SERVING while records are spooled
        because the database is unreachable (Admit keeps serving)."""
        self._set(LEDGER_SERVICE, SERVING if ok else NOT_SERVING)

    async def shutting_down(self) -> None:
        if self.servicer is not None:
            await self.servicer.enter_graceful_shutdown()

    def _set(self, service: str, status: health_pb2.HealthCheckResponse.ServingStatus) -> None:
        # Called from synchronous callbacks on the loop: the set runs as a task.
        if self.servicer is None:
            return
        task = asyncio.get_running_loop().create_task(self.servicer.set(service, status))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
