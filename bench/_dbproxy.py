"""A TCP proxy between the soaked server and PostgreSQL, with two kinds of
outage the soak alternates:

* ``refuse`` -- every open connection is closed and new ones are closed as
  soon as they are accepted: the database "is down" (what
  tests/integration/ledger/proxy.py's ``cut`` does).
* ``hang`` -- nothing is forwarded any more, in either direction, and
  nothing is closed: open connections and new ones (accepted, never
  answered) look like a database behind a dead network path. Bytes sent
  meanwhile wait in the socket buffers; ``restore`` resumes forwarding, so
  whatever the server has not given up on by then goes through.

The machine's PostgreSQL, shared with other work, keeps running: only the
soaked server's connections go through here. Threads, one per direction
per connection; each blocks at most ``_TICK`` s so a mode change is
noticed at once.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
from typing import Literal

Mode = Literal["up", "refuse", "hang"]
_TICK = 0.2


class DbProxy:
    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self._lock = threading.Lock()
        self._flowing = threading.Event()  # set while the mode is "up"
        self._flowing.set()
        self._mode: Mode = "up"
        self._conns: set[socket.socket] = set()
        self._closed = False
        self.accepted = 0  # connections the server opened, for the report
        threading.Thread(target=self._accept, name="dbproxy-accept", daemon=True).start()

    @property
    def mode(self) -> Mode:
        return self._mode

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.accepted += 1
            with self._lock:
                mode = self._mode
            if mode == "refuse":
                client.close()
                continue
            # Hung: the connection is accepted but not answered until restore.
            threading.Thread(target=self._connect, args=(client,), daemon=True).start()

    def _connect(self, client: socket.socket) -> None:
        while not self._flowing.wait(_TICK):
            if self._closed or self._mode == "refuse":
                client.close()
                return
        try:
            server = socket.create_connection(self.upstream, timeout=5)
        except OSError:
            client.close()
            return
        server.settimeout(None)
        with self._lock:
            if self._mode == "refuse" or self._closed:
                client.close()
                server.close()
                return
            self._conns |= {client, server}
        for a, b in ((client, server), (server, client)):
            threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        """Copy ``src`` to ``dst`` while flowing; on EOF or an error close both."""
        try:
            while True:
                if not self._flowing.wait(_TICK):
                    if self._closed:
                        return
                    continue  # hung: read nothing, close nothing
                ready, _, _ = select.select([src], [], [], _TICK)
                if not ready or not self._flowing.is_set():
                    continue
                data = src.recv(65536)
                if not data:
                    return
                dst.sendall(data)
        except (OSError, ValueError):  # ValueError: select() on a socket closed by cut()
            return
        finally:
            self._drop(src, dst)

    def _drop(self, *socks: socket.socket) -> None:
        with self._lock:
            self._conns -= set(socks)
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()

    def cut(self, mode: Literal["refuse", "hang"]) -> None:
        with self._lock:
            self._mode = mode
            self._flowing.clear()
            conns = list(self._conns) if mode == "refuse" else []
        if conns:
            self._drop(*conns)

    def restore(self) -> None:
        with self._lock:
            self._mode = "up"
            self._flowing.set()

    def close(self) -> None:
        self._closed = True
        self.cut("refuse")
        self.listener.close()
