"""The admissions a LiteLLM proxy holds open, each settled exactly once.

LiteLLM reports the end of a call in several places, and more than one can
fire for the same call: the success event (also for a stream, with its
assembled usage, and for a stream whose client left, with the partial
usage LiteLLM assembled), the proxy's failure hook, and the end of the
stream the hook wraps (which covers a client that left before LiteLLM had
anything to report). Whichever comes first takes the ticket out of
:class:`Tickets` (one ``pop``, no await between the lookup and the removal:
on one event loop nothing interleaves), and only the holder of the ticket
sends the Complete. The Complete's ``request_id`` is LiteLLM's
``litellm_call_id``, so a Complete that is redelivered (the SDK's spool) or
a client's retry with the same ``x-litellm-call-id`` is idempotent at the
server too.

A ticket nothing ever settles (a path of LiteLLM's the hook does not see)
is forgotten after ``TICKET_TTL_S``, with a warning: the server's
reservation TTL frees its tokens then.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from burstgate_client.litellm.mapping import Usage

log = logging.getLogger("burstgate.litellm")

TICKET_TTL_S = 3600.0


@dataclass(slots=True)
class Ticket:
    tenant: str
    request_id: str
    prompt_tokens: int  # the estimate admitted
    admitted_mono: float = field(default_factory=time.monotonic)
    # What the wrapped stream showed, for a stream LiteLLM reports nothing on:
    streamed_chunks: int = 0  # chunks with text (a decoding step each: >= 1 token)
    streamed_usage: Usage | None = None  # the usage chunk, when it came
    stream_started_ns: int = 0
    stream_ended_ns: int = 0
    first_token_ns: int = 0  # when the first chunk with text came (0: not streamed, or none)

    def seen(self) -> Usage:
        """The usage the stream showed: its usage chunk, else the estimated
        prompt and the chunks with text."""
        if self.streamed_usage is not None:
            return self.streamed_usage
        return Usage(self.prompt_tokens, self.streamed_chunks, 0)


class Tickets:
    """Open admissions by request id (LiteLLM's litellm_call_id)."""

    def __init__(self, ttl_s: float = TICKET_TTL_S) -> None:
        self._open: OrderedDict[str, Ticket] = OrderedDict()
        self._ttl_s = ttl_s

    def __len__(self) -> int:
        return len(self._open)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._open

    def open(self, ticket: Ticket) -> None:
        self._expire(ticket.admitted_mono)
        self._open[ticket.request_id] = ticket
        self._open.move_to_end(ticket.request_id)

    def get(self, request_id: object) -> Ticket | None:
        return self._open.get(request_id) if isinstance(request_id, str) else None

    def take(self, request_id: object) -> Ticket | None:
        """The ticket, removed: the caller (alone) settles it."""
        return self._open.pop(request_id, None) if isinstance(request_id, str) else None

    def _expire(self, now: float) -> None:
        while self._open:
            oldest = next(iter(self._open.values()))
            if now - oldest.admitted_mono < self._ttl_s:
                return
            del self._open[oldest.request_id]
            log.warning("burstgate: request %s (tenant %s) was never settled; forgotten after "
                        "%.0f s (the server's reservation TTL frees it)", oldest.request_id,
                        oldest.tenant, self._ttl_s)  # fmt: skip
