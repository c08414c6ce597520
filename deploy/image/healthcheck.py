#!/usr/bin/env python3
"""The images' HEALTHCHECK (installed as ``burstgate-healthcheck``).

``burstgate-healthcheck grpc``: the plane's gRPC health service
(grpc.health.v1, served without a key), overall status unless ``--service``
names one; healthy only on SERVING. ``burstgate-healthcheck http``: the
sidecar's ``GET /health`` (200: serving and its engine answers).

Exit 0 healthy, 1 not (with one line saying why), 2 bad usage: what Docker's
HEALTHCHECK and an exec probe read. The plane's port comes from
``BURSTGATE_PORT`` as the server reads it; plaintext only (with TLS on the
gRPC port, probe from outside with the CA: deploy/README.md, "Health").
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.error
import urllib.request


def check_grpc(target: str, service: str, timeout: float) -> str | None:
    """None when SERVING, else why not."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            answer = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as exc:
            return f"{target}: {exc.code().name}: {exc.details()}"
    if answer.status != health_pb2.HealthCheckResponse.SERVING:
        name = health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)
        return f"{target} service {service or '(overall)'!r}: {name}"
    return None


def check_http(url: str, timeout: float) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            if r.status == 200:
                return None
            return f"{url}: HTTP {r.status}"
    except urllib.error.HTTPError as exc:
        return f"{url}: HTTP {exc.code}: {exc.read(200).decode(errors='replace')}"
    except (urllib.error.URLError, OSError) as exc:
        return f"{url}: {getattr(exc, 'reason', exc)}"


def main(argv: list[str] | None = None) -> int:
    summary = (__doc__ or "").split("\n\n")[0]
    parser = argparse.ArgumentParser(prog="burstgate-healthcheck", description=summary)
    sub = parser.add_subparsers(dest="kind", required=True)
    g = sub.add_parser("grpc", help="the control plane's gRPC health service")
    g.add_argument(
        "--target",
        default=f"127.0.0.1:{os.environ.get('BURSTGATE_PORT', '50051')}",
        help="host:port (default 127.0.0.1:$BURSTGATE_PORT, else 50051)",
    )
    g.add_argument("--service", default="", help="a service name (default: overall health)")
    h = sub.add_parser("http", help="the sidecar's /health")
    h.add_argument("--url", default="http://127.0.0.1:8080/health", help="default %(default)s")
    for p in (g, h):
        p.add_argument("--timeout", type=float, default=3.0, help="seconds (default 3)")
    args = parser.parse_args(argv)
    if args.timeout <= 0:
        parser.error("--timeout: must be above 0")
    if args.kind == "grpc":
        problem = check_grpc(args.target, args.service, args.timeout)
    else:
        problem = check_http(args.url, args.timeout)
    if problem is not None:
        print(f"unhealthy: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
