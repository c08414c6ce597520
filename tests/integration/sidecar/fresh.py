"""A fresh sidecar's /metrics page: a real ``Sidecar`` (its HTTP server,
its registry) on the SDK's stand-in, scraped before it served anything.
What the dashboard's and the alerts' sidecar queries must find
(tests/integration/metrics/test_deploy_files.py, test_operability.py)."""

from __future__ import annotations

import asyncio

import aiohttp
from burstgate_client.sidecar import Sidecar, load

from tests.sidecar_support import FakeAdmitter


async def _scrape() -> str:
    # nothing listens on the upstream: a fresh sidecar never calls it, and
    # the load reports are off, so the page is the sidecar's alone
    cfg = load(upstream="http://127.0.0.1:9", control_plane="127.0.0.1:1", port=0,
               metrics={"enabled": False})  # fmt: skip
    sidecar = Sidecar(cfg, FakeAdmitter())
    await sidecar.start()
    try:
        async with aiohttp.ClientSession() as http, http.get(
            f"http://127.0.0.1:{sidecar.port}/metrics"
        ) as r:
            assert r.status == 200
            return await r.text()
    finally:
        await sidecar.stop()


def fresh_metrics_page() -> str:
    return asyncio.run(asyncio.wait_for(_scrape(), 30))
