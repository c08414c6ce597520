"""The LiteLLM proxy callback: :class:`BurstgateHook`, a ``CustomLogger``.

- ``async_pre_call_hook``: Admit through the SDK (waiting while burstgate
  holds the request, at most the lane's ``max_wait_ms``), then cap the
  request's tokens to the grant and swap in the fallback model of a
  degradation; a refusal raises LiteLLM's own rate-limit error (429 with
  ``retry-after``), see refusal.py.
- ``async_log_success_event``, ``async_post_call_failure_hook`` and the
  wrapped stream (``async_post_call_streaming_iterator_hook``): Complete,
  exactly once per admission (settle.py), with the usage LiteLLM reports.
- ``async_post_call_response_headers_hook``: ``x-burstgate-*`` on answers.

One SDK client per proxy process (each of LiteLLM's workers imports the
callback), created on the proxy's event loop at the first request: the
gRPC channel belongs to the loop that created it. Hooks that LiteLLM runs
on another loop reach the client through its own loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Coroutine
from typing import Any, TypeVar

import grpc
from litellm.integrations.custom_logger import CustomLogger

from burstgate_client.litellm import mapping as M
from burstgate_client.litellm.config import HookSettings, TokenCounterName, load
from burstgate_client.litellm.refusal import (
    bad_request_error,
    no_tenant_error,
    refusal_error,
)
from burstgate_client.litellm.settle import Ticket, Tickets
from burstgate_client.sdk import AsyncAdmissionClient, FailPolicy, Limits
from burstgate_client.sidecar import headers as H
from burstgate_client.sidecar.proxy import ADMIT_CALL_S
from burstgate_client.sidecar.refusal import REASON

log = logging.getLogger("burstgate.litellm")
T = TypeVar("T")

METADATA_KEY = "burstgate"  # data["metadata"]["burstgate"]: what was decided, for headers and logs


class BurstgateHook(CustomLogger):
    def __init__(self, settings: HookSettings | None = None) -> None:
        super().__init__()
        self.cfg = settings if settings is not None else load()
        self.tickets = Tickets()
        self._count = (M.litellm_counter() if self.cfg.token_counter is TokenCounterName.LITELLM
                       else M.bytes_counter)  # fmt: skip
        self._client: AsyncAdmissionClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------ the client

    def client(self) -> AsyncAdmissionClient:
        """The process's client, created on the running loop at first use."""
        if self._client is None:
            policies = {name: FailPolicy(lane.fail_policy.value)
                        for name, lane in self.cfg.lanes.items()}  # fmt: skip
            policies[""] = FailPolicy(self.cfg.default_lane.fail_policy.value)
            self._loop = asyncio.get_running_loop()
            self._client = AsyncAdmissionClient(
                self.cfg.control_plane, api_key=self.cfg.api_key, fail_policy=policies,
                spool_path=self.cfg.spool_path,
            )  # fmt: skip
        return self._client

    async def _on_client_loop(self, coro: Coroutine[Any, Any, T]) -> T:
        loop = asyncio.get_running_loop()
        if self._loop is None or self._loop is loop:
            return await coro
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    async def aclose(self) -> None:
        """Close the client (delivering buffered Completes for up to 1 s)."""
        if self._client is not None:
            await self._on_client_loop(self._client.aclose())

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -------------------------------------------------------------- before

    async def async_pre_call_hook(
        self, user_api_key_dict: Any, cache: Any, data: dict[str, Any], call_type: Any,
    ) -> dict[str, Any] | None:  # fmt: skip
        chat = call_type in M.CHAT_CALLS
        if not chat and call_type not in M.TEXT_CALLS:
            return None  # embeddings, images, ...: not admitted
        try:
            t = M.target(self.cfg, user_api_key_dict, data)
        except M.NoTenant as exc:
            raise no_tenant_error(str(exc)) from None
        request_id = data.get("litellm_call_id")
        if not isinstance(request_id, str) or not request_id:
            request_id = data["litellm_call_id"] = str(uuid.uuid4())
        prompt = self._count(data, chat)
        retry_key, attempt = M.retry_of(data, t.tenant)
        client = self.client()
        try:
            a = await client.admit(
                t.tenant, request_id, prompt_tokens=prompt,
                max_tokens=M.admit_max_tokens(data, chat, self.cfg.default_max_tokens),
                lane=t.lane, model=t.model, pool=t.pool,
                deadline_s=self.cfg.lane(t.lane).max_wait_ms / 1000 + ADMIT_CALL_S,
                retry_key=retry_key, attempt=attempt,
            )  # fmt: skip
        except ValueError as exc:  # an argument burstgate cannot take, named
            raise bad_request_error(f"burstgate: {exc}") from None
        except grpc.aio.AioRpcError as exc:
            raise _rpc_error(exc) from None
        if not a.admitted:
            limits = None if a.offline else await self._limits(client, t.tenant)
            raise refusal_error(
                a, tenant=t.tenant, request_id=request_id, model=t.model, limits=limits,
                unavailable_retry_after_ms=self.cfg.unavailable_retry_after_s * 1000,
            )  # fmt: skip
        M.apply_admission(data, chat=chat, granted_max_tokens=a.granted_max_tokens,
                          fallback_model=a.fallback_model)  # fmt: skip
        self.tickets.open(Ticket(t.tenant, request_id, prompt))
        metadata = data.get("metadata")
        if not isinstance(metadata, dict):
            metadata = data["metadata"] = {}
        metadata[METADATA_KEY] = {
            "tenant": t.tenant, "lane": t.lane, "pool": t.pool, "prompt_tokens": prompt,
            "granted_max_tokens": a.granted_max_tokens, "headers": H.admission_headers(a),
        }  # fmt: skip
        return data

    async def _limits(self, client: AsyncAdmissionClient, tenant: str) -> Limits | None:
        """The tenant's limits for a 429's x-ratelimit-* headers, if they
        come quickly (the SDK caches them)."""
        try:
            async with asyncio.timeout(self.cfg.limits_timeout_s):
                return await client.limits(tenant)
        except (TimeoutError, grpc.aio.AioRpcError):
            return None

    async def async_post_call_response_headers_hook(
        self, data: dict[str, Any], user_api_key_dict: Any, response: Any,
        request_headers: dict[str, str] | None = None,
        litellm_call_info: dict[str, object] | None = None,
    ) -> dict[str, str] | None:  # fmt: skip
        metadata = data.get("metadata")
        ours = metadata.get(METADATA_KEY) if isinstance(metadata, dict) else None
        h = ours.get("headers") if isinstance(ours, dict) else None
        return dict(h) if h else None

    # --------------------------------------------------------------- after

    async def async_log_success_event(
        self, kwargs: dict[str, Any], response_obj: Any, start_time: Any, end_time: Any
    ) -> None:
        ticket = self.tickets.take(kwargs.get("litellm_call_id"))
        if ticket is None:
            return  # not ours, or settled already
        usage = M.usage_of(response_obj, kwargs) or ticket.seen()
        await self._complete(ticket, usage, M.unix_ns(start_time), M.unix_ns(end_time))

    async def async_post_call_failure_hook(
        self, request_data: dict[str, Any], original_exception: Exception,
        user_api_key_dict: Any, traceback_str: str | None = None,
    ) -> Any:  # fmt: skip
        """The call failed (or the client went away from a non-streamed one
        and LiteLLM cancelled it): settle with what a stream showed, else 0
        generated, so the reservation is refunded now, not at its TTL."""
        ticket = self.tickets.take(request_data.get("litellm_call_id"))
        if ticket is not None:
            self._spawn(self._complete(ticket, ticket.seen(), ticket.stream_started_ns,
                                       ticket.stream_ended_ns))  # fmt: skip
        return None  # the error is answered as LiteLLM answers it

    async def async_post_call_streaming_iterator_hook(
        self, user_api_key_dict: Any, response: Any, request_data: dict[str, Any]
    ) -> AsyncGenerator[Any, None]:
        """Relay the stream, noting its text chunks and usage chunk; once it
        ends (or its client leaves), give LiteLLM ``settle_grace_s`` to
        report the usage, then settle with what was seen."""
        ticket = self.tickets.get(request_data.get("litellm_call_id"))
        if ticket is None:
            async for item in response:
                yield item
            return
        ticket.stream_started_ns = time.time_ns()
        try:
            async for item in response:
                texts = M.chunk_text_count(item)
                if texts and not ticket.first_token_ns:
                    ticket.first_token_ns = time.time_ns()  # the client's time to first token
                ticket.streamed_chunks += texts
                if getattr(item, "usage", None) is not None:
                    ticket.streamed_usage = M.usage_of(item) or ticket.streamed_usage
                yield item
        finally:
            ticket.stream_ended_ns = time.time_ns()
            loop = asyncio.get_running_loop()
            loop.call_later(self.cfg.settle_grace_s, self._settle_seen, ticket.request_id)

    def _settle_seen(self, request_id: str) -> None:
        ticket = self.tickets.take(request_id)
        if ticket is not None:
            log.info("burstgate: request %s settled with what its stream showed (LiteLLM "
                     "reported no usage within %.1f s)", request_id,
                     self.cfg.settle_grace_s)  # fmt: skip
            self._spawn(self._complete(ticket, ticket.seen(), ticket.stream_started_ns,
                                       ticket.stream_ended_ns))  # fmt: skip

    async def _complete(self, ticket: Ticket, usage: M.Usage, start_ns: int, end_ns: int) -> None:
        if not 0 < start_ns <= end_ns:
            start_ns = end_ns = 0
        first = ticket.first_token_ns
        if start_ns and not start_ns <= first <= end_ns:  # outside the execution: not sent
            first = 0
        client = self._client
        if client is None:
            return
        try:
            await self._on_client_loop(client.complete(
                ticket.tenant, ticket.request_id, prompt_tokens=usage.prompt_tokens,
                generated_tokens=usage.generated_tokens, cached_prompt_tokens=usage.cached_tokens,
                exec_start_unix_ns=start_ns, exec_end_unix_ns=end_ns, first_token_unix_ns=first,
            ))  # fmt: skip
        except Exception:  # never into LiteLLM's logging: log it, the TTL frees the tokens
            log.exception("burstgate: the Complete of request %s (tenant %s) failed",
                          ticket.request_id, ticket.tenant)  # fmt: skip


def _rpc_error(exc: grpc.aio.AioRpcError) -> Exception:
    """A failed Admit that is an answer, not an outage (the SDK's FailPolicy
    covers those): the server's INVALID_ARGUMENT names the field (an unknown
    lane); anything else (UNAUTHENTICATED, PERMISSION_DENIED: the hook's API
    key) is the gateway's configuration, a 500 naming the code."""
    from fastapi import HTTPException

    detail = f"burstgate: {exc.code().name}: {exc.details()}"
    status = 400 if exc.code() is grpc.StatusCode.INVALID_ARGUMENT else 500
    return HTTPException(status_code=status, detail=detail,
                         headers={REASON: exc.code().name.lower()})  # fmt: skip
