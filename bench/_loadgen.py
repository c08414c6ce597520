"""Load generator for bench_grpc.py; runs in its own (spawned) process.

Two kinds of round, each bounded in count and in time:

* :func:`stream_round` -- one AdmitStream call, closed loop with ``window``
  batches in flight (grpc.aio client on uvloop). Batches are cheap to make
  (a pre-serialized template whose request-id stem is replaced per batch), so
  the client spends its CPU on gRPC, not on building protobufs.
* :func:`unary_round` -- unary Admit, open loop: send i is scheduled at
  ``t0 + i / rate`` and its latency is measured from that *scheduled* time,
  so a stalled server cannot slow the offered load down (no coordinated
  omission). grpc.aio client on uvloop; a sender thread sleeps to each
  scheduled time with ``time.sleep`` (well under 0.1 ms late when the
  machine is quiet; loop timers have 1 ms granularity) and hands the call
  to the loop with ``call_soon_threadsafe``.

Server CPU is read from ``/proc/<server pid>/stat`` (utime + stime of the
whole process, all threads) at the edges of the measured window; so is the
CPU of the processes in ``extra_pids`` (a server's own back end, such as the
redis-server of the Redis baseline), reported apart as ``extra_cpu_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import os
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import grpc
from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb

STREAM_METHOD = "/burstgate.v1.AdmissionService/AdmitStream"
UNARY_METHOD = "/burstgate.v1.AdmissionService/Admit"
# Rows are spread over the tenants in this cycle: three generous tenants and,
# on one row in ten, a tight one that is refused almost always.
TENANT_CYCLE = ("bench-a", "bench-b", "bench-c") * 3 + ("bench-d",)
PROMPT_TOKENS = 100
MAX_TOKENS = 50
MODEL = "llama-3.1-70b"
POOL = "gpu-a"
# Replaced per batch by the batch number in 8 hex digits (never contains "J").
_STEM = b"JJJJJJJJ"
_CLK_TCK = os.sysconf("SC_CLK_TCK")


def proc_cpu_s(pid: int) -> float:
    """utime + stime of process ``pid`` (all its threads), in seconds."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        text = f.read()
    rest = text[text.rindex(b")") + 2 :].split()
    return (int(rest[11]) + int(rest[12])) / _CLK_TCK


