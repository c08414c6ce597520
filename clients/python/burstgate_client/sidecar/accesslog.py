"""The sidecar's access log (opt-in: ``--access-log``, ``access_log:``):
one JSON object per line for every completions request, written when its
answer ends (a stream: when the stream ends), with what an operator asks
of one request — who (tenant, lane, model), what became of it (status,
outcome, the refusal's reason), where its time went (held in burstgate's
gate, the engine, in all) and its tokens. FIELDS lists the keys and
docs/sidecar.md ("Access log") what each means.

Logging: the standard library's, as the rest of the client wing (structlog
is the server's; the client wing does not take a dependency for one line
per request). The line is serialised with orjson on the event loop (about
a microsecond) and handed to a ``QueueHandler``; a ``QueueListener`` thread
writes it, so a slow stdout (a container's log pipe) or a slow disk never
stalls the event loop. The logger is this sidecar's own (not registered
with ``logging.getLogger``): two sidecars in one process (tests, the load
generator's local sidecar) never write each other's lines, and a root
logger's configuration adds nothing to the lines.
"""

from __future__ import annotations

import logging
import queue
import sys
import time
from logging.handlers import QueueHandler, QueueListener
from typing import Any

import orjson

from burstgate_client.errors import InvalidArgument

# Every line's keys, in this order (null when not known for the request).
FIELDS = ("ts", "request_id", "correlation_id", "path", "tenant", "lane", "model", "stream",
          "status", "outcome", "reason", "queue_wait_ms", "prompt_tokens", "generated_tokens",
          "upstream_ms", "total_ms", "client_disconnected")  # fmt: skip


class AccessLog:
    """``where``: "-" for stdout, else a file (appended to, created when
    absent). Raises InvalidArgument(--access-log) when it cannot be opened."""

    def __init__(self, where: str) -> None:
        self.where = where
        handler: logging.Handler
        if where == "-":
            handler = logging.StreamHandler(sys.stdout)
        else:
            try:
                handler = logging.FileHandler(where, encoding="utf-8")
            except OSError as exc:
                raise InvalidArgument("--access-log", f"cannot open {where}: "
                                      f"{exc.strerror or exc}") from None  # fmt: skip
        handler.setFormatter(logging.Formatter("%(message)s"))
        self._handler = handler
        q: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
        self._listener = QueueListener(q, handler)
        self._logger = logging.Logger("burstgate.sidecar.access", logging.INFO)
        self._logger.propagate = False
        self._logger.addHandler(QueueHandler(q))
        self._listener.start()

    def write(self, **fields: Any) -> None:
        """One line; ``fields`` by FIELDS' names (missing ones are null)."""
        line = {"ts": _now()} | {k: fields.get(k) for k in FIELDS[1:]}
        self._logger.info(orjson.dumps(line).decode())

    def close(self) -> None:
        """Write what is queued, then close the file (not stdout)."""
        self._listener.stop()
        if self.where != "-":
            self._handler.close()
        else:
            self._handler.flush()


def _now() -> str:
    """UTC, ISO 8601 to the millisecond."""
    t = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}Z"
