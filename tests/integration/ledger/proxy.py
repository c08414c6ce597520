"""A TCP proxy the test controls, between the server and PostgreSQL: cutting
it makes the database unreachable for that server alone (the machine's
PostgreSQL, shared with other tests, keeps running).

Two ways to fail: ``cut()`` closes every connection and refuses new ones (a
database that is down), ``hang()`` keeps connections open and accepts new
ones but forwards nothing (a database, or a network, that stopped
answering: no error ever comes back, only silence)."""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time


class TcpProxy:
    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._up = True
        self._hung = threading.Event()  # set: forward nothing, close nothing
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            with self._lock:
                up = self._up
            if not up:
                client.close()  # refused: the database "is down"
                continue
            try:
                server = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, server]
            threading.Thread(target=self._pump, args=(client, server), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        socks = [a, b]
        try:
            while True:
                if self._hung.is_set():  # hold the bytes in the kernel's buffers
                    time.sleep(0.02)
                    continue
                ready, _, _ = select.select(socks, [], [], 0.5)
                if self._hung.is_set():  # hung while waiting: what came stays unread
                    continue
                for s in ready:
                    data = s.recv(65536)
                    if not data:
                        return
                    (b if s is a else a).sendall(data)
        except (OSError, ValueError):  # ValueError: select() on a socket cut() closed
            return
        finally:
            for s in socks:
                with contextlib.suppress(OSError):
                    s.close()

    def cut(self) -> None:
        """Drop every connection and refuse new ones."""
        with self._lock:
            self._up = False
            conns, self._conns = self._conns, []
        for s in conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()

    def hang(self) -> None:
        """Stop forwarding, without closing anything (``restore`` resumes:
        what was sent meanwhile is delivered then)."""
        self._hung.set()

    def restore(self) -> None:
        with self._lock:
            self._up = True
        self._hung.clear()

    def close(self) -> None:
        self._closed = True
        self.cut()
        self.listener.close()
