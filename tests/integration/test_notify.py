"""The LISTEN/NOTIFY listener on a real PostgreSQL: a notification is heard
only when its transaction commits, configuration writes and lease releases
announce themselves, and a listener whose session is killed reconnects and
fires every callback once (the receivers then re-read what they may have
missed)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from sqlalchemy import Engine, create_engine

from controlplane.domain import TenantConfig
from controlplane.domain.keys import Role
from controlplane.domain.policy import Policy
from controlplane.store.config import ConfigRepository
from controlplane.store.db import make_engine, upgrade
from controlplane.store.keys import KeyStore
from controlplane.store.leases import HaStore
from controlplane.store.notify import CHANNELS, CONFIG_CHANNEL, LEASES_CHANNEL, Listener, notify
from tests.support import wait_until

SENTINEL = "sentinel"  # sent last: once heard, everything committed before it was too


class Heard:
    """A listener on a loop of its own thread, recording what its callbacks got."""

    def __init__(self, url: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.listener = Listener(url, probe_s=1.0)
        self.got: dict[str, list[str | None]] = {c: [] for c in CHANNELS}
        for channel in CHANNELS:
            self.listener.on(channel, self.got[channel].append)
        self.call(self.listener.start)
        wait_until(lambda: self.listener.connected, message="the listener to connect")

    def call(self, fn: Any) -> Any:
        fut: Future[Any] = Future()

        def run() -> None:
            try:
                fut.set_result(fn())
            except BaseException as exc:
                fut.set_exception(exc)

        self.loop.call_soon_threadsafe(run)
        return fut.result(timeout=30)

    def seen(self, channel: str) -> list[str | None]:
        return list(self.call(lambda: self.got[channel]))

    def payloads(self, channel: str) -> list[str]:
        """What notifications carried (the resyncs' None left out)."""
        return [p for p in self.seen(channel) if p is not None]

    def wait_for(self, channel: str, payload: str) -> list[str]:
        def arrived() -> list[str] | None:
            got = self.payloads(channel)
            return got if payload in got else None

        return wait_until(arrived, message=f"{payload!r} on {channel}")

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.listener.stop(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)
        self.loop.close()


@pytest.fixture
def migrated(pg_url: str) -> str:
    upgrade(pg_url)
    return pg_url


@pytest.fixture
def engine(migrated: str) -> Iterator[Engine]:
    eng = make_engine(migrated)
    yield eng
    eng.dispose()


@pytest.fixture
def heard(migrated: str) -> Iterator[Heard]:
    h = Heard(migrated)
    yield h
    h.close()


def send(engine: Engine, channel: str, payload: str) -> None:
    with engine.begin() as conn:
        notify(conn, channel, payload)


@pytest.mark.postgres
def test_heard_only_when_committed(heard: Heard, engine: Engine) -> None:
    with pytest.raises(RuntimeError, match="roll back"), engine.begin() as conn:
        notify(conn, CONFIG_CHANNEL, "rolled back")
        raise RuntimeError("roll back")
    send(engine, CONFIG_CHANNEL, "committed")
    send(engine, CONFIG_CHANNEL, SENTINEL)
    # Delivered in commit order: with the sentinel heard, nothing else is on its way.
    assert heard.wait_for(CONFIG_CHANNEL, SENTINEL) == ["committed", SENTINEL]
    assert heard.listener.received[CONFIG_CHANNEL] == 2
    assert heard.payloads(LEASES_CHANNEL) == []


@pytest.mark.postgres
def test_config_writes_announce_themselves(heard: Heard, engine: Engine) -> None:
    repo = ConfigRepository(engine)
    repo.add_tenant(TenantConfig("acme", token_rate=Decimal(10), burst_tokens=100))
    repo.set_enabled("acme", False)
    repo.update_policy(Policy(), {"bp_hard_threshold": 0.9}, [])
    _, info = KeyStore(engine).create_key("edge", Role.ADMIN)
    KeyStore(engine).revoke_key(info.key_id)
    send(engine, CONFIG_CHANNEL, SENTINEL)
    assert heard.wait_for(CONFIG_CHANNEL, SENTINEL) == [
        "tenant.create tenant:acme",
        "tenant.disable tenant:acme",
        "policy.update policy",
        f"key.create key:{info.key_id}",
        f"key.revoke key:{info.key_id}",
        SENTINEL,
    ]


@pytest.mark.postgres
def test_lease_releases_announce_the_cells(heard: Heard, engine: Engine) -> None:
    store = HaStore(engine)
    epochs = {cell: store.acquire(cell, "m1", 30) for cell in ("a", "b", "c")}
    assert store.release("a", "m1", epochs["a"] or 0)
    assert not store.release("b", "m1", 999)  # not our epoch: nothing released, nothing said
    assert store.release_many("m1", {"b": epochs["b"] or 0, "c": epochs["c"] or 0}) == 2
    send(engine, LEASES_CHANNEL, SENTINEL)
    got = heard.wait_for(LEASES_CHANNEL, SENTINEL)
    assert got[0] == "a" and sorted(got[1:3]) == ["b", "c"] and got[3:] == [SENTINEL]
    assert heard.payloads(CONFIG_CHANNEL) == []


@pytest.mark.postgres
def test_reconnects_after_its_session_is_killed_and_resyncs_once(
    heard: Heard, engine: Engine, pg_admin_dsn: str
) -> None:
    listener = heard.listener
    # After the first connect: one resync per callback (missed-while-starting).
    assert heard.seen(CONFIG_CHANNEL) == [None] and heard.seen(LEASES_CHANNEL) == [None]
    first = listener.backend_pid
    with psycopg.connect(pg_admin_dsn, autocommit=True) as admin:
        row = admin.execute("SELECT pg_terminate_backend(%s)", [first]).fetchone()
        assert row is not None and row[0] is True
    wait_until(lambda: listener.connects == 2 and listener.connected, message="a reconnect")
    assert listener.backend_pid != first
    send(engine, CONFIG_CHANNEL, SENTINEL)
    heard.wait_for(CONFIG_CHANNEL, SENTINEL)
    # Exactly one more resync per callback, before what came after the reconnect.
    assert heard.seen(CONFIG_CHANNEL) == [None, None, SENTINEL]
    assert heard.seen(LEASES_CHANNEL) == [None, None]
    registry = CollectorRegistry()
    registry.register(listener.collector())
    text = generate_latest(registry).decode()
    assert "burstgate_notify_connected 1.0" in text
    assert f'burstgate_notify_received_total{{channel="{CONFIG_CHANNEL}"}} 1.0' in text
    assert f'burstgate_notify_received_total{{channel="{LEASES_CHANNEL}"}} 0.0' in text


def test_inert_on_sqlite(tmp_path: Any) -> None:
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    listener = Listener(url)
    assert not listener.enabled

    async def life() -> None:
        listener.start()
        await listener.stop()

    asyncio.run(life())
    assert listener.connects == 0
    engine = create_engine(url)
    with engine.begin() as conn:
        notify(conn, CONFIG_CHANNEL, "nothing to send it to")  # a no-op, not an error
    engine.dispose()


def test_refuses_an_unknown_channel(tmp_path: Any) -> None:
    listener = Listener(f"sqlite:///{tmp_path / 'db.sqlite'}")
    with pytest.raises(ValueError, match="channel: 'burstgate_nope'"):
        listener.on("burstgate_nope", print)
