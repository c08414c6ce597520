"""The "redis" AdmissionService of bench_grpc.py: the architecture most users
run today, a token bucket per tenant kept in Redis and evaluated by a Lua
script on every request (envoyproxy/ratelimit and LiteLLM's proxy limiter
both make one Redis round trip per request; LiteLLM's is a Lua script).

Same proto, same generated (de)serializers, same server construction
(``controlplane.rpc.assembly.create_server`` with its options, health and
reflection, the servicer swapped as for ``_grpc_empty``), same grpc.aio +
uvloop stack as the other two servers. The decision is Redis's:

* ``Admit``: one ``EVALSHA`` of :data:`TOKEN_BUCKET_LUA` per call (redis-py's
  asyncio client, with hiredis parsing when installed).
* ``AdmitStream``: what such a service does with a batch -- one ``EVALSHA``
  per request, all of a batch's sent in one pipeline (one round trip, no
  MULTI), the answers turned into the batch's columns. Batches of a stream
  are answered one after the other, in order, as burstgate does.

What it does not do, and burstgate does: remember request ids (idempotent
retries), hold reservations until Complete, hourly/daily quotas, lanes and
waiting, the pool gate, the ledger. So it is a lower bound on what the
per-request Redis architecture costs, not a like-for-like feature match.

The tenants' limits live in this process (as envoyproxy/ratelimit and
LiteLLM hold their limits in configuration); only the buckets' state is in
Redis, one hash per tenant.
"""

from __future__ import annotations

import contextlib
import math
import shutil
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from typing import Any
from unittest import mock

import redis.asyncio as aioredis
from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb
from burstgate_client._proto.burstgate.v1 import admission_pb2_grpc as pb_grpc

import controlplane.rpc.assembly as server_mod
from controlplane.service import AdmissionService

# Token bucket, evaluated atomically inside Redis (a script runs alone).
#
#   KEYS[1]  the tenant's bucket: a hash {t = tokens left, ts = ms of the
#            last refill}; absent = a full bucket
#   ARGV     rate (tokens/s), burst (tokens), cost (tokens this request
#            takes: prompt + max_tokens), now (ms, the caller's clock),
#            idle TTL (ms; an untouched bucket is full again by then anyway)
#
#   tokens = min(burst, tokens + (now - ts) * rate / 1000)   -- refill
#   if tokens >= cost: tokens -= cost, admit
#   else: refuse, retry after ceil((cost - tokens) * 1000 / rate) ms
#         (0 when the rate is 0 or the cost exceeds the burst: never)
#   store {tokens, now}, PEXPIRE the key
#
# Returns {admitted 0/1, floor(tokens left), retry_after_ms}. A clock that
# goes back (now < ts) refills nothing. Written for this benchmark; the
# algorithm is the textbook token bucket used by the limiters cited above.
TOKEN_BUCKET_LUA = """
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local cost = tonumber(ARGV[3])
local now = tonumber(ARGV[4])
local state = redis.call('HMGET', KEYS[1], 't', 'ts')
local tokens = tonumber(state[1])
local ts = tonumber(state[2])
if tokens == nil or ts == nil then
  tokens = burst
  ts = now
end
if now > ts then
  tokens = math.min(burst, tokens + (now - ts) * rate / 1000)
  ts = now
end
local admitted = 0
local retry_ms = 0
if tokens >= cost then
  tokens = tokens - cost
  admitted = 1
elseif rate > 0 and cost <= burst then
  retry_ms = math.ceil((cost - tokens) * 1000 / rate)
end
redis.call('HSET', KEYS[1], 't', tokens, 'ts', ts)
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[5]))
return {admitted, math.floor(tokens), retry_ms}
"""

IDLE_TTL_MS = 3_600_000


@dataclass(frozen=True)
class Limit:
    rate: float  # tokens per second
    burst: int  # tokens


def bucket_key(tenant_id: str) -> str:
    # {...}: the hash tag a Redis Cluster would shard on
    return f"tb:{{{tenant_id}}}"


