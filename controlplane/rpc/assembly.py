"""The gRPC server's assembly: every service on one ``grpc.aio`` server,
registered through the request guard, with the keepalive policy, message
limits, health and reflection. ``controlplane.server.ControlPlane`` builds
its server with :func:`create_server`; the benchmarks build theirs with it
too, with the servicer swapped (bench/_grpc_empty.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import grpc
from burstgate_client._proto.burstgate.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    admission_pb2,
    admission_pb2_grpc,
    ledger_pb2,
    ledger_pb2_grpc,
)
from grpc_health.v1 import health, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from controlplane.rpc import admitstream
from controlplane.rpc.admission import AdmissionServicer
from controlplane.rpc.dbcall import DbCaller
from controlplane.rpc.guard import GuardedRegistrar, MalformedLog, WireCodec
from controlplane.rpc.health import HealthServicer
from controlplane.rpc.reflection import enable_reflection
from controlplane.service import AdmissionService
from controlplane.service.waiting import WaitingRoom
from controlplane.settings import Settings

if TYPE_CHECKING:
    from controlplane.ha.serving import Ownership
    from controlplane.ledger.metering import Metering

ADMISSION_SERVICE = admission_pb2.DESCRIPTOR.services_by_name["AdmissionService"].full_name
ADMIN_SERVICE = admin_pb2.DESCRIPTOR.services_by_name["AdminService"].full_name
LEDGER_SERVICE = ledger_pb2.DESCRIPTOR.services_by_name["LedgerService"].full_name
# AdmitStream bytes to bytes (rpc/admitstream.py), for a servicer that takes
# its batches as columns and yields bytes (``wire_admit_stream``).
ADMIT_STREAM = f"/{ADMISSION_SERVICE}/AdmitStream"
ADMIT_STREAM_CODEC = WireCodec(
    admitstream.deserialize, admitstream.serialize, admitstream.MESSAGE_TYPE
)
# Early client pings (see keepalive_options) tolerated before GOAWAY; grpc's
# default, stated here because docs/api.md documents it.
MAX_PING_STRIKES = 2


def keepalive_options(settings: Settings) -> list[tuple[str, int]]:
    """The server's keepalive policy as grpc core channel options (docs/api.md,
    "Keepalive"). Without them grpc's defaults apply: no server pings for
    2 h, and a client pinging more often than every 5 minutes is cut off at
    its third early ping with GOAWAY ENHANCE_YOUR_CALM ("too_many_pings"),
    which ends every stream on the connection."""
    return [
        ("grpc.keepalive_time_ms", settings.keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", settings.keepalive_timeout_ms),
        # Server side this does two things: the server pings connections that
        # have no call open, and it accepts client pings on them (else a
        # ping on a connection without a call is a strike unless 2 h apart).
        # Sidecars keep one connection for unary calls that come and go.
        ("grpc.keepalive_permit_without_calls", 1),
        # (grpc core's GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS;
        # an option name core does not know is ignored without a word.)
        ("grpc.http2.min_ping_interval_without_data_ms", settings.keepalive_min_ping_interval_ms),
        ("grpc.http2.max_ping_strikes", MAX_PING_STRIKES),
    ]


def create_server(
    service: AdmissionService,
    address: str = "127.0.0.1:0",
    *,
    max_message_bytes: int = 4 * 1024 * 1024,
    waiting: WaitingRoom | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    admin: admin_pb2_grpc.AdminServiceServicer | None = None,
    credentials: grpc.ServerCredentials | None = None,
    ledger: Metering | None = None,
    options: Sequence[tuple[str, Any]] = (),
    db: DbCaller | None = None,
    envoy_rls: Any = None,
    ownership: Ownership | None = None,
) -> tuple[grpc.aio.Server, int, health_aio.HealthServicer]:
    """Build (not start) a gRPC server with the admission, health and
    reflection services (and the admin service when ``admin`` is given);
    bind ``address`` (port 0 = a free port), with TLS when ``credentials``.
    ``options``: more grpc channel options (the keepalive policy); ``db``:
    the bounded database caller of the operator services; ``envoy_rls``:
    Envoy's rate-limit service (controlplane/integrations/envoy), served
    beside the admission service under the same auth; ``ownership``: cell
    ownership of several replicas (admission calls for other cells redirected)."""
    server = grpc.aio.server(
        interceptors=list(interceptors),
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.so_reuseport", 0),
            *options,
        ],
    )
    # Every service is registered through the request guard (malformed
    # payloads; the operator services' string lengths): rpc/guard.py.
    malformed = MalformedLog()
    admission = AdmissionServicer(service, waiting, metering=ledger, ownership=ownership)
    # (the benchmarks' empty servicer keeps the generated serializers: the baseline)
    codecs = {ADMIT_STREAM: ADMIT_STREAM_CODEC} if getattr(
        admission, "wire_admit_stream", False) else {}  # fmt: skip
    edge = GuardedRegistrar(server, malformed, check=False, codecs=codecs).as_server()
    # The operator services as generic handlers only (see GuardedRegistrar):
    # their methods must not tax each admission call.
    operator = GuardedRegistrar(server, malformed, check=True, registered=False).as_server()
    admission_pb2_grpc.add_AdmissionServiceServicer_to_server(admission, edge)
    health_servicer = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, edge)
    names = [ADMISSION_SERVICE, health.SERVICE_NAME]
    if admin is not None:
        admin_pb2_grpc.add_AdminServiceServicer_to_server(admin, operator)
        names.append(ADMIN_SERVICE)
    if ledger is not None:  # operators' ledger API, same auth as admin
        from controlplane.rpc.ledger import LedgerServicer

        ledger_pb2_grpc.add_LedgerServiceServicer_to_server(
            LedgerServicer(ledger, clock=ledger.clock, db=db), operator
        )
        names.append(LEDGER_SERVICE)
    if envoy_rls is not None:
        from controlplane._proto.envoy.service.ratelimit.v3 import rls_pb2_grpc

        rls_pb2_grpc.add_RateLimitServiceServicer_to_server(envoy_rls, edge)
        names.append(envoy_rls.service_name)
    enable_reflection(names, edge)
    try:
        if credentials is not None:
            port = server.add_secure_port(address, credentials)
        else:
            port = server.add_insecure_port(address)
    except RuntimeError:  # grpc: "Failed to bind to address ..." (the cause is on stderr)
        port = 0
    if port == 0:
        raise OSError(f"cannot bind gRPC listener on {address}")
    return server, port, health_servicer
