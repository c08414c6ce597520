"""Optional TLS and mTLS on the gRPC port, with a throwaway CA made by the
openssl CLI (the database does not matter here: SQLite only)."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from burstgate_client.admin import AdminClient, TlsFiles

from controlplane.store.db import upgrade
from tests.integration.admin.conftest import code_of, make_keys, start_server

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _issue(d: Path, name: str, cn: str, ext: str) -> None:
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={cn}",
             cwd=d)  # fmt: skip
    (d / f"{name}.ext").write_text(ext)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-out", f"{name}.pem", "-days", "1",
             "-extfile", f"{name}.ext", cwd=d)  # fmt: skip


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=test-ca",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)  # fmt: skip
    _issue(d, "server", "localhost", "subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    _issue(d, "client", "ops", "extendedKeyUsage=clientAuth\n")
    return d


@pytest.fixture
def tls_url(sqlite_url: str) -> str:
    upgrade(sqlite_url)
    return sqlite_url


@pytest.fixture
def mtls_server(tls_url: str, pki: Path) -> Iterator[tuple[str, str]]:
    key = make_keys(tls_url).admin
    srv = start_server(
        tls_url,
        tls_cert_file=pki / "server.pem",
        tls_key_file=pki / "server.key",
        tls_client_ca_file=pki / "ca.pem",
    )
    yield srv.target, key
    srv.stop()


def test_mtls_requires_a_client_certificate(mtls_server: tuple[str, str], pki: Path) -> None:
    target, key = mtls_server
    full = TlsFiles(pki / "ca.pem", pki / "client.pem", pki / "client.key")
    with AdminClient(target, key, tls=full, timeout=5) as c:
        assert c.list_tenants() == []
    with AdminClient(target, key, tls=TlsFiles(pki / "ca.pem"), timeout=5) as c:
        code, _ = code_of(c.list_tenants)
        assert code == grpc.StatusCode.UNAVAILABLE
    with AdminClient(target, key, timeout=5) as c:  # plaintext to a TLS port
        code, _ = code_of(c.list_tenants)
        assert code == grpc.StatusCode.UNAVAILABLE


def test_server_tls_without_client_certs(tls_url: str, pki: Path) -> None:
    key = make_keys(tls_url).viewer
    srv = start_server(tls_url, tls_cert_file=pki / "server.pem", tls_key_file=pki / "server.key")
    try:
        with AdminClient(srv.target, key, tls=TlsFiles(pki / "ca.pem"), timeout=5) as c:
            assert c.list_tenants() == []
    finally:
        srv.stop()


def test_tls_settings_are_validated(pki: Path) -> None:
    from pydantic import ValidationError

    from controlplane.settings import Settings

    with pytest.raises(ValidationError, match="together"):
        Settings(tls_cert_file=pki / "server.pem")
    with pytest.raises(ValidationError, match="mTLS"):
        Settings(tls_client_ca_file=pki / "ca.pem")
