"""A migrated PostgreSQL database per test, and its HaStore."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from sqlalchemy import Engine

from controlplane.store.db import make_engine, upgrade
from controlplane.store.leases import HaStore


@pytest.fixture
def ha_url(pg_url: str) -> str:
    upgrade(pg_url)
    return pg_url


@pytest.fixture
def engine(ha_url: str) -> Iterator[Engine]:
    eng = make_engine(ha_url)
    yield eng
    # Scale-out's database calls run on daemon threads that a stop does not
    # wait for (controlplane/ha/_blocking.py: a cancelled refresh's call may
    # finish later, which the lease protocol tolerates). Let them end before
    # the pool goes, or a connection they check in afterwards is dropped
    # unclosed and its ResourceWarning fails whichever test runs next.
    deadline = time.monotonic() + 15.0
    for t in threading.enumerate():
        if t.name.startswith("ha-") and t.daemon:
            t.join(max(0.0, deadline - time.monotonic()))
    eng.dispose()


@pytest.fixture
def store(engine: Engine) -> HaStore:
    return HaStore(engine)
