"""The request guard: what every request of every service the server mounts
passes before its servicer sees it.

- **Malformed bytes.** grpc hands the payload to the method's request
  deserializer; when it raises, grpc answers UNKNOWN with the exception's
  class and logs a traceback per call, which a client can send garbage to
  flood. The guarded deserializer catches the failure instead: the call
  ends INVALID_ARGUMENT ``request is not a valid <MessageType> protobuf``
  (ErrorInfo reason ``MALFORMED_REQUEST``) and the log gets one warning line
  per method per second at most, with the count of the ones suppressed
  since the last line (:class:`MalformedLog`).
- **String lengths of the operator services** (admin, ledger): every string
  field, nested, repeated or in a map, is checked against
  :data:`FIELD_LIMITS` (:data:`DEFAULT_MAX_LEN` for the rest), and for a
  NUL character (no PostgreSQL text value can hold one; the driver's error
  was an INTERNAL), before the servicer runs: INVALID_ARGUMENT naming the
  field. The admission service's
  strings are checked by its own edge checks instead
  (``controlplane/service/edge.py``): a ``len()`` per field, cheaper on the
  hot path than walking a message.

- **Wire codecs.** A method may be registered with its own (de)serializers
  in place of the generated ones (:class:`WireCodec`: AdmitStream reads
  its batches as columns and writes its results as bytes, rpc/admitstream.py);
  its deserializer's failure is refused as the generated one's is.

A deserializer has no call context to end the call with, so it hands on a
:class:`Refused` in place of the request; the guarded behaviour ends the call
with its status before the servicer runs. Registration goes through
:class:`GuardedRegistrar`, which wraps each handler as the generated
``add_*_to_server`` functions register it. The auth interceptor
(controlplane/rpc/interceptor.py) still decides before any of this: a refused
caller's payload is never parsed.
"""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import grpc
import structlog
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from controlplane.domain import MAX_ID_LEN, MAX_MODEL_LEN
from controlplane.domain.errors import InvalidArgument
from controlplane.domain.validate import MAX_LANE_NAME, MAX_POOL_LEN, MAX_TEXT
from controlplane.rpc.errors import abort, error_status, rich_status

log = structlog.get_logger("burstgate.rpc")

MALFORMED_REASON = "MALFORMED_REQUEST"
# One warning line per method per this many seconds (the rest are counted).
MALFORMED_LOG_INTERVAL_S = 1.0

# Maximum lengths (characters) of request strings, by field name;
# "Message.field" entries override a name's entry for one message. The
# operator services are checked against this table here; the admission
# service's edge checks apply the same numbers (a test holds them to it).
# Documented in docs/api.md, "Errors".
MAX_DECIMAL_LEN = 64  # decimal text: token_rate, weight, prices, multipliers
MAX_KEY_ID_LEN = 32  # key ids are 12 hex characters
MAX_ROLE_LEN = 32
MAX_PAGE_TOKEN_LEN = 512
MAX_POLICY_KEY_LEN = 64
MAX_POLICY_VALUE_LEN = 16_384  # JSON; known_pools lists pool names
MAX_KEY_NAME_LEN = 128  # CreateApiKeyRequest.name (the key store's bound)
MAX_CURRENCY_LEN = 16  # ISO 4217 codes are 3 letters; room for a readable refusal
MAX_ACTION_LEN = 64  # audit actions: tenant.create, policy.update, ...
DEFAULT_MAX_LEN = 256  # any string not listed
# Entries of a repeated field or a map (tenant_ids filters become SQL IN lists).
MAX_ENTRIES = 1000

