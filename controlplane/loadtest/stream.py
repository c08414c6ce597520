"""Client-side micro-batching onto one ``AdmitStream`` (``loadtest --stream``):
the Admits of a window (``window_s``, flushed early at ``max_batch``) go as
one ``AdmitBatch``; its ``AdmitBatchResult`` (in order, at once: a batch
never waits in the server's queue) answers each of them. One answer shape,
:class:`Answer`, for both this and the unary call.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections import deque
from dataclasses import dataclass
from typing import Any

from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb


@dataclass(frozen=True, slots=True)
class Answer:
    decision: int
    reason: int
    retry_after_ms: int
    granted_max_tokens: int
    retryable: bool
    lane: str = ""  # the lane placed in (unary only)
    queue_wait_ms: int = 0  # unary only: a batch is never held


def answer_of(resp: pb.AdmitResponse) -> Answer:
    return Answer(resp.decision, resp.reason, resp.retry_after_ms, resp.granted_max_tokens,
                  resp.retryable, resp.lane, resp.queue_wait_ms)  # fmt: skip


Pending = list[tuple[pb.AdmitRequest, "asyncio.Future[Answer]"]]


class StreamBatcher:
    def __init__(self, stub: Any, metadata: Any, window_s: float, max_batch: int) -> None:
        if not window_s > 0 or max_batch < 1:
            raise ValueError("--batch-window-ms must be > 0 and --batch-max >= 1")
        self._stub, self._meta = stub, metadata
        self.window_s, self.max_batch = window_s, max_batch
        self._queue: asyncio.Queue[tuple[pb.AdmitRequest, asyncio.Future[Answer]]] = asyncio.Queue()
        self._sent: deque[Pending] = deque()
        self._ids = itertools.count(1)
        self._call: Any = None
        self._tasks: list[asyncio.Task[None]] = []
        self.batches = 0

    async def __aenter__(self) -> StreamBatcher:
        self._call = self._stub.AdmitStream(metadata=self._meta)
        self._tasks = [asyncio.create_task(self._write()), asyncio.create_task(self._read())]
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._call is not None:
            self._call.cancel()

    async def decide(self, request: pb.AdmitRequest) -> Answer:
        fut: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((request, fut))
        return await fut

    async def _write(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            items = [await self._queue.get()]
            deadline = loop.time() + self.window_s
            while len(items) < self.max_batch:
                left = deadline - loop.time()
                if left <= 0:
                    break
                try:
                    items.append(await asyncio.wait_for(self._queue.get(), left))
                except TimeoutError:
                    break
            reqs = [r for r, _ in items]
            batch = pb.AdmitBatch(
                batch_id=next(self._ids), tenant_id=[r.tenant_id for r in reqs],
                request_id=[r.request_id for r in reqs], lane=[r.lane for r in reqs],
                prompt_tokens=[r.prompt_tokens for r in reqs],
                max_tokens=[r.max_tokens for r in reqs],
            )  # fmt: skip
            self._sent.append(items)
            await self._call.write(batch)
            self.batches += 1

    async def _read(self) -> None:
        try:
            async for res in self._call:
                items = self._sent.popleft()
                for k, (_, fut) in enumerate(items):
                    if not fut.done():
                        fut.set_result(Answer(
                            res.decision[k], res.reason[k], res.retry_after_ms[k],
                            res.granted_max_tokens[k], res.retryable[k],
                        ))  # fmt: skip
        except Exception as exc:  # the stream failed: every waiting caller hears it
            for items in self._sent:
                for _, fut in items:
                    if not fut.done():
                        fut.set_exception(exc)
            self._sent.clear()
            raise
