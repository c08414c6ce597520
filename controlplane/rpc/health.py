"""grpc.health.v1.Health: grpc's asyncio servicer, plus ``List``.

grpcio-health-checking's asyncio servicer implements Check and Watch only;
``List`` (added to the health proto in 2024) falls through to the generated
base class, which answers UNIMPLEMENTED by raising, and the server logged a
traceback for every call: a public, unauthenticated way to flood the log.
This answers it from the statuses the server has set."""

from __future__ import annotations

from typing import Any

from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio


class HealthServicer(health_aio.HealthServicer):  # type: ignore[misc]
    async def List(
        self, request: health_pb2.HealthListRequest, context: Any
    ) -> health_pb2.HealthListResponse:
        # The base class's own table (what Check answers from), read as is.
        statuses: dict[str, Any] = dict(self._server_status)
        return health_pb2.HealthListResponse(
            statuses={
                name: health_pb2.HealthCheckResponse(status=status)
                for name, status in statuses.items()
            }
        )
