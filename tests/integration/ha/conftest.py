"""A migrated PostgreSQL database per test, and its HaStore."""

from __future__ import annotations

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
    eng.dispose()


@pytest.fixture
def store(engine: Engine) -> HaStore:
    return HaStore(engine)