FIELD_LIMITS: Mapping[str, int] = {
    "tenant_id": MAX_ID_LEN,
    "tenant_ids": MAX_ID_LEN,
    "request_id": MAX_ID_LEN,
    "retry_key": MAX_ID_LEN,
    "correlation_id": MAX_ID_LEN,
    "engine_id": MAX_ID_LEN,
    "lane": MAX_LANE_NAME,
    "pool": MAX_POOL_LEN,
    "model": MAX_MODEL_LEN,
    "display_name": MAX_TEXT,
    "fallback_model": MAX_TEXT,
    "default_lane": MAX_LANE_NAME,
    "currency": MAX_CURRENCY_LEN,
    "token_rate": MAX_DECIMAL_LEN,
    "weight": MAX_DECIMAL_LEN,
    "input_per_mtok": MAX_DECIMAL_LEN,
    "cached_input_per_mtok": MAX_DECIMAL_LEN,
    "output_per_mtok": MAX_DECIMAL_LEN,
    "gpu_prefill_per_mtok": MAX_DECIMAL_LEN,
    "gpu_decode_per_mtok": MAX_DECIMAL_LEN,
    "gpu_overhead_per_request": MAX_DECIMAL_LEN,
    "lane_multipliers": MAX_DECIMAL_LEN,  # values; keys: MAP_KEY_LIMITS
    "page_token": MAX_PAGE_TOKEN_LEN,
    "key_id": MAX_KEY_ID_LEN,
    "role": MAX_ROLE_LEN,
    "set": MAX_POLICY_VALUE_LEN,  # values; keys: MAP_KEY_LIMITS
    "reset": MAX_POLICY_KEY_LEN,
    "action": MAX_ACTION_LEN,
    "burstgate.v1.Lane.name": MAX_LANE_NAME,
    "burstgate.v1.CreateApiKeyRequest.name": MAX_KEY_NAME_LEN,
}
MAP_KEY_LIMITS: Mapping[str, int] = {"set": MAX_POLICY_KEY_LEN, "lane_multipliers": MAX_LANE_NAME}


def field_limit(fd: FieldDescriptor) -> int:
    """The maximum length of the string field ``fd`` (of a map: its values)."""
    message = fd.containing_type
    own = FIELD_LIMITS.get(f"{message.full_name}.{fd.name}") if message is not None else None
    return own if own is not None else FIELD_LIMITS.get(fd.name, DEFAULT_MAX_LEN)


def _too_long(field: str, value: str, limit: int) -> None:
    if len(value) > limit:
        raise InvalidArgument(field, f"longer than {limit} characters ({len(value)})")
    if "\0" in value:  # no text column (PostgreSQL) can hold one: refused here, not by SQL
        raise InvalidArgument(field, "contains a NUL character")


def _entries(field: str, n: int) -> None:
    if n > MAX_ENTRIES:
        raise InvalidArgument(field, f"more than {MAX_ENTRIES} entries ({n})")


def check_strings(msg: Message, prefix: str = "") -> None:
    """Every string set in ``msg`` (recursively) within its limit; raise
    InvalidArgument naming the field as the servicers' own errors do: a
    wrapped resource's field by its own name (``pool``, not
    ``tenant.pool``), a repeated entry ``tenant_ids[3]``, a map's value
    ``set[key]``. Only the fields that are set are visited."""
    for fd, value in msg.ListFields():
        name = prefix + fd.name
        if fd.type == FieldDescriptor.TYPE_STRING:
            limit = field_limit(fd)
            if fd.is_repeated:
                _entries(name, len(value))
                for i, item in enumerate(value):
                    _too_long(f"{name}[{i}]", item, limit)
            else:
                _too_long(name, value, limit)
        elif fd.type == FieldDescriptor.TYPE_MESSAGE:
            entry = fd.message_type
            if entry is not None and entry.GetOptions().map_entry:
                _check_map(entry, fd.name, name, value)
            elif fd.is_repeated:
                _entries(name, len(value))
                for i, item in enumerate(value):
                    check_strings(item, f"{name}[{i}].")
            elif entry is not None and entry.full_name.startswith("google.protobuf."):
                check_strings(value, name + ".")  # update_mask.paths[0]
            else:  # the resource a request wraps: named as the servicer's errors name it
                check_strings(value, prefix)


def _check_map(entry: Descriptor, field: str, name: str, value: Mapping[Any, Any]) -> None:
    """A map field (``field`` as declared, ``name`` with its path)."""
    _entries(name, len(value))
    key_fd = entry.fields_by_name["key"]
    value_fd = entry.fields_by_name["value"]
    key_limit = MAP_KEY_LIMITS.get(field, DEFAULT_MAX_LEN)
    value_limit = FIELD_LIMITS.get(field, DEFAULT_MAX_LEN)
    for key, item in value.items():
        if key_fd.type == FieldDescriptor.TYPE_STRING and len(key) > key_limit:
            raise InvalidArgument(name, f"a key is longer than {key_limit} characters ({len(key)})")
        if key_fd.type == FieldDescriptor.TYPE_STRING and "\0" in key:
            raise InvalidArgument(name, "a key contains a NUL character")
        if value_fd.type == FieldDescriptor.TYPE_STRING:
            _too_long(f"{name}[{key}]", item, value_limit)
        elif value_fd.type == FieldDescriptor.TYPE_MESSAGE:
            check_strings(item, f"{name}[{key}].")


