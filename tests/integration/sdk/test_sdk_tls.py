"""The SDK over TLS and mTLS (a throwaway CA made by the openssl CLI, as in
tests/integration/admin/test_tls.py), with a sidecar key."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import openai
import pytest
from burstgate_client.sdk import AsyncAdmissionClient, TlsFiles

from controlplane.domain.keys import Role
from controlplane.store.db import make_engine, upgrade
from controlplane.store.keys import KeyStore
from tests.integration.admin.conftest import start_server
from tests.integration.admin.test_tls import pki  # noqa: F401 - the fixture
from tests.integration.sdk.conftest import SLOW_OK, tenant
from tests.support import add_tenants, wait_until

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")


def mtls_plane(sqlite_url: str, pki: Path) -> tuple[Any, str]:  # noqa: F811
    """A plane serving mTLS only, admission auth on, tenant acme; a sidecar key."""
    upgrade(sqlite_url)
    add_tenants(sqlite_url, tenant("acme"))
    engine = make_engine(sqlite_url)
    key, _ = KeyStore(engine).create_key("sdk", Role.SIDECAR, tenants=["*"], pools=["*"])
    engine.dispose()
    srv = start_server(
        sqlite_url, admission_auth=True, tls_cert_file=pki / "server.pem",
        tls_key_file=pki / "server.key", tls_client_ca_file=pki / "ca.pem",
    )  # fmt: skip
    return srv, key


def test_admit_and_complete_over_mtls(sqlite_url: str, pki: Path) -> None:  # noqa: F811
    srv, key = mtls_plane(sqlite_url, pki)
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


def test_the_sidecar_reaches_a_control_plane_over_mtls(sqlite_url: str, pki: Path) -> None:  # noqa: F811
    """The HTTP sidecar's own client takes the TLS files (config or flags):
    a completion through it is admitted and settled by a plane that serves
    mTLS only; without its client certificate it cannot reach the plane and
    the lane's fail policy answers."""
    from burstgate_client.errors import InvalidArgument
    from burstgate_client.sidecar import load

    from tests.integration.sidecar.conftest import MODEL, Stack

    srv, key = mtls_plane(sqlite_url, pki)
    mtls = {"control_plane_tls_ca": pki / "ca.pem", "control_plane_tls_cert": pki / "client.pem",
            "control_plane_tls_key": pki / "client.key"}  # fmt: skip
    stacks: list[Stack] = []
    try:
        good = Stack(srv.target, speed=50.0, model=MODEL, control_plane_api_key=key, **mtls)
        stacks.append(good)
        assert good.cfg.tls_files() is not None
        got = good.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            extra_headers={"x-burstgate-lane": "standard"},  # fails closed: decided by the plane
        )  # fmt: skip
        assert got.usage is not None and got.usage.completion_tokens > 0
        wait_until(lambda: good.pending() == 0, message="the Complete delivered")
        # the CA alone: the plane refuses the handshake; standard fails closed
        bare = Stack(srv.target, speed=50.0, model=MODEL, control_plane_api_key=key,
                     control_plane_tls_ca=pki / "ca.pem")  # fmt: skip
        stacks.append(bare)
        with pytest.raises(openai.APIStatusError) as err:
            bare.client().chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                extra_headers={"x-burstgate-lane": "standard"},
            )  # fmt: skip
        assert err.value.status_code == 503
    finally:
        for s in stacks:
            s.stop()
        srv.stop()
    # bad TLS settings are refused at start-up, naming the flag or field
    base: dict[str, Any] = {"upstream": "http://127.0.0.1:1", "control_plane": "127.0.0.1:1"}
    with pytest.raises(InvalidArgument) as bad:
        load(**base, control_plane_tls_cert=pki / "client.pem")
    assert str(bad.value).startswith("--tls-key: required with --tls-cert")
    with pytest.raises(InvalidArgument) as missing:
        load(**base, control_plane_tls_ca=pki / "nope.pem")
    assert str(missing.value).startswith("--tls-ca: cannot read ")