class RedisAdmissionServicer(pb_grpc.AdmissionServiceServicer):
    """Admit and AdmitStream decided by :data:`TOKEN_BUCKET_LUA` in Redis."""

    def __init__(self, client: aioredis.Redis, sha: str, limits: Mapping[str, Limit]) -> None:
        self._r = client
        self._sha = sha
        # tenant -> (key, rate, burst) as the script's arguments
        self._args = {t: (bucket_key(t), lim.rate, lim.burst) for t, lim in limits.items()}
        self._next_reservation = 1

    @classmethod
    async def connect(
        cls, host: str, port: int, limits: Mapping[str, Limit]
    ) -> RedisAdmissionServicer:
        client = aioredis.Redis(host=host, port=port)
        sha = await client.script_load(TOKEN_BUCKET_LUA)
        return cls(client, sha, limits)

    async def aclose(self) -> None:
        await self._r.aclose()

    def _reservation(self) -> int:
        rid = self._next_reservation
        self._next_reservation += 1
        return rid

    async def Admit(self, request: pb.AdmitRequest, context: Any) -> pb.AdmitResponse:
        args = self._args.get(request.tenant_id)
        if args is None:
            return pb.AdmitResponse(
                request_id=request.request_id,
                decision=pb.DECISION_REJECT,
                reason=pb.REASON_UNKNOWN_TENANT,
                message="unknown tenant",
            )
        key, rate, burst = args
        cost = request.prompt_tokens + request.max_tokens
        now_ms = time.time_ns() // 1_000_000
        ok, left, retry_ms = await self._r.evalsha(
            self._sha, 1, key, rate, burst, cost, now_ms, IDLE_TTL_MS
        )
        remaining = pb.Remaining(bucket_tokens=left, hourly_tokens=-1, daily_tokens=-1)
        if ok:
            return pb.AdmitResponse(
                request_id=request.request_id,
                decision=pb.DECISION_ADMIT,
                reserved_tokens=cost,
                reservation_id=self._reservation(),
                granted_max_tokens=request.max_tokens,
                remaining=remaining,
                message="admitted",
            )
        return pb.AdmitResponse(
            request_id=request.request_id,
            decision=pb.DECISION_REJECT,
            reason=pb.REASON_TOKEN_RATE,
            retry_after_ms=retry_ms,
            remaining=remaining,
            message="token rate",
            retryable=retry_ms > 0,
        )

    async def decide_batch(self, batch: pb.AdmitBatch) -> pb.AdmitBatchResult:
        """One EVALSHA per row, the batch's in one pipelined round trip."""
        n = len(batch.tenant_id)
        now_ms = time.time_ns() // 1_000_000
        args = self._args
        sha = self._sha
        known: list[int] = []  # rows sent to Redis
        async with self._r.pipeline(transaction=False) as pipe:
            for i, (tenant, prompt, max_tokens) in enumerate(
                zip(batch.tenant_id, batch.prompt_tokens, batch.max_tokens, strict=True)
            ):
                a = args.get(tenant)
                if a is None:
                    continue
                key, rate, burst = a
                pipe.evalsha(sha, 1, key, rate, burst, prompt + max_tokens, now_ms, IDLE_TTL_MS)
                known.append(i)
            answers: list[Any] = await pipe.execute() if known else []
        decision = [pb.DECISION_REJECT] * n
        reason = [pb.REASON_UNKNOWN_TENANT] * n
        retry = [0] * n
        reserved = [0] * n
        reservation = [0] * n
        granted = [0] * n
        left = [0] * n
        retryable = [False] * n
        for i, (ok, tokens_left, retry_ms) in zip(known, answers, strict=True):
            left[i] = tokens_left
            if ok:
                decision[i] = pb.DECISION_ADMIT
                reason[i] = pb.REASON_UNSPECIFIED
                max_tokens = batch.max_tokens[i]
                reserved[i] = batch.prompt_tokens[i] + max_tokens
                granted[i] = max_tokens
                reservation[i] = self._reservation()
            else:
                reason[i] = pb.REASON_TOKEN_RATE
                retry[i] = retry_ms
                retryable[i] = retry_ms > 0
        return pb.AdmitBatchResult(
            batch_id=batch.batch_id,
            decision=decision,
            reason=reason,
            retry_after_ms=retry,
            reserved_tokens=reserved,
            reservation_id=reservation,
            granted_max_tokens=granted,
            bucket_remaining=left,
            hourly_remaining=[-1] * n,
            daily_remaining=[-1] * n,
            duplicate=[False] * n,
            retryable=retryable,
        )

    async def AdmitStream(
        self, request_iterator: AsyncIterator[pb.AdmitBatch], context: Any
    ) -> AsyncIterator[pb.AdmitBatchResult]:
        async for batch in request_iterator:
            yield await self.decide_batch(batch)

    async def Complete(self, request: pb.CompleteRequest, context: Any) -> pb.CompleteResponse:
        return pb.CompleteResponse(request_id=request.request_id)

    async def ReportLoad(self, request: pb.LoadReport, context: Any) -> pb.LoadReportAck:
        return pb.LoadReportAck(pool=request.pool)


def create_redis_server(
    service: AdmissionService, servicer: RedisAdmissionServicer, address: str = "127.0.0.1:0"
) -> tuple[Any, int]:
    """``controlplane.rpc.assembly.create_server`` with the real servicer swapped
    for ``servicer`` (options, health and reflection are the production ones).
    Returns (server, port); the server is not started."""

    def factory(*_args: Any, **_kwargs: Any) -> RedisAdmissionServicer:
        return servicer

    with mock.patch.object(server_mod, "AdmissionServicer", factory):
        server, port, _health = server_mod.create_server(service, address)
    return server, port


# -------------------------------------------------------- redis-server process


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class RedisProcess:
    port: int
    pid: int


@contextlib.contextmanager
def redis_server(workdir: str, timeout_s: float = 10.0) -> Iterator[RedisProcess]:
    """A private redis-server on a free loopback port, nothing kept on disk,
    in the foreground as our child; stopped (and waited for) on exit. Never
    the machine's shared instance."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise FileNotFoundError("redis-server is not installed")
    for _attempt in range(5):
        port = free_port()
        argv = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        argv += ["--appendonly", "no", "--daemonize", "no", "--dir", workdir]
        argv += ["--logfile", "", "--loglevel", "warning"]
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )
        try:
            if _wait_ready(proc, port, timeout_s):
                break
        except BaseException:
            _stop(proc)
            raise
        _stop(proc)  # lost the port to someone else, or did not start
    else:
        raise RuntimeError("could not start redis-server")
    try:
        yield RedisProcess(port, proc.pid)
    finally:
        _stop(proc)


def _wait_ready(proc: subprocess.Popen[bytes], port: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5) as s:
            s.sendall(b"PING\r\n")
            if s.recv(16).startswith(b"+PONG"):
                return True
        time.sleep(0.05)
    return False


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()  # SIGTERM: redis-server exits (nothing to save)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def rss_mb(pid: int) -> float:
    """Resident memory of process ``pid`` (the redis-server), MB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return math.nan
