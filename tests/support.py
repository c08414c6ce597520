"""Helpers shared by the tests (no fixtures: those live in conftest.py)."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from controlplane.domain import TenantConfig
from controlplane.store.config import ConfigRepository
from controlplane.store.db import make_engine

T = TypeVar("T")


# The engine pools the integration tests name, declared as an operator
# declares pools (the policy's known_pools; docs/operating.md, "Declaring
# pools"): the servers the fixtures start declare them unless the test gives
# its own known_pools. An undeclared pool is refused at every door.
TEST_POOLS = (
    "p", "p1", "q", "px", "gpu", "gpu-a", "gpu-b", "gpu-c", "gpu-d", "a100", "pool-a", "pool-b",
    "busy", "fake-llama",
)  # fmt: skip


def declaring_test_pools(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` whose policy declares ``TEST_POOLS``, unless it lists
    its own ``known_pools`` (a test of the declaration itself)."""
    from controlplane.domain.policy import Policy

    policy = settings.get("policy") or Policy()
    if not policy.known_pools:
        policy = policy.model_copy(update={"known_pools": list(TEST_POOLS)})
    return settings | {"policy": policy}


def free_port() -> int:
    """A TCP port free on the loopback now (for a process a test starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def add_tenants(url: str, *tenants: TenantConfig) -> None:
    """Write tenants straight to the config database at ``url``."""
    engine = make_engine(url)
    try:
        repo = ConfigRepository(engine)
        for t in tenants:
            repo.add_tenant(t)
    finally:
        engine.dispose()


def wait_until(
    predicate: Callable[[], T | None],
    *,
    message: str,
    timeout: float = 20.0,
    interval: float = 0.025,
) -> T:
    """Call ``predicate`` until it returns a truthy value and return that value.

    For state another thread or process changes (a server's background task,
    a load generator): the wait is bounded by ``timeout`` seconds of wall
    time, generous because these machines are shared and slow. When time runs
    out the predicate has had its last chance, and an ``AssertionError`` says
    what was waited for (``message``, e.g. "the queue to empty") and for how
    long, with the last value the predicate returned.
    """
    deadline = time.monotonic() + timeout
    attempts = 0
    while True:
        value = predicate()
        attempts += 1
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(
                f"timed out after {timeout:g} s ({attempts} tries) waiting for {message}; "
                f"last value: {value!r}"
            )
        time.sleep(interval)


@dataclass
class ErrorDetails:
    """The ``google.rpc.Status`` a failed call carried, unpacked."""

    info: error_details_pb2.ErrorInfo
    bad_request: error_details_pb2.BadRequest | None
    retry: error_details_pb2.RetryInfo | None


def error_details(err: grpc.RpcError) -> ErrorDetails:
    """Decode ``grpc-status-details-bin`` of a failed call (``rpc_status``
    also checks that its code and message are the call's). Exactly one
    ErrorInfo is expected; BadRequest and RetryInfo at most once."""
    status = rpc_status.from_call(err)
    assert status is not None, f"no status details on {err}"
    found: dict[str, list[Any]] = {}
    for any_detail in status.details:
        for cls in (
            error_details_pb2.ErrorInfo,
            error_details_pb2.BadRequest,
            error_details_pb2.RetryInfo,
        ):
            if any_detail.Is(cls.DESCRIPTOR):
                message = cls()
                any_detail.Unpack(message)
                found.setdefault(cls.DESCRIPTOR.name, []).append(message)
                break
        else:
            raise AssertionError(f"unexpected detail {any_detail.type_url}")
    assert len(found.get("ErrorInfo", ())) == 1, status
    assert all(len(v) == 1 for v in found.values()), status
    return ErrorDetails(
        info=found["ErrorInfo"][0],
        bad_request=found.get("BadRequest", [None])[0],
        retry=found.get("RetryInfo", [None])[0],
    )
