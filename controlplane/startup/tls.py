"""The TLS files at start: each one there, readable and PEM of the right
kind, and the key the certificate's own. grpc core only says "Failed to bind
to address" (and logs a line of its own) for any of these; Python's ``ssl``
module loads the same PEM files and says which problem it is."""

from __future__ import annotations

import re
import ssl
from pathlib import Path

from controlplane.settings import Settings
from controlplane.startup.errors import Exit, StartupError

# (setting, what it is, the PEM block it must hold)
_FILES = (
    ("tls_cert_file", "certificate", "CERTIFICATE"),
    ("tls_key_file", "private key", "PRIVATE KEY"),
    ("tls_client_ca_file", "client CA", "CERTIFICATE"),
)


def check_tls(settings: Settings) -> None:
    """Raise a StartupError naming the file and its variable when a
    configured TLS file cannot be used."""
    for field, what, block in _FILES:
        path: Path | None = getattr(settings, field)
        if path is not None:
            _check_pem(path, what, block, _variable(field))
    cert, key = settings.tls_cert_file, settings.tls_key_file
    if cert is None or key is None:
        return
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        # An encrypted key would make OpenSSL ask for a pass phrase on the
        # terminal: the callback answers instead (grpc takes no pass phrase).
        context.load_cert_chain(cert, key, password=lambda: b"")
    except ssl.SSLError as exc:
        mismatch = exc.reason == "KEY_VALUES_MISMATCH"
        raise StartupError(
            Exit.TLS, "tls_key_mismatch" if mismatch else "tls_files_invalid",
            f"the TLS private key {key} is not the key of the certificate {cert}"
            if mismatch else f"the TLS certificate {cert} and key {key} cannot be loaded "
            f"({exc.reason or exc})",
            "set BURSTGATE_TLS_CERT_FILE and BURSTGATE_TLS_KEY_FILE to a certificate and "
            "its own key (PEM)",
        ) from None  # fmt: skip
    ca = settings.tls_client_ca_file
    if ca is not None:
        try:
            context.load_verify_locations(cafile=ca)
        except ssl.SSLError as exc:
            raise _bad(ca, "client CA", "BURSTGATE_TLS_CLIENT_CA_FILE",
                       f"cannot be loaded ({exc.reason or exc})") from None  # fmt: skip


def _variable(field: str) -> str:
    return "BURSTGATE_" + field.upper()


def _check_pem(path: Path, what: str, block: str, variable: str) -> None:
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        raise _bad(path, what, variable, "does not exist") from None
    except OSError as exc:
        raise _bad(path, what, variable, f"cannot be read ({exc.strerror or exc})") from None
    if b"ENCRYPTED" in text and block == "PRIVATE KEY":
        raise _bad(path, what, variable, "is encrypted (gRPC needs an unencrypted key)")
    if not re.search(rb"-----BEGIN [A-Z0-9 ]*" + block.encode() + rb"-----", text):
        raise _bad(path, what, variable, f"holds no PEM {block.lower()}")


def _bad(path: Path, what: str, variable: str, problem: str) -> StartupError:
    return StartupError(
        Exit.TLS, "tls_file_unusable",
        f"the TLS {what} file {path} ({variable}) {problem}",
        f"point {variable} at a readable PEM file",
    )  # fmt: skip
