"""The ``burstgate serve`` process: one ``ControlPlane`` started, frozen out
of the garbage collector's sight, served until SIGTERM or SIGINT, stopped."""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Callable

import structlog

from controlplane.server.app import ControlPlane
from controlplane.settings import Settings

log = structlog.get_logger("burstgate.server")

ReadyCallback = Callable[[ControlPlane], None]


async def serve_forever(settings: Settings, *, on_ready: ReadyCallback | None = None) -> None:
    plane = ControlPlane(settings)
    await plane.start()
    plane.freeze_gc()  # the start-up heap out of the collector's sight
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
        import uvloop  # a dependency everywhere but Windows (pyproject.toml)

        uvloop.run(serve_forever(settings, on_ready=on_ready))
    else:  # pragma: no cover
        asyncio.run(serve_forever(settings, on_ready=on_ready))
