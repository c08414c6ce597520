"""Micro-batching of concurrent Admits onto one AdmitStream.

Admits arriving within ``window_s`` of the first one (flushed early at
``batch_max``) go as one AdmitBatch per (model, pool): those two are
batch-wide in the protocol. Each entry's ``max_wait_ms`` is its own deadline
less a margin for the answer's trip (a tenth of the time left, 5 to 100 ms,
as the server's own margin for unary Admit), so a request the server holds
in its queue (``queued[i]`` in the batch's first result) is answered by a
later *release* result before the caller's deadline; the caller just awaits.
With ``wait_in_gate=False`` no ``max_wait_ms`` is sent: the server answers
every entry at once on its columnar fast path (several times cheaper per
decision, bench/bench_sdk.py), refusing what its queue would have held.

Self-clocking, as Nagle's algorithm for TCP: an Admit that finds no batch
awaiting its first result (and none waiting to be written) is sent at the
end of the current loop iteration, with whatever else arrived in it, so a
lone caller pays no window. While a batch is in flight, arrivals are held
for at most ``window_s`` (default 200 µs; or until ``batch_max``), and sent
early when that batch's first result comes back: under load the batches
grow to what arrives in one round trip, bounded by the window. The loop's
timers are rounded up to its resolution (1 ms for epoll and libuv), so the
window is kept by the events that wake the loop anyway: an arrival that
finds the held batch older than ``window_s`` sends it at the end of that
loop iteration (with the rest of the iteration's arrivals), and the answer
to the batch in flight sends it at once; the timer is only the backstop when neither comes
(then the hold is up to 1 ms). ``window_s=0`` never holds.

Failures (see breaker.py for "unreachable"):

- stream broken (UNAVAILABLE, CANCELLED, ended with answers owed) or silent:
  the breaker trips, every entry still unanswered on it gets its lane's
  FailPolicy (none is lost; the server dequeues a failed stream's entries);
  the next batch after the breaker closes opens a new stream.
- stream ended by an error that is the server's answer (INVALID_ARGUMENT,
  PERMISSION_DENIED, UNAUTHENTICATED, ...): the server is up, so the
  unanswered entries are asked again one by one with unary Admit, and each
  caller gets its own answer or error; the (field, value) the error named
  (``batch 7: lane[3]: ...``) goes unary for a while (suspects.py), so one
  caller's unknown lane does not keep breaking the stream for everyone, and
  the stream is reopened only after a backoff (unary meanwhile).
- no answer by a caller's deadline, and late answers: answers.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections import deque
from collections.abc import Callable
from typing import Any

import grpc

from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb
from burstgate_client.redirects import not_owner
from burstgate_client.sdk.answers import Answers
from burstgate_client.sdk.breaker import TRANSPORT_CODES, Breaker, unreachable
from burstgate_client.sdk.counters import Counters
from burstgate_client.sdk.entries import Entry
from burstgate_client.sdk.model import (
    Admission,
    FailPolicy,
    admission_of_response,
    not_owner_admission,
)
from burstgate_client.sdk.session import Session
from burstgate_client.sdk.suspects import Suspects

log = logging.getLogger("burstgate.sdk")

REOPEN_MIN_S, REOPEN_MAX_S = 0.05, 2.0  # after a stream error the server answered
SILENCE_S = 1.0  # a stream owing a first result that reads nothing this long is silent


def wait_ms(remaining_s: float) -> int:
    """AdmitBatch.max_wait_ms for an entry with ``remaining_s`` to its
    deadline: less a margin for the answer's trip, a tenth of the time left,
    at least 5 and at most 100 ms (0 = answer at once)."""
    us = int(remaining_s * 1_000_000)  # whole microseconds: no float rounding at ms edges
    margin = min(100_000, max(5_000, us // 10))
    return max(0, (us - margin) // 1000)


def wait_ms_column(group: list[Entry], now: float) -> list[int]:
    """``wait_ms`` of each entry's time left at ``now``, inlined (a call per
    entry cost more than building the rest of its AdmitBatch entry)."""
    left = [int((e.deadline - now) * 1_000_000) for e in group]
    return [max(0, (us - min(100_000, max(5_000, us // 10))) // 1000) for us in left]


class Batcher:
    def __init__(
        self, stub: Any, metadata: tuple[tuple[str, str], ...] | None, breaker: Breaker,
        counters: Counters, policy_of: Callable[[str], FailPolicy],
        on_release: Callable[[Entry], None], *, window_s: float, batch_max: int,
        connect_timeout_s: float = 1.0, wait_in_gate: bool = True,
    ) -> None:  # fmt: skip
        self._stub, self._meta, self._breaker = stub, metadata, breaker
        self._counters = counters
        self._window_s, self._batch_max = window_s, batch_max
        self._connect_timeout_s = connect_timeout_s
        self._wait_in_gate = wait_in_gate
        self._loop = asyncio.get_running_loop()
        self._pending: list[Entry] = []
        self._flush_handle: asyncio.Handle | None = None
        # loop time the pending batch began to be held for the window (-1:
        # not held; a flush at the end of this loop iteration is due). Not
        # the handle's type: uvloop's timer handles are not asyncio's.
        self._held_since = -1.0
        self._outbox: deque[list[Entry]] = deque()
        self._wake = asyncio.Event()
        self._writer: asyncio.Task[None] | None = None
        self._stream: Session | None = None
        self._batch_ids = 0
        self._reopen_at, self._reopen_failures = 0.0, 0
        self._suspects = Suspects()
        self._tasks: set[asyncio.Task[None]] = set()
        self._answers = Answers(
            self._loop, breaker, counters, policy_of, on_release, on_silent=self._silent
        )
        self._closing = False

    # ---------------------------------------------------------------- callers

    def now(self) -> float:
        return self._loop.time()

    async def admit(self, e: Entry, deadline_s: float) -> Admission:
        fut: asyncio.Future[Admission] = self._loop.create_future()
        answers = self._answers
        joined = answers.inflight.get(e.key)
        if joined is not None:
            self._counters.joined += 1
            e = joined
        elif not self._breaker.up:
            # Known down: fail fast, but yield once, so a caller that loops
            # on admit cannot starve the loop (and the probe that ends this).
            await asyncio.sleep(0)
            return answers.offline(e)
        else:
            answers.inflight[e.key] = e
            self._enqueue(e)
        answers.wait(e, fut, self._loop.time() + deadline_s)
        # (a caller cancelled meanwhile cancels ``fut``: it no longer counts
        # as waiting, and a late admission of ``e`` is released)
        return await fut

    def _silent(self, e: Entry) -> None:
        """``e``'s deadline passed and its batch's first result (which a
        working server sends at once) has not come. If the stream has read
        nothing for ``SILENCE_S`` while owing a first result, the server or
        the network went silent (the connection may look fine for the
        keepalive's 15 s): unreachable, and the stream is dropped. A stream
        that keeps answering, late (an overloaded server, or this loop
        too busy to read), is not: that caller alone got the FailPolicy."""
        st = self._stream
        if st is None or st.ended or st.silence(self._loop.time()) < SILENCE_S:
            return
        self._breaker.trip(f"no AdmitStream answer for {SILENCE_S:g} s")
        st.aborted = True
        st.call.cancel()

    # ----------------------------------------------------------------- window

    def _enqueue(self, e: Entry) -> None:
        pending = self._pending
        pending.append(e)
        if len(pending) >= self._batch_max:
            self._flush()
        elif self._flush_handle is None:
            if self._window_s > 0 and not self._idle():
                # Held: the loop's timer is the backstop (rounded up to its
                # resolution, 1 ms); an arrival past the window, or the
                # answer to the batch in flight, sends it sooner.
                self._held_since = self._loop.time()
                self._flush_handle = self._loop.call_later(self._window_s, self._flush)
            else:
                self._held_since = -1.0
                self._flush_handle = self._loop.call_soon(self._flush)
        elif self._held_since >= 0 and self._loop.time() - self._held_since >= self._window_s:
            # Past the window: sent at the end of this loop iteration, with
            # whatever else arrives in it (the writer runs no sooner anyway).
            self._flush_handle.cancel()
            self._held_since = -1.0
            self._flush_handle = self._loop.call_soon(self._flush)

    def _idle(self) -> bool:
        """Nothing in flight or to be written: a window would only add latency."""
        st = self._stream
        return not self._outbox and (st is None or st.ended or st.unacked == 0)

    def _flush(self) -> None:
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        self._held_since = -1.0
        if self._pending:
            self._outbox.append(self._pending)
            self._pending = []
            self._wake.set()
            if self._writer is None:
                self._writer = self._loop.create_task(self._write_loop())

    # ----------------------------------------------------------------- writer

    async def _write_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._outbox:
                try:
                    await self._send(self._outbox.popleft())
                except Exception:  # a bug here must not strand every later caller
                    log.exception("AdmitStream writer failed")

    def _live(self, entries: list[Entry]) -> list[Entry]:
        live = []
        for e in entries:
            if e.live():
                live.append(e)
            else:
                self._answers.forget(e)
        return live

    async def _send(self, entries: list[Entry]) -> None:
        entries = self._live(entries)
        if not entries:
            return
        if not self._breaker.up:
            for e in entries:
                self._answers.settle_offline(e)
            return
        now = self._loop.time()
        unary: list[Entry] = []
        if self._suspects:
            unary = [e for e in entries if self._suspects(e, now)]
            if unary:
                entries = [e for e in entries if not self._suspects(e, now)]
        st = self._stream
        if st is None or st.ended:  # (connecting may take a while: see _live below)
            st = await self._open(entries) if entries else None
            entries = self._live(entries)
        if st is None and entries:
            if self._breaker.up:  # reopen backoff after a server error: unary meanwhile
                unary += entries
            else:
                for e in self._live(entries):
                    self._answers.settle_offline(e)
            entries = []
        for e in unary:
            self.spawn(self._unary(e))
        if not entries:
            return
        assert st is not None
        model, pool = entries[0].model, entries[0].pool
        if all(e.model == model and e.pool == pool for e in entries):  # the common case
            await self._write(st, entries, model, pool)
            return
        groups: dict[tuple[str, str], list[Entry]] = {}
        for e in entries:
            groups.setdefault((e.model, e.pool), []).append(e)
        for (model, pool), group in groups.items():
            await self._write(st, group, model, pool)

    async def _write(self, st: Session, group: list[Entry], model: str, pool: str) -> None:
        self._batch_ids += 1
        bid = self._batch_ids
        now = self._loop.time()
        lanes = [e.lane for e in group]
        batch = pb.AdmitBatch(
            batch_id=bid, tenant_id=[e.tenant_id for e in group],
            request_id=[e.request_id for e in group],
            lane=lanes if any(lanes) else (), prompt_tokens=[e.prompt_tokens for e in group],
            max_tokens=[e.max_tokens for e in group], model=model, pool=pool,
            max_wait_ms=wait_ms_column(group, now) if self._wait_in_gate else (),
        )  # fmt: skip
        if any(e.retry_key or e.attempt for e in group):  # retries, judged by their first attempt
            batch.retry_key.extend(e.retry_key for e in group)
            batch.attempt.extend(e.attempt for e in group)
        for e in group:
            e.sent = e.streamed = True
        if st.ended:  # the stream failed while this batch was being built
            self._on_lost(group, st.error, {bid: group})
            return
        st.batches[bid] = group
        st.unacked += 1
        st.sent_at.append(now)
        self._counters.batches += 1
        self._counters.streamed += len(group)
        try:
            await st.call.write(batch)
        except Exception as exc:  # the reader sees the stream's end and answers the batch
            log.debug("AdmitStream write failed: %r", exc)

    # ----------------------------------------------------------------- stream

    async def _open(self, entries: list[Entry]) -> Session | None:
        st = self._stream
        if st is not None and not st.ended:
            return st
        now = self._loop.time()
        if now < self._reopen_at:
            return None
        budget = min(self._connect_timeout_s, max(e.deadline for e in entries) - now)
        if budget <= 0:
            return None  # their deadlines passed (a busy loop): no time to connect
        if not await self._breaker.connect(budget):
            self._breaker.trip("no connection within the connect check")
            return None
        st = self._stream
        if st is not None and not st.ended:
            return st
        st = Session(self._stub.AdmitStream(metadata=self._meta))
        st.reader = self._loop.create_task(self._read(st))
        self._stream = st
        self._counters.stream_opens += 1
        return st

    async def _read(self, st: Session) -> None:
        err: BaseException | None = None
        try:
            async for res in st.call:
                self._on_result(st, res)
        except grpc.aio.AioRpcError as exc:
            err = exc
        except asyncio.CancelledError as exc:  # the call was cancelled (or this task)
            err = exc
            raise
        except Exception as exc:  # any end is an end of this stream
            log.warning("AdmitStream reader failed: %r", exc)
            err = exc
        finally:
            if self._stream is st:
                self._stream = None
            left = st.end(err)
            lost = [e for group in left.values() for e in group if not e.settled]
            if st.aborted:  # dropped as silent: the breaker tripped already
                self._counters.stream_failures += 1
                for e in lost:
                    self._answers.settle_offline(e)
            elif lost or err is not None:
                self._on_lost(lost, err, left)

    def _on_result(self, st: Session, res: pb.AdmitBatchResult) -> None:
        st.last_read = self._loop.time()
        if not res.entry:
            self._reopen_failures = 0  # a first result: this stream works
        self._counters.queued += st.dispatch(
            res, self._answers.settle, self._loop.time(), self._answers.settle_many
        )
        if self._pending and self._held_since >= 0 and self._idle():
            self._flush()  # the last batch is answered: send what waits now (as Nagle's)

    def _on_lost(
        self, lost: list[Entry], err: BaseException | None,
        batches: dict[int, list[Entry]] | None = None,
    ) -> None:  # fmt: skip
        """Entries a stream left unanswered, and why (None: it just ended);
        ``batches``: the unanswered batches, for the error's field[index]."""
        if self._closing and isinstance(err, grpc.aio.AioRpcError):
            err = None if err.code() == grpc.StatusCode.CANCELLED else err
        if err is None and not lost:
            return  # ended with nothing owed (our close)
        self._counters.stream_failures += 1
        if unreachable(err):
            if not self._closing:
                why = err.code().name if isinstance(err, grpc.aio.AioRpcError) else repr(err)
                self._breaker.trip(f"AdmitStream ended ({why})")
            for e in lost:
                self._answers.settle_offline(e)
            return
        assert isinstance(err, grpc.aio.AioRpcError)
        log.warning("AdmitStream ended by the server: %s %s", err.code().name, err.details())
        suspect = self._suspects.mark(batches or {}, err.details() or "", self._loop.time())
        if suspect is not None:
            log.warning("%s %r goes by unary Admit for a while", *suspect)
        self._reopen_failures += 1
        ceiling = min(REOPEN_MAX_S, REOPEN_MIN_S * 2**self._reopen_failures)
        self._reopen_at = self._loop.time() + random.uniform(REOPEN_MIN_S, ceiling)
        for e in lost:
            self.spawn(self._unary(e))

    # ------------------------------------------------------------------ unary

    async def _unary(self, e: Entry) -> None:
        left = e.deadline - self._loop.time()
        if not e.live():
            self._answers.forget(e)
            return
        if left <= 0 or not self._breaker.up:
            self._answers.settle_offline(e)
            return
        e.sent = True
        self._counters.unary_admits += 1
        req = pb.AdmitRequest(
            tenant_id=e.tenant_id, request_id=e.request_id, lane=e.lane,
            prompt_tokens=e.prompt_tokens, max_tokens=e.max_tokens, model=e.model, pool=e.pool,
            retry_key=e.retry_key, attempt=e.attempt,
        )  # fmt: skip
        try:
            resp = await self._stub.Admit(req, timeout=left, metadata=self._meta)
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            where = not_owner(exc)
            if where is not None:  # another replica owns the pool: the client follows
                self._answers.settle(e, not_owner_admission(e.request_id, where))
            elif code == grpc.StatusCode.INVALID_ARGUMENT:
                e.settled = True
                self._answers.forget(e)
                e.fail(ValueError(exc.details()))
            elif code in TRANSPORT_CODES or code in (
                grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN
            ):  # fmt: skip
                self._breaker.failed(exc, "Admit")
                self._answers.settle_offline(e)
            else:  # UNAUTHENTICATED, PERMISSION_DENIED, ...: the caller's to see
                e.settled = True
                self._answers.forget(e)
                e.fail(exc)
            return
        self._answers.settle(e, admission_of_response(resp))

    def spawn(self, coro: Any) -> None:
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ close

    async def aclose(self) -> None:
        """Send what is pending, wait for every caller's answer (each is
        bounded by its deadline), then end the stream."""
        self._closing = True
        self._flush()
        waiting = self._answers.waiting()
        if waiting:
            await asyncio.wait(waiting)
        if self._tasks:
            await asyncio.wait(list(self._tasks))
        st, self._stream = self._stream, None
        if st is not None:
            st.call.cancel()
            if st.reader is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await st.reader
        self._answers.close()
        if self._writer is not None:
            self._writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._writer