class MalformedLog:
    """At most one line per method per ``interval_s``; the calls in between
    are counted and reported (``suppressed``) with the next line."""

    def __init__(
        self,
        interval_s: float = MALFORMED_LOG_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self.total = 0
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self._lock = threading.Lock()  # deserializers may run off the loop

    def note(self, method: str, message_type: str, size: int) -> None:
        now = self.clock()
        with self._lock:
            self.total += 1
            last = self._last.get(method)
            if last is not None and now - last < self.interval_s:
                self._suppressed[method] = self._suppressed.get(method, 0) + 1
                return
            self._last[method] = now
            suppressed = self._suppressed.pop(method, 0)
        log.warning(
            "malformed request",
            method=method,
            message_type=message_type,
            bytes=size,
            suppressed=suppressed,
        )


class Refused:
    """Handed on by a guarded deserializer in place of a request it refused."""

    __slots__ = ("status",)

    def __init__(self, status: grpc.Status) -> None:
        self.status = status


def _message_type(deserializer: Callable[[bytes], Any]) -> str:
    cls = getattr(deserializer, "__self__", None)  # Message.FromString, bound to its class
    descriptor = getattr(cls, "DESCRIPTOR", None)
    return str(getattr(descriptor, "full_name", "")) or "request"


def guard_deserializer(
    deserializer: Callable[[bytes], Any],
    method: str,
    malformed: MalformedLog,
    *,
    check: bool,
    message_type: str = "",
) -> Callable[[bytes], Any]:
    """``message_type``: the request's message name, for a deserializer that
    is not a generated ``FromString``."""
    message_type = message_type or _message_type(deserializer)
    refusal = Refused(
        rich_status(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"request is not a valid {message_type} protobuf",
            MALFORMED_REASON,
            # The BadRequest names the whole message: no field could be read.
            field="request",
            description=f"not a valid {message_type} protobuf",
        )
    )

    def parse(data: bytes) -> Any:
        try:
            request = deserializer(data)
        except Exception:  # any failure to parse: the bytes are not the message
            malformed.note(method, message_type, len(data))
            return refusal
        if check:
            try:
                check_strings(request)
            except InvalidArgument as exc:
                return Refused(error_status(exc))
        return request

    return parse


async def _checked(
    requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
) -> AsyncIterator[Any]:
    async for request in requests:
        if request.__class__ is Refused:
            await abort(context, request.status)
        yield request


def guard_handler(
    handler: grpc.RpcMethodHandler,
    method: str,
    malformed: MalformedLog,
    *,
    check: bool,
    message_type: str = "",
) -> grpc.RpcMethodHandler:
    """``handler`` with its request deserializer guarded and its behaviour
    ending the call when handed a :class:`Refused`. Handlers without a
    deserializer, or with a synchronous streaming behaviour, are returned as
    they are."""
    if handler.request_deserializer is None:
        return handler
    parse = guard_deserializer(
        handler.request_deserializer, method, malformed, check=check, message_type=message_type
    )
    serialize = handler.response_serializer
    if not handler.request_streaming:
        behavior = handler.unary_stream if handler.response_streaming else handler.unary_unary
        if inspect.isasyncgenfunction(behavior):

            async def unary_in_gen(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if request.__class__ is Refused:
                    await abort(context, request.status)
                async for response in behavior(request, context):
                    yield response

            return grpc.unary_stream_rpc_method_handler(
                unary_in_gen, request_deserializer=parse, response_serializer=serialize
            )
        if not inspect.iscoroutinefunction(behavior):
            if handler.response_streaming:
                return handler

            # A synchronous behaviour (a generated base method an aio
            # servicer left unimplemented): grpc runs it in a thread.
            def unary_in_sync(request: Any, context: Any) -> Any:
                if request.__class__ is Refused:
                    status = request.status
                    context.abort(status.code, status.details, status.trailing_metadata)
                return behavior(request, context)

            return grpc.unary_unary_rpc_method_handler(
                unary_in_sync, request_deserializer=parse, response_serializer=serialize
            )

        async def unary_in(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if request.__class__ is Refused:
                await abort(context, request.status)
            return await behavior(request, context)

        make = (
            grpc.unary_stream_rpc_method_handler
            if handler.response_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        return make(unary_in, request_deserializer=parse, response_serializer=serialize)
    behavior = handler.stream_stream if handler.response_streaming else handler.stream_unary
    if inspect.isasyncgenfunction(behavior):

        async def stream_in_gen(requests: AsyncIterator[Any], context: Any) -> Any:
            async for response in behavior(_checked(requests, context), context):
                yield response

        return grpc.stream_stream_rpc_method_handler(
            stream_in_gen, request_deserializer=parse, response_serializer=serialize
        )
    if not inspect.iscoroutinefunction(behavior):
        return handler

    async def stream_in(requests: AsyncIterator[Any], context: Any) -> Any:
        return await behavior(_checked(requests, context), context)

    make = (
        grpc.stream_stream_rpc_method_handler
        if handler.response_streaming
        else grpc.stream_unary_rpc_method_handler
    )
    return make(stream_in, request_deserializer=parse, response_serializer=serialize)


class _GuardedGeneric(grpc.GenericRpcHandler):  # type: ignore[misc]
    """A generic handler whose handlers come guarded (each wrapped once)."""

    def __init__(self, inner: grpc.GenericRpcHandler, registrar: GuardedRegistrar) -> None:
        self._inner = inner
        self._registrar = registrar
        # Only methods the inner handler serves: a client naming random
        # methods must not grow this.
        self._guarded: dict[str, grpc.RpcMethodHandler] = {}

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> Any:
        method: str = handler_call_details.method
        guarded = self._guarded.get(method)
        if guarded is None:
            found = self._inner.service(handler_call_details)
            if found is None:
                return None
            guarded = self._guarded[method] = self._registrar.guard(method, found)
        return guarded


@dataclass(frozen=True, slots=True)
class WireCodec:
    """A streaming method's own (de)serializers: ``read`` raises on bytes that
    are not a ``message_type``; ``write`` gives a response's bytes."""

    read: Callable[[bytes], Any]
    write: Callable[[Any], bytes]
    message_type: str


class GuardedRegistrar:
    """Stands in for the server while the generated ``add_*_to_server``
    functions register a service: each handler is registered guarded.
    ``check``: also check the requests' string lengths (operator services);
    ``codecs``: by full method name, the stream-stream methods registered
    with a :class:`WireCodec` in place of the generated (de)serializers.
    ``registered`` false: the service's methods are served through a
    generic handler only, not as grpc "registered methods": grpc.aio's
    server waits for the next call with one pending task per registered
    method and re-arms them all on every call the server takes (an
    asyncio.wait over them), so each registered method costs every call
    of every service a little; the operator services' 28 methods, rarely
    called, cost the admission calls more than their own lookup would."""

    def __init__(
        self, server: grpc.aio.Server, malformed: MalformedLog, *, check: bool,
        codecs: Mapping[str, WireCodec] | None = None, registered: bool = True,
    ) -> None:  # fmt: skip
        self._server = server
        self._malformed = malformed
        self._check = check
        self._codecs = codecs or {}
        self._registered = registered

    def guard(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        codec = self._codecs.get(method)
        if codec is None:
            return guard_handler(handler, method, self._malformed, check=self._check)
        assert handler.request_streaming and handler.response_streaming, method
        raw = grpc.stream_stream_rpc_method_handler(
            handler.stream_stream, request_deserializer=codec.read, response_serializer=codec.write
        )
        return guard_handler(
            raw, method, self._malformed, check=self._check, message_type=codec.message_type
        )

    def add_generic_rpc_handlers(self, handlers: Iterable[grpc.GenericRpcHandler]) -> None:
        self._server.add_generic_rpc_handlers(tuple(_GuardedGeneric(h, self) for h in handlers))

    def add_registered_method_handlers(
        self, service_name: str, method_handlers: dict[str, grpc.RpcMethodHandler]
    ) -> None:
        if not self._registered:
            # (the generated functions add a generic handler too: a second
            # one for the same methods is never reached, and harmless)
            generic = grpc.method_handlers_generic_handler(service_name, method_handlers)
            self.add_generic_rpc_handlers((generic,))
            return
        self._server.add_registered_method_handlers(
            service_name,
            {
                name: self.guard(f"/{service_name}/{name}", handler)
                for name, handler in method_handlers.items()
            },
        )

    def as_server(self) -> grpc.aio.Server:
        """This registrar where a registration function asks for a server
        (it calls only the two methods above)."""
        return cast("grpc.aio.Server", self)
