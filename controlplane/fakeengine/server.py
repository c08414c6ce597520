"""Start and stop a fake engine: the model's stepping task and the aiohttp
server, on the running event loop."""

from __future__ import annotations

import asyncio
import contextlib

from aiohttp import web

from controlplane.fakeengine.app import EngineConfig, FakeEngineApp
from controlplane.fakeengine.live import LiveEngine
from controlplane.sim.engine import EngineParams


class FakeEngine:
    """``await start()`` binds ``host:port`` (0 = a free port) and returns
    the port; ``await stop()`` ends every open request and the model."""

    def __init__(
        self,
        params: EngineParams | None = None,
        cfg: EngineConfig | None = None,
        *,
        speed: float = 1.0,
        host: str = "127.0.0.1",
        port: int = 8000,
    ) -> None:
        self.live = LiveEngine(params or EngineParams(), speed=speed)
        self.cfg = cfg or EngineConfig()
        self.http = FakeEngineApp(self.live, self.cfg)
        self.host, self.port = host, port
        # A client that goes away cancels its handler, which aborts its
        # request in the model (vLLM aborts a disconnected request too).
        self._runner = web.AppRunner(self.http.app, handler_cancellation=True, access_log=None)
        self._task: asyncio.Task[None] | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    async def start(self) -> int:
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, reuse_address=False)
        await site.start()
        server = site._server  # the bound socket: port 0 resolves here
        assert server is not None and server.sockets  # type: ignore[attr-defined]
        self.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        self._task = asyncio.create_task(self.live.run(), name="fake-engine")
        return self.port

    async def stop(self) -> None:
        await self._runner.cleanup()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
