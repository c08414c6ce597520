"""Helpers shared by the tests (no fixtures: those live in conftest.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from controlplane.domain import TenantConfig
from controlplane.store.config import ConfigRepository
from controlplane.store.db import make_engine

T = TypeVar("T")


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
