"""One AdmitStream call and what is in flight on it.

A batch's entries are registered under its batch_id before it is written.
Its first result answers every entry at once, except those with
``queued[i]``: the server holds them in a queue and owes each exactly one
*release* (a later result with the same batch_id whose ``entry`` column
lists the batch indexes it answers). The batch is forgotten when nothing is
owed. Whatever is still registered when the stream ends is what it left
unanswered.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb
from burstgate_client.sdk.entries import Entry
from burstgate_client.sdk.model import Admission, admissions_of_result

log = logging.getLogger("burstgate.sdk")


@dataclass(slots=True, eq=False)
class Session:
    call: Any  # grpc.aio.StreamStreamCall
    batches: dict[int, list[Entry]] = field(default_factory=dict)
    owed: dict[int, int] = field(default_factory=dict)  # batch_id -> releases owed
    unacked: int = 0  # batches written whose first result has not come
    sent_at: deque[float] = field(default_factory=deque)  # of those batches, oldest first
    last_read: float = 0.0  # loop time of the last result read
    aborted: bool = False  # cancelled by the SDK (it went silent): already tripped
    ended: bool = False
    error: BaseException | None = None  # why it ended (None: it just ended)
    reader: asyncio.Task[None] | None = None

    def dispatch(
        self, res: pb.AdmitBatchResult, settle: Callable[[Entry, Admission], None], now: float,
        settle_many: Callable[[list[Entry], list[Admission]], None] | None = None,
    ) -> int:  # fmt: skip
        """Answer the entries ``res`` answers (``settle(entry, answer)``
        each, or ``settle_many(entries, answers)`` once when given); return
        how many it says the server holds in a queue (a first result), else 0."""
        bid = res.batch_id
        group = self.batches.get(bid)
        if group is None:
            log.warning("AdmitStream result for unknown batch %d ignored", bid)
            return 0
        queued_now = 0
        if not res.entry:  # the batch's first result: column k answers entry k
            self.unacked = max(0, self.unacked - 1)
            if self.sent_at:
                self.sent_at.popleft()
            queued = list(res.queued)
            if not any(queued):  # the common case: every entry answered now
                columns = list(range(len(group)))
            else:
                columns = []
                for k, e in enumerate(group):
                    if k < len(queued) and queued[k]:
                        e.queued, e.queued_at = True, now
                        queued_now += 1
                    else:
                        columns.append(k)
            entries = columns
            owed = queued_now
        else:  # a release: column k answers entry[k]
            pairs = [(k, i) for k, i in enumerate(res.entry) if i < len(group)]
            columns, entries = [k for k, _ in pairs], [i for _, i in pairs]
            owed = self.owed.get(bid, 0) - len(res.entry)
        answered = group if len(entries) == len(group) else [group[i] for i in entries]
        answers = admissions_of_result(res, columns, [e.request_id for e in answered])
        if settle_many is not None:
            settle_many(answered, answers)
        else:
            for e, a in zip(answered, answers, strict=True):
                settle(e, a)
        if owed > 0:
            self.owed[bid] = owed
        else:
            self.batches.pop(bid, None)
            self.owed.pop(bid, None)
        return queued_now

    def silence(self, now: float) -> float:
        """How long the stream has owed a first result without reading
        anything (0 when it owes none)."""
        if not self.sent_at:
            return 0.0
        return now - max(self.last_read, self.sent_at[0])

    def end(self, err: BaseException | None) -> dict[int, list[Entry]]:
        """Mark the stream ended; return the batches it left (partly)
        unanswered, by batch_id."""
        self.ended, self.error = True, err
        left, self.batches = self.batches, {}
        self.owed.clear()
        self.unacked = 0
        self.sent_at.clear()
        return left
