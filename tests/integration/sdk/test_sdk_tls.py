"""The SDK over TLS and mTLS (a throwaway CA made by the openssl CLI, as in
tests/integration/admin/test_tls.py), with a sidecar key."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest
from burstgate_client.sdk import AsyncAdmissionClient, TlsFiles

from controlplane.domain.keys import Role
from controlplane.store.db import make_engine, upgrade
from controlplane.store.keys import KeyStore
from tests.integration.admin.conftest import start_server
from tests.integration.admin.test_tls import pki  # noqa: F401 - the fixture
from tests.integration.sdk.conftest import SLOW_OK, tenant
from tests.support import add_tenants

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")


def test_admit_and_complete_over_mtls(sqlite_url: str, pki: Path) -> None:  # noqa: F811
    upgrade(sqlite_url)
    add_tenants(sqlite_url, tenant("acme"))
    engine = make_engine(sqlite_url)
    key, _ = KeyStore(engine).create_key("sdk", Role.SIDECAR, tenants=["*"], pools=["*"])
    engine.dispose()
    srv = start_server(
        sqlite_url, admission_auth=True, tls_cert_file=pki / "server.pem",
        tls_key_file=pki / "server.key", tls_client_ca_file=pki / "ca.pem",
    )  # fmt: skip
    tls = TlsFiles(pki / "ca.pem", pki / "client.pem", pki / "client.key")

    async def run() -> None:
        async with AsyncAdmissionClient(
            srv.target, api_key=key, tls=tls, deadline_s=SLOW_OK, connect_timeout_s=SLOW_OK
        ) as c:
            a = await c.admit("acme", "r", prompt_tokens=1, max_tokens=1)
            assert a.admitted and not a.offline
            assert (await c.complete("acme", "r", prompt_tokens=1, generated_tokens=1)).delivered
        # without the client certificate the handshake fails: unreachable, fail closed
        async with AsyncAdmissionClient(
            srv.target, api_key=key, tls=TlsFiles(pki / "ca.pem"), deadline_s=SLOW_OK
        ) as c:
            refused = await c.admit("acme", "r2", prompt_tokens=1, max_tokens=1)
            assert refused.offline and refused.reason == "unavailable" and not c.up

    try:
        asyncio.run(run())
    finally:
        srv.stop()
