"""PostgreSQL LISTEN/NOTIFY: changes pushed to every replica at once, the
config poll kept as the safety net (docs/ha.md, "Config fan-out").

**Senders.** ``notify(conn, channel, payload)`` queues ``pg_notify`` in the
caller's transaction: PostgreSQL delivers it only when that transaction
commits, so a listener never hears of a change that rolled back. Every
audited configuration write (``store.audit.log_change``: tenants, lanes,
policy, prices, API keys) sends one on ``burstgate_config``; a lease release
(``store.leases``) sends the cell id on ``burstgate_leases``. A no-op on SQLite.

**The listener.** One dedicated psycopg connection (autocommit, TCP
keepalives) per server, ``LISTEN`` on the channels, on a daemon thread that
hands each notification to the server's event loop
(``loop.call_soon_threadsafe``); callbacks run on the loop. Why a thread
rather than psycopg's async connection on the loop: the loop decides
admissions and must never wait on this socket (a connect to a hung database
blocks up to its ``connect_timeout``); the thread works with any loop
(uvloop, the tests' loops, simulated clocks) and, being a daemon, can be
abandoned at stop if the database hangs (the stop is bounded), as
``replica_lock`` does. The thread waits in ``select`` on the socket and a
wake-up pipe, so a stop is seen at once, and a notification costs no round
trip (``PQconsumeInput`` then ``PQnotifies``); when idle for ``probe_s`` it
sends ``SELECT 1`` so that a silently dead link is noticed (keepalives and
``tcp_user_timeout`` bound that wait).

**Missed notifications.** A notification sent while the listener is not
connected is lost. So after every connect (the first one too: changes made
between the server's first config load and its ``LISTEN`` were never
announced to it) every callback is fired once with ``None``: the receivers
then re-read, as the poll would. The connection is re-made with capped,
jittered exponential backoff. CockroachDB has no LISTEN/NOTIFY: the listener
is never connected there, and the poll carries every change (set
``BURSTGATE_CONFIG_NOTIFY=false``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import select
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import structlog
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import Connection, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

from controlplane.aiotime import within
from controlplane.settings import sqlalchemy_url
from controlplane.store.db import PG_KEEPALIVES

log = structlog.get_logger("burstgate.notify")

CONFIG_CHANNEL = "burstgate_config"  # payload: "<action> <target>", e.g. "tenant.update tenant:a"
LEASES_CHANNEL = "burstgate_leases"  # payload: a released cell's id
CHANNELS = (CONFIG_CHANNEL, LEASES_CHANNEL)
# PostgreSQL refuses payloads of 8000 bytes or more; ours are ids, cut well short.
MAX_PAYLOAD_CHARS = 1000

# libpq options of the listener's connection unless the database URL sets
# them: the keepalives of every connection (store/db.py), a bounded connect,
# and unacknowledged data given up after 10 s.
PG_CONNECT_DEFAULTS: dict[str, str] = {
    **PG_KEEPALIVES,
    "connect_timeout": "10",
    "tcp_user_timeout": "10000",
}
BACKOFF_MIN_S = 0.1  # first retry after a working connection is lost
BACKOFF_MAX_S = 5.0  # the cap, reached after a few failed connects
PROBE_S = 5.0  # idle this long: SELECT 1, to notice a dead link
STOP_WAIT_S = 2.0  # how long stop() waits for the thread (then left to exit)

# Called on the event loop with the payload, or None after a (re)connect:
# "something may have changed meanwhile, re-read".
Callback = Callable[[str | None], None]


def notify(conn: Session | Connection, channel: str, payload: str) -> None:
    """Queue a notification in the caller's open transaction (sent only if it
    commits). A no-op on any database but PostgreSQL."""
    bind = conn if isinstance(conn, Connection) else conn.get_bind()
    if bind.dialect.name != "postgresql":
        return
    conn.execute(
        text("SELECT pg_notify(:channel, :payload)"),
        {"channel": channel, "payload": payload[:MAX_PAYLOAD_CHARS]},
    )


class Listener:
    """LISTEN on ``channels`` of a PostgreSQL database; ``on(channel, cb)``
    registers callbacks (before or after ``start``). Inert on SQLite
    (``enabled`` False). ``start``/``stop`` are called on the event loop the
    callbacks should run on."""

    def __init__(
        self,
        database_url: str,
        channels: Iterable[str] = CHANNELS,
        *,
        name: str = "burstgate notify",
        backoff_min_s: float = BACKOFF_MIN_S,
        backoff_max_s: float = BACKOFF_MAX_S,
        probe_s: float = PROBE_S,
    ) -> None:
        url = make_url(sqlalchemy_url(database_url))
        self.enabled = url.get_backend_name() == "postgresql"
        self.channels = tuple(dict.fromkeys(channels))
        self.backoff_min_s, self.backoff_max_s = backoff_min_s, backoff_max_s
        self.probe_s = probe_s
        self._params: dict[str, Any] = {}
        if self.enabled:
            import psycopg.conninfo

            plain = url.set(drivername="postgresql")  # as libpq reads it
            params = psycopg.conninfo.conninfo_to_dict(plain.render_as_string(hide_password=False))
            for key, value in PG_CONNECT_DEFAULTS.items():
                params.setdefault(key, value)
            params.setdefault("application_name", name[:63])  # NAMEDATALEN - 1
            self._params = params
        self._callbacks: dict[str, list[Callback]] = {c: [] for c in self.channels}
        self.connected = False
        self.connects = 0  # successful connects (each followed by one resync)
        self.backend_pid: int | None = None  # of the current connection
        self.received: Counter[str] = Counter()  # notifications dispatched, by channel
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._wake_r = self._wake_w = -1
        self._exited: asyncio.Future[None] | None = None

    def on(self, channel: str, callback: Callback) -> None:
        if channel not in self._callbacks:
            raise ValueError(f"channel: {channel!r} is not one of {list(self.channels)}")
        self._callbacks[channel].append(callback)

    # --- life cycle (on the loop) ---

    def start(self) -> None:
        if not self.enabled or self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._exited = self._loop.create_future()
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._run, name="notify-listener", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Stop listening; waits at most STOP_WAIT_S for the thread (one
        blocked on a hung database is left to the process's exit)."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stopping.set()
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        assert self._exited is not None
        with contextlib.suppress(TimeoutError):
            await within(asyncio.shield(self._exited), STOP_WAIT_S)
        if self._exited.done():  # the thread is gone: nobody uses the pipe any more
            os.close(self._wake_r)
            os.close(self._wake_w)
        else:
            log.warning("notify listener left to the process's exit (database not answering)")

    # --- on the loop ---

    def _dispatch(self, channel: str | None, payload: str | None) -> None:
        if channel is None:  # (re)connected: everyone re-reads once
            targets = [(c, cb) for c, cbs in self._callbacks.items() for cb in cbs]
        else:
            self.received[channel] += 1
            targets = [(channel, cb) for cb in self._callbacks.get(channel, ())]
        for ch, cb in targets:
            try:
                cb(payload)
            except Exception:
                log.exception("notify callback failed", channel=ch)

    # --- on the thread ---

    def _post(self, channel: str | None, payload: str | None) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody listens
            self._loop.call_soon_threadsafe(self._dispatch, channel, payload)

    def _run(self) -> None:
        delay = self.backoff_min_s
        try:
            while not self._stopping.is_set():
                conn: Any = None
                try:
                    conn = self._connect()
                    delay = self.backoff_min_s
                    self._post(None, None)
                    self._pump(conn)
                except Exception as exc:  # psycopg.Error, OSError: try again
                    if not self._stopping.is_set():
                        log.warning("notify listener disconnected; reconnecting",
                                    error=str(exc).strip(), retry_s=round(delay, 2))  # fmt: skip
                finally:
                    self.connected = False
                    if conn is not None:
                        with contextlib.suppress(Exception):
                            conn.close()
                if self._stopping.wait(delay * random.uniform(0.8, 1.2)):
                    break
                delay = min(delay * 2, self.backoff_max_s)
        finally:
            self._settle_exit()

    def _settle_exit(self) -> None:
        loop, fut = self._loop, self._exited
        if loop is None or fut is None:
            return

        def settle() -> None:
            if not fut.done():
                fut.set_result(None)

        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(settle)

    def _connect(self) -> Any:
        import psycopg
        from psycopg import sql

        conn = psycopg.connect(**self._params, autocommit=True)
        try:
            # Notifications seen while a statement runs (the probe) reach this
            # handler; the ones that arrive while idle are read in _pump.
            conn.add_notify_handler(lambda n: self._post(n.channel, n.payload))
            listen = "; ".join(
                f"LISTEN {sql.Identifier(c).as_string(conn)}" for c in self.channels
            )
            conn.execute(listen.encode())  # one simple query: no parameters
            self.backend_pid = conn.info.backend_pid
        except BaseException:
            conn.close()
            raise
        self.connected = True
        self.connects += 1
        log.info("notify listener connected", channels=list(self.channels),
                 backend_pid=self.backend_pid)  # fmt: skip
        return conn

    def _pump(self, conn: Any) -> None:
        """Deliver notifications until a stop (returns) or a broken
        connection (raises)."""
        import psycopg
        from psycopg import pq

        pgconn, fd, encoding = conn.pgconn, conn.fileno(), conn.info.encoding
        while not self._stopping.is_set():
            ready, _, _ = select.select([fd, self._wake_r], [], [], self.probe_s)
            if self._wake_r in ready:
                return
            if fd not in ready:  # idle: make sure the link still works
                conn.execute("SELECT 1")
                continue
            pgconn.consume_input()  # raises when the connection broke
            if pgconn.status == pq.ConnStatus.BAD:
                raise psycopg.OperationalError("notify listener: connection lost")
            while (n := pgconn.notifies()) is not None:
                self._post(n.relname.decode(encoding), n.extra.decode(encoding))

    def collector(self) -> Collector:
        return _NotifyCollector(self)


class _NotifyCollector(Collector):
    def __init__(self, listener: Listener) -> None:
        self._listener = listener

    def collect(self) -> Iterator[Metric]:
        listener = self._listener
        yield GaugeMetricFamily(
            "burstgate_notify_connected",
            "1 while the LISTEN connection is up (config and lease changes arrive at once; "
            "else the config poll carries them)",
            value=int(listener.connected),
        )
        received = CounterMetricFamily(
            "burstgate_notify_received",
            "Notifications received on the LISTEN connection, by channel",
            labels=["channel"],
        )
        counts = dict(listener.received)
        for channel in listener.channels:
            received.add_metric([channel], counts.get(channel, 0))
        yield received