def _proc_stat() -> tuple[float, float, float]:
    """Machine-wide (busy, steal, total) CPU seconds from /proc/stat."""
    with open("/proc/stat", "rb") as f:
        fields = [int(x) for x in f.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    busy = user + nice + system + irq + softirq
    return busy / _CLK_TCK, steal / _CLK_TCK, sum(fields) / _CLK_TCK


def machine_busy_s() -> float:
    return _proc_stat()[0]


@dataclass(frozen=True)
class Snapshot:
    """CPU counters at one edge of a measured window."""

    wall_ns: int
    server_cpu_s: float
    extra_cpu_s: float  # the extra_pids, all threads
    client_cpu_s: float  # this load-generator process, all threads
    busy_s: float
    steal_s: float
    total_s: float

    @classmethod
    def take(cls, server_pid: int, extra_pids: tuple[int, ...] = ()) -> Snapshot:
        busy, steal, total = _proc_stat()
        return cls(
            time.perf_counter_ns(),
            proc_cpu_s(server_pid),
            sum(proc_cpu_s(p) for p in extra_pids),
            time.process_time(),
            busy,
            steal,
            total,
        )

    def other_cores(self, after: Snapshot) -> float:
        """Cores used by everything but the measured server (with its extra
        processes) and this client."""
        wall = (after.wall_ns - self.wall_ns) / 1e9
        ours = (
            (after.server_cpu_s - self.server_cpu_s)
            + (after.extra_cpu_s - self.extra_cpu_s)
            + (after.client_cpu_s - self.client_cpu_s)
        )
        return max(0.0, (after.busy_s - self.busy_s) - ours) / wall if wall > 0 else math.nan

    def steal_fraction(self, after: Snapshot) -> float:
        """Share of CPU time the hypervisor gave to other guests."""
        total = after.total_s - self.total_s
        return (after.steal_s - self.steal_s) / total if total > 0 else math.nan


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list (q in [0, 100])."""
    if not sorted_values:
        return math.nan
    k = max(0, math.ceil(q / 100 * len(sorted_values)) - 1)
    return sorted_values[min(k, len(sorted_values) - 1)]


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        b = value & 0x7F
        value >>= 7
        if value:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


class BatchFactory:
    """Serialized AdmitBatch messages with unique request ids, ~2 us each.

    The template is a real serialized AdmitBatch (tenant ids cycling through
    TENANT_CYCLE, request ids ``<prefix>JJJJJJJJ-<row>``); batch ``j`` is the
    template with the stem replaced by ``j`` in hex, preceded by its batch_id
    field (protobuf accepts fields in any order).
    """

    def __init__(self, n: int, prefix: str) -> None:
        if "J" in prefix:
            raise ValueError("prefix must not contain 'J'")
        stem = _STEM.decode()
        tmpl = pb.AdmitBatch(
            tenant_id=[TENANT_CYCLE[i % len(TENANT_CYCLE)] for i in range(n)],
            request_id=[f"{prefix}{stem}-{i:04d}" for i in range(n)],
            prompt_tokens=[PROMPT_TOKENS] * n,
            max_tokens=[MAX_TOKENS] * n,
            model=MODEL,
            pool=POOL,
        ).SerializeToString()
        if tmpl.count(_STEM) != n:
            raise ValueError("request-id stem collides with other template bytes")
        self.n = n
        self._tmpl = tmpl

    def make(self, batch_id: int) -> bytes:
        head = b"\x08" + _varint(batch_id)
        return head + self._tmpl.replace(_STEM, b"%08x" % batch_id)


@dataclass(frozen=True)
class StreamParams:
    target: str
    server_pid: int
    batch: int
    window: int
    seconds: float
    max_batches: int
    warmup_batches: int
    id_prefix: str
    check_batch_ids: bool  # the empty server does not echo batch ids
    timeout_s: float = 60.0
    extra_pids: tuple[int, ...] = ()  # CPU counted as extra_cpu_s


@dataclass
class StreamResult:
    batches: int  # measured (after warm-up)
    decisions: int
    elapsed_s: float
    decisions_per_s: float
    p50_ms: float
    p99_ms: float
    max_ms: float
    server_cpu_s: float
    client_cpu_s: float
    admitted_fraction: float
    response_bytes: int
    request_bytes: int
    hit_count_limit: bool
    other_cores: float
    steal_fraction: float
    extra_cpu_s: float = 0.0  # CPU of the extra_pids in the window


@dataclass(frozen=True)
class UnaryParams:
    target: str
    server_pid: int
    rate: float
    seconds: float
    warmup_s: float
    id_prefix: str
    call_timeout_s: float = 2.0
    extra_pids: tuple[int, ...] = ()  # CPU counted as extra_cpu_s
    # Rows cycle over these tenants. bench_grpc sends only the generous ones:
    # the hot-path issue's unary target is for tenants that do not wait (a
    # refused call of the tight tenant waits server-side by design, which
    # is latency and timers the empty handler has no counterpart for).
    tenants: tuple[str, ...] = TENANT_CYCLE


@dataclass
class UnaryResult:
    offered_per_s: float
    calls: int  # measured (after warm-up)
    completed_per_s: float
    errors: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    server_cpu_s: float
    client_cpu_s: float
    send_lag_p99_ms: float  # how late the client sent vs. its schedule
    admitted_fraction: float
    response_bytes: int
    other_cores: float
    steal_fraction: float
    error_samples: list[str] = field(default_factory=list)
    extra_cpu_s: float = 0.0  # CPU of the extra_pids in the window


# --------------------------------------------------------------------- stream


async def _stream(p: StreamParams) -> StreamResult:
    factory = BatchFactory(p.batch, p.id_prefix)
    request_bytes = len(factory.make(p.max_batches))
    lat_ns: list[int] = []
    sent: deque[int] = deque()
    sem = asyncio.Semaphore(p.window)
    # Measured window: from the warm-up'th answer to the last answer.
    st: dict[str, Any] = {"end_ns": None, "t0": 0, "before": None}
    admitted = sampled = 0
    response_bytes = 0
    hit_limit = False

    async with grpc.aio.insecure_channel(p.target) as channel:
        await asyncio.wait_for(channel.channel_ready(), 10)
        call = channel.stream_stream(STREAM_METHOD)()

        async def writer() -> int:
            nonlocal hit_limit
            j = 0
            while True:
                await sem.acquire()
                end_ns = st["end_ns"]
                if end_ns is not None and time.perf_counter_ns() >= end_ns:
                    break
                if j >= p.max_batches:
                    hit_limit = True
                    break
                data = factory.make(j)
                sent.append(time.perf_counter_ns())
                await call.write(data)
                j += 1
            await call.done_writing()
            return j

        wtask = asyncio.create_task(writer())
        received = 0
        t_last = 0
        while True:
            data = await call.read()
            if data is grpc.aio.EOF:
                break
            t = time.perf_counter_ns()
            t_sent = sent.popleft()
            sem.release()
            received += 1
            res = pb.AdmitBatchResult.FromString(data)
            if len(res.decision) != p.batch:
                raise RuntimeError(f"answer with {len(res.decision)} decisions for {p.batch}")
            if p.check_batch_ids and res.batch_id != received - 1:
                raise RuntimeError(f"answer {res.batch_id} out of order (expected {received - 1})")
            if received == p.warmup_batches:
                st["t0"] = t
                st["before"] = Snapshot.take(p.server_pid, p.extra_pids)
                st["end_ns"] = t + int(p.seconds * 1e9)
            elif received > p.warmup_batches:
                lat_ns.append(t - t_sent)
                t_last = t
                if received % 8 == 0:
                    admitted += list(res.decision).count(pb.DECISION_ADMIT)
                    sampled += p.batch
                    response_bytes = len(data)
        after = Snapshot.take(p.server_pid, p.extra_pids)
        await wtask
        code = await call.code()
        if code != grpc.StatusCode.OK:
            raise RuntimeError(f"AdmitStream ended with {code}: {await call.details()}")

    measured = len(lat_ns)
    before: Snapshot | None = st["before"]
    if before is None:
        raise RuntimeError(f"no answer after warm-up ({received} answers)")
    elapsed = (t_last - st["t0"]) / 1e9 if measured else math.nan
    lat_ms = sorted(x / 1e6 for x in lat_ns)
    return StreamResult(
        batches=measured,
        decisions=measured * p.batch,
        elapsed_s=elapsed,
        decisions_per_s=measured * p.batch / elapsed if measured else math.nan,
        p50_ms=percentile(lat_ms, 50),
        p99_ms=percentile(lat_ms, 99),
        max_ms=lat_ms[-1] if lat_ms else math.nan,
        server_cpu_s=after.server_cpu_s - before.server_cpu_s,
        client_cpu_s=after.client_cpu_s - before.client_cpu_s,
        admitted_fraction=admitted / sampled if sampled else math.nan,
        response_bytes=response_bytes,
        request_bytes=request_bytes,
        hit_count_limit=hit_limit,
        other_cores=before.other_cores(after),
        steal_fraction=before.steal_fraction(after),
        extra_cpu_s=after.extra_cpu_s - before.extra_cpu_s,
    )


def stream_round(p: StreamParams) -> StreamResult:
    import uvloop

    async def bounded() -> StreamResult:
        return await asyncio.wait_for(_stream(p), p.timeout_s)

    return uvloop.run(bounded())


# ---------------------------------------------------------------------- unary


async def _unary(p: UnaryParams) -> UnaryResult:
    n_warm = int(p.rate * p.warmup_s)
    n_meas = int(p.rate * p.seconds)
    total = n_warm + n_meas
    tenants = p.tenants
    reqs = [
        pb.AdmitRequest(
            tenant_id=tenants[i % len(tenants)],
            request_id=f"{p.id_prefix}{i:08d}",
            prompt_tokens=PROMPT_TOKENS,
            max_tokens=MAX_TOKENS,
            model=MODEL,
            pool=POOL,
        ).SerializeToString()
        for i in range(total)
    ]
    sched = [0] * total
    sent_at = [0] * total
    done_at = [0] * total
    calls: list[Any] = [None] * total
    remaining = [total]
    loop = asyncio.get_running_loop()
    all_done = asyncio.Event()
    edges: dict[str, Any] = {}

    async with grpc.aio.insecure_channel(p.target) as channel:
        await asyncio.wait_for(channel.channel_ready(), 10)
        admit = channel.unary_unary(UNARY_METHOD)  # bytes in, bytes out

        def on_done(i: int, _call: Any) -> None:
            done_at[i] = time.perf_counter_ns()
            remaining[0] -= 1
            if remaining[0] == 0:
                all_done.set()

        def start(i: int) -> None:  # on the loop thread
            sent_at[i] = time.perf_counter_ns()
            call = admit(reqs[i], timeout=p.call_timeout_s)
            call.add_done_callback(functools.partial(on_done, i))
            calls[i] = call

        def sender() -> None:  # own thread: time.sleep is precise, loop timers are 1 ms
            interval_ns = 1e9 / p.rate
            t0 = time.perf_counter_ns() + 20_000_000
            for i in range(total):
                ts = t0 + int(i * interval_ns)
                now = time.perf_counter_ns()
                if ts > now:
                    time.sleep((ts - now) / 1e9)
                if i == n_warm:
                    edges["before"] = Snapshot.take(p.server_pid, p.extra_pids)
                sched[i] = ts
                loop.call_soon_threadsafe(start, i)

        thread = threading.Thread(target=sender, name="sender", daemon=True)
        thread.start()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(all_done.wait(), p.seconds + p.warmup_s + p.call_timeout_s + 5)
        after = Snapshot.take(p.server_pid, p.extra_pids)
        await asyncio.to_thread(thread.join, 5)

        errors: list[str] = []
        lat_ms: list[float] = []
        lag_ms: list[float] = []
        admitted = ok = resp_bytes = 0
        for i in range(n_warm, total):
            call = calls[i]
            if call is None or not call.done():
                errors.append("not done")
                continue
            try:
                body = await call
            except grpc.aio.AioRpcError as exc:
                errors.append(f"{exc.code().name}: {exc.details()}"[:200])
                continue
            resp_bytes = len(body)
            ok += 1
            if pb.AdmitResponse.FromString(body).decision == pb.DECISION_ADMIT:
                admitted += 1
            lat_ms.append((done_at[i] - sched[i]) / 1e6)
            lag_ms.append((sent_at[i] - sched[i]) / 1e6)

    lat_ms.sort()
    lag_ms.sort()
    before: Snapshot = edges["before"]
    first = sched[n_warm]
    last_done = max(done_at[n_warm:]) if n_meas else first
    span = (last_done - first) / 1e9
    return UnaryResult(
        offered_per_s=p.rate,
        calls=n_meas,
        completed_per_s=ok / span if span > 0 else math.nan,
        errors=len(errors),
        p50_ms=percentile(lat_ms, 50),
        p99_ms=percentile(lat_ms, 99),
        max_ms=lat_ms[-1] if lat_ms else math.nan,
        server_cpu_s=after.server_cpu_s - before.server_cpu_s,
        client_cpu_s=after.client_cpu_s - before.client_cpu_s,
        send_lag_p99_ms=percentile(lag_ms, 99),
        admitted_fraction=admitted / ok if ok else math.nan,
        response_bytes=resp_bytes,
        other_cores=before.other_cores(after),
        steal_fraction=before.steal_fraction(after),
        error_samples=sorted(set(errors))[:3],
        extra_cpu_s=after.extra_cpu_s - before.extra_cpu_s,
    )


def unary_round(p: UnaryParams) -> UnaryResult:
    import uvloop

    # The sender thread must get the GIL back quickly when its sleep ends.
    sys.setswitchinterval(0.0005)
    return uvloop.run(_unary(p))


# ------------------------------------------------------------------- process


def loadgen_main(conn: Connection) -> None:
    """Process entry point: run the rounds the orchestrator sends until None."""
    os.dup2(2, 1)  # stdout belongs to the report
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        try:
            if isinstance(msg, StreamParams):
                conn.send(stream_round(msg))
            elif isinstance(msg, UnaryParams):
                conn.send(unary_round(msg))
            else:
                conn.send(RuntimeError(f"unknown command {msg!r}"))
        except Exception as exc:
            conn.send(RuntimeError(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
