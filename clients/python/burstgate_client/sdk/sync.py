"""The synchronous client: :class:`AdmissionClient`.

It runs an :class:`AsyncAdmissionClient` on a private event loop in a daemon
thread (created and used only there: grpc.aio objects belong to their loop)
and hands each call over with ``run_coroutine_threadsafe``, so it is
thread-safe: any number of threads may call it at once, and their Admits
are micro-batched together like an asyncio program's. A call blocks for at
most its deadline plus ``SLACK_S`` (the hand-over); ``close`` answers what is
in flight, flushes what it can and stops the thread.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb
from burstgate_client.admin import TlsFiles
from burstgate_client.sdk.aio import BATCH_WINDOW_S, AsyncAdmissionClient
from burstgate_client.sdk.counters import Counters
from burstgate_client.sdk.model import Admission, Completion, FailPolicy, Limits

T = TypeVar("T")
SLACK_S = 5.0  # beyond a call's own deadline: the loop thread is wedged


class AdmissionClient:
    def __init__(
        self, target: str | Sequence[str], *, api_key: str | None = None,
        deadline_s: float = 0.25,
        batch_window_s: float = BATCH_WINDOW_S, batch_max: int = 256,
        fail_policy: FailPolicy | Mapping[str, FailPolicy] = FailPolicy.CLOSED,
        spool_path: str | Path | None = None, spool_max: int = 100_000,
        limits_ttl_s: float = 5.0, connect_timeout_s: float = 1.0,
        complete_deadline_s: float = 2.0, wait_in_gate: bool = True,
        tls: TlsFiles | None = None,
    ) -> None:  # fmt: skip
        """As :class:`AsyncAdmissionClient`."""
        kw: dict[str, Any] = {
            "api_key": api_key, "deadline_s": deadline_s, "batch_window_s": batch_window_s,
            "batch_max": batch_max, "fail_policy": fail_policy, "spool_path": spool_path,
            "spool_max": spool_max, "limits_ttl_s": limits_ttl_s,
            "connect_timeout_s": connect_timeout_s, "complete_deadline_s": complete_deadline_s,
            "wait_in_gate": wait_in_gate, "tls": tls,
        }  # fmt: skip
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="burstgate-sdk", daemon=True
        )
        self._thread.start()
        try:
            self._client: AsyncAdmissionClient = self._run(self._make(target, kw), SLACK_S)
        except BaseException:
            self._stop()
            raise
        self._closed = False

    @staticmethod
    async def _make(target: str | Sequence[str], kw: dict[str, Any]) -> AsyncAdmissionClient:
        return AsyncAdmissionClient(target, **kw)

    def _run(self, coro: Coroutine[Any, Any, T], timeout_s: float | None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def __enter__(self) -> AdmissionClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:  # fmt: skip
        self.close()

    def close(self, flush_timeout_s: float = 1.0) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._run(self._client.aclose(flush_timeout_s), flush_timeout_s + SLACK_S + 30)
        finally:
            self._stop()

    def _stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        if not self._thread.is_alive():
            self._loop.close()

    @property
    def counters(self) -> Counters:
        return self._client.counters

    @property
    def deadline_s(self) -> float:
        return self._client.deadline_s

    @property
    def up(self) -> bool:
        return self._client.up

    @property
    def pending_completions(self) -> int:
        return self._client.pending_completions

    @property
    def async_client(self) -> AsyncAdmissionClient:
        """The client underneath, for code running on its loop."""
        return self._client

    def admit(
        self, tenant_id: str, request_id: str, *, prompt_tokens: int, max_tokens: int,
        lane: str = "", model: str = "", pool: str = "", deadline_s: float | None = None,
        retry_key: str = "", attempt: int = 0,
    ) -> Admission:  # fmt: skip
        """As :meth:`AsyncAdmissionClient.admit`."""
        coro = self._client.admit(
            tenant_id, request_id, prompt_tokens=prompt_tokens, max_tokens=max_tokens,
            lane=lane, model=model, pool=pool, deadline_s=deadline_s, retry_key=retry_key,
            attempt=attempt,
        )  # fmt: skip
        return self._run(coro, (deadline_s or self._client.deadline_s) + SLACK_S)

    def complete(
        self, tenant_id: str, request_id: str, *, prompt_tokens: int, generated_tokens: int,
        cached_prompt_tokens: int = 0, exec_start_unix_ns: int = 0, exec_end_unix_ns: int = 0,
        kv_cache_miss_rate: float | None = None, first_token_unix_ns: int = 0,
        correlation_id: str = "",
    ) -> Completion:  # fmt: skip
        """As :meth:`AsyncAdmissionClient.complete`."""
        coro = self._client.complete(
            tenant_id, request_id, prompt_tokens=prompt_tokens,
            generated_tokens=generated_tokens, cached_prompt_tokens=cached_prompt_tokens,
            exec_start_unix_ns=exec_start_unix_ns, exec_end_unix_ns=exec_end_unix_ns,
            kv_cache_miss_rate=kv_cache_miss_rate, first_token_unix_ns=first_token_unix_ns,
            correlation_id=correlation_id,
        )  # fmt: skip
        return self._run(coro, self._client.complete_deadline_s + SLACK_S)

    def report_load(self, report: pb.LoadReport) -> pb.LoadReportAck | None:
        return self._run(self._client.report_load(report), self._client.deadline_s + SLACK_S)

    def limits(self, tenant_id: str) -> Limits | None:
        return self._run(self._client.limits(tenant_id), self._client.deadline_s + SLACK_S)

    def flush(self, timeout_s: float | None = None) -> int:
        """As :meth:`AsyncAdmissionClient.flush` (None blocks until delivered)."""
        wait = None if timeout_s is None else timeout_s + SLACK_S
        return self._run(self._client.flush(timeout_s), wait)
