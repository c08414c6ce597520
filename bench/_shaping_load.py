"""Load processes for bench_shaping.py; each runs in its own spawned process.

* :func:`holder_main` -- the "sidecar" of the tenant whose calls wait. One
  persistent grpc.aio client on uvloop that keeps state between commands:
  admitted requests it holds (their slots stay taken until it settles
  them) and Admit calls left waiting server-side. Commands:

  - :class:`Fill`: take the tenant's concurrency slots with Admits that are
    answered at once, then start ``waiting`` more Admit calls that are not
    awaited (they queue on the server; the orchestrator confirms the count
    on the server itself).
  - :class:`Cycle`: open-loop settling at a fixed tick rate. Each tick
    settles the oldest held admission with Complete and, once that answers,
    sends one new Admit. With a backlog, each Complete frees a slot that a
    queued call takes and the new Admit joins the queue (its depth stays
    put); without one, the new Admit is admitted at once. Either way a tick
    is one Complete plus one Admit RPC and, in the end, one admission, so
    the server CPU per admission of the two modes differs by the queueing.
  - :class:`CancelWaiting`: cancel every Admit call still waiting (the
    server must take each out of its queue at once).
  - :class:`SettleAll`: Complete every held admission.

* :func:`prober_main` -- ``_loadgen.loadgen_main`` (bench_grpc's open-loop
  unary generator) with its tenant cycle replaced, so the measured Admits
  go to the always-admitted tenant(s).

Every loop is bounded in count and time; answers go back over the pipe.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import sys
import time
import traceback
from collections import Counter, deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import _loadgen as lg
import grpc
from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb

COMPLETE_METHOD = "/burstgate.v1.AdmissionService/Complete"
PROMPT_TOKENS = lg.PROMPT_TOKENS
MAX_TOKENS = lg.MAX_TOKENS
GENERATED_TOKENS = 40
# Calls the holder keeps open at most (waiting Admits plus everything else).
MAX_OPEN_CALLS = 20_000


@dataclass(frozen=True)
class Fill:
    target: str
    tenant: str
    lane: str
    admitted: int  # Admits awaited one by one; each must be admitted at once
    waiting: int  # then this many Admit calls started and left waiting
    prefix: str  # request ids: f"{prefix}{i:06d}"; unique over the whole run
    call_timeout_s: float  # gRPC deadline of every call (waiters: > their max wait)
    timeout_s: float = 60.0


@dataclass
class FillResult:
    held: int  # admitted requests held after the fill (all of them, not just this fill's)
    pending: int  # Admit calls started and not yet answered
    refused: dict[str, int]  # reason -> count, among calls that should have been admitted
    seconds: float


@dataclass(frozen=True)
class Cycle:
    target: str
    server_pid: int
    tenant: str
    lane: str
    rate: float  # ticks per second (one Complete + one Admit each)
    seconds: float  # measured
    warmup_s: float
    prefix: str
    call_timeout_s: float
    drain_timeout_s: float = 15.0


@dataclass
class CycleResult:
    ticks: int  # measured ticks
    starved: int  # measured ticks that found no admitted request to settle
    completes: int  # Complete calls answered OK, measured ticks
    admissions: int  # ADMIT answers received in the measured window
    refusals: dict[str, int]  # reason -> count, answers in the window
    errors: int
    error_samples: list[str]
    elapsed_s: float  # measured window: first measured tick to the drain
    drained: bool  # every measured Complete was followed by its admission
    server_cpu_s: float  # from schedstat (ns resolution), all server threads
    client_cpu_s: float
    other_cores: float
    steal_fraction: float
    # Complete sent -> the admission it made room for reaches the client
    # (the k-th Complete of the cycle paired with its k-th admission).
    handoff_p50_ms: float
    handoff_p99_ms: float
    queue_wait_p50_ms: float  # server-reported wait of the admitted calls
    pending_after: int  # Admit calls still open after the drain


@dataclass(frozen=True)
class CancelWaiting:
    timeout_s: float = 30.0


@dataclass
class CancelResult:
    cancelled: int  # calls cancelled while still waiting
    answered: int  # calls that got their answer before the cancel reached them
    seconds: float


@dataclass(frozen=True)
class SettleAll:
    target: str
    tenant: str
    timeout_s: float = 60.0


@dataclass
class SettleResult:
    settled: int
    errors: int
    error_samples: list[str] = field(default_factory=list)


def _admit_bytes(tenant: str, request_id: str, lane: str) -> bytes:
    return pb.AdmitRequest(
        tenant_id=tenant,
        request_id=request_id,
        lane=lane,
        prompt_tokens=PROMPT_TOKENS,
        max_tokens=MAX_TOKENS,
        model=lg.MODEL,
        pool=lg.POOL,
    ).SerializeToString()


def _complete_bytes(tenant: str, request_id: str, reservation_id: int) -> bytes:
    return pb.CompleteRequest(
        tenant_id=tenant,
        request_id=request_id,
        reservation_id=reservation_id,
        prompt_tokens=PROMPT_TOKENS,
        generated_tokens=GENERATED_TOKENS,
    ).SerializeToString()


def server_cpu_s(pid: int) -> float:
    """CPU time of process ``pid`` (all its threads) in seconds, to the
    nanosecond: the scheduler's run time from /proc/<pid>/task/*/schedstat
    (utime + stime in /proc/<pid>/stat count whole 10 ms ticks)."""
    total = 0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with (
                contextlib.suppress(FileNotFoundError),
                open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f,
            ):
                total += int(f.read().split()[0])
    except OSError:
        return lg.proc_cpu_s(pid)
    return total / 1e9


def _new_counts(now: Counter[str], before: Counter[str]) -> dict[str, int]:
    return {k: v - before[k] for k, v in now.items() if v > before[k]}


class Holder:
    """Client state kept across commands (runs on one event loop)."""

    def __init__(self) -> None:
        self._channels: dict[str, Any] = {}
        self._methods: dict[str, tuple[Any, Any]] = {}
        self.held: deque[tuple[str, str, int]] = deque()  # (tenant, request id, reservation id)
        self.pending: dict[str, asyncio.Task[None]] = {}
        self.admitted_total = 0
        self.admit_times: list[int] = []  # perf_counter_ns of ADMIT answers (while recording)
        self.queue_waits: list[int] = []  # ms, as answered (queue_wait_ms)
        self.recording = False
        self.refusals: Counter[str] = Counter()
        self.errors: list[str] = []
        self.answered_total = 0

    async def connect(self, target: str) -> tuple[Any, Any]:
        """(Admit, Complete) callables of the target, bytes in and out."""
        methods = self._methods.get(target)
        if methods is None:
            ch = grpc.aio.insecure_channel(target)
            await asyncio.wait_for(ch.channel_ready(), 10)
            self._channels[target] = ch
            methods = self._methods[target] = (
                ch.unary_unary(lg.UNARY_METHOD),
                ch.unary_unary(COMPLETE_METHOD),
            )
        return methods

    async def close(self) -> None:
        for task in list(self.pending.values()):
            task.cancel()
        if self.pending:
            await asyncio.wait(list(self.pending.values()), timeout=10)
        for ch in self._channels.values():
            await ch.close()

    # ----------------------------------------------------------- calls

    async def _admit(
        self, target: str, tenant: str, rid: str, body: bytes, timeout_s: float
    ) -> None:
        admit, _ = await self.connect(target)
        try:
            data = await admit(body, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            self.errors.append(f"Admit {exc.code().name}: {exc.details()}"[:200])
            return
        now = time.perf_counter_ns()
        self.answered_total += 1
        resp = pb.AdmitResponse.FromString(data)
        if resp.decision == pb.DECISION_ADMIT:
            self.held.append((tenant, rid, resp.reservation_id))
            self.admitted_total += 1
            if self.recording:
                self.admit_times.append(now)
                self.queue_waits.append(resp.queue_wait_ms)
        else:
            self.refusals[pb.Reason.Name(resp.reason)] += 1

    def start_admit(self, target: str, tenant: str, rid: str, lane: str, timeout_s: float) -> None:
        if len(self.pending) >= MAX_OPEN_CALLS:
            raise RuntimeError(f"more than {MAX_OPEN_CALLS} open Admit calls")
        body = _admit_bytes(tenant, rid, lane)
        task = asyncio.create_task(self._admit(target, tenant, rid, body, timeout_s))
        self.pending[rid] = task
        task.add_done_callback(lambda _t: self.pending.pop(rid, None))

    async def complete(self, target: str, tenant: str, rid: str, res_id: int) -> bool:
        _, complete = await self.connect(target)
        try:
            await complete(_complete_bytes(tenant, rid, res_id), timeout=10)
        except grpc.aio.AioRpcError as exc:
            self.errors.append(f"Complete {exc.code().name}: {exc.details()}"[:200])
            return False
        return True

    # -------------------------------------------------------- commands

    async def fill(self, p: Fill) -> FillResult:
        t0 = time.perf_counter()
        deadline = time.monotonic() + p.timeout_s
        before = Counter(self.refusals)
        for i in range(p.admitted):
            if time.monotonic() > deadline:
                raise TimeoutError(f"fill: {i} of {p.admitted} admitted in {p.timeout_s:g} s")
            rid = f"{p.prefix}{i:06d}"
            body = _admit_bytes(p.tenant, rid, p.lane)
            await self._admit(p.target, p.tenant, rid, body, p.call_timeout_s)
        refused = _new_counts(self.refusals, before)
        for i in range(p.admitted, p.admitted + p.waiting):
            self.start_admit(p.target, p.tenant, f"{p.prefix}{i:06d}", p.lane, p.call_timeout_s)
            if i % 100 == 99:
                await asyncio.sleep(0)  # let the calls go out as they are made
        await asyncio.sleep(0)
        return FillResult(len(self.held), len(self.pending), refused, time.perf_counter() - t0)

    async def cycle(self, p: Cycle) -> CycleResult:
        n_warm = int(p.rate * p.warmup_s)
        n_meas = int(p.rate * p.seconds)
        total = n_warm + n_meas
        interval = 1.0 / p.rate
        tasks: set[asyncio.Task[None]] = set()
        complete_sent: list[int] = []  # every tick's Complete, warm-up included
        first_measured = 0  # index in complete_sent of the first measured tick
        counts = {"starved": 0, "ok": 0}
        # Admissions are recorded from the first tick on, so the k-th one
        # pairs with the k-th Complete (one queue, served in FIFO order).
        self.admit_times = []
        self.queue_waits = []
        self.recording = True
        errors_before = len(self.errors)
        refusals_before = Counter(self.refusals)

        async def tick(i: int, tenant: str, rid: str, res_id: int) -> None:
            ok = await self.complete(p.target, tenant, rid, res_id)
            if ok and i >= n_warm:
                counts["ok"] += 1
            self.start_admit(p.target, p.tenant, f"{p.prefix}{i:06d}", p.lane, p.call_timeout_s)

        loop = asyncio.get_running_loop()
        t0 = loop.time() + 0.02
        before: lg.Snapshot | None = None
        cpu0 = 0.0
        admitted_at_start = 0
        i = 0
        hard_end = time.monotonic() + p.seconds + p.warmup_s + 30
        while i < total:
            now = loop.time()
            due = t0 + i * interval
            if due > now:
                await asyncio.sleep(due - now)
                continue
            if time.monotonic() > hard_end:
                break
            # Send every tick that is due (the loop's timers are ~1 ms coarse).
            while i < total and t0 + i * interval <= loop.time():
                if i == n_warm:
                    before = lg.Snapshot.take(p.server_pid)
                    cpu0 = server_cpu_s(p.server_pid)
                    admitted_at_start = self.admitted_total
                    first_measured = len(complete_sent)
                if not self.held:
                    if i >= n_warm:
                        counts["starved"] += 1
                    i += 1
                    continue
                tenant, rid, res_id = self.held.popleft()
                complete_sent.append(time.perf_counter_ns())
                task = asyncio.create_task(tick(i, tenant, rid, res_id))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                i += 1
        # Drain: every Complete answered and, for each, one admission seen.
        drain_end = time.monotonic() + p.drain_timeout_s
        sent = len(complete_sent) - first_measured
        drained = False
        while time.monotonic() < drain_end:
            if not tasks and self.admitted_total - admitted_at_start >= sent:
                drained = True
                break
            await asyncio.sleep(0.002)
        after = lg.Snapshot.take(p.server_pid)
        cpu1 = server_cpu_s(p.server_pid)
        self.recording = False
        if before is None:
            raise RuntimeError("cycle ended before its measured window began")
        pairs = list(zip(complete_sent, self.admit_times, strict=False))[first_measured:]
        handoff = sorted((a - c) / 1e6 for c, a in pairs)
        waits = sorted(float(w) for w in self.queue_waits[first_measured:])
        new_errors = self.errors[errors_before:]
        return CycleResult(
            ticks=n_meas,
            starved=counts["starved"],
            completes=counts["ok"],
            admissions=self.admitted_total - admitted_at_start,
            refusals=_new_counts(self.refusals, refusals_before),
            errors=len(new_errors),
            error_samples=sorted(set(new_errors))[:3],
            elapsed_s=(after.wall_ns - before.wall_ns) / 1e9,
            drained=drained,
            server_cpu_s=cpu1 - cpu0,
            client_cpu_s=after.client_cpu_s - before.client_cpu_s,
            other_cores=before.other_cores(after),
            steal_fraction=before.steal_fraction(after),
            handoff_p50_ms=lg.percentile(handoff, 50),
            handoff_p99_ms=lg.percentile(handoff, 99),
            queue_wait_p50_ms=lg.percentile(waits, 50) if waits else math.nan,
            pending_after=len(self.pending),
        )

    async def cancel_waiting(self, p: CancelWaiting) -> CancelResult:
        t0 = time.perf_counter()
        answered0 = self.answered_total
        tasks = list(self.pending.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=p.timeout_s)
        cancelled = sum(1 for t in tasks if t.cancelled())
        return CancelResult(cancelled, self.answered_total - answered0, time.perf_counter() - t0)

    async def settle_all(self, p: SettleAll) -> SettleResult:
        deadline = time.monotonic() + p.timeout_s
        errors_before = len(self.errors)
        settled = 0
        while self.held and time.monotonic() < deadline:
            batch = [self.held.popleft() for _ in range(min(64, len(self.held)))]
            oks = await asyncio.gather(*(self.complete(p.target, *h) for h in batch))
            settled += sum(oks)
        new_errors = self.errors[errors_before:]
        return SettleResult(settled, len(new_errors), sorted(set(new_errors))[:3])


async def _holder(conn: Connection) -> None:
    holder = Holder()
    try:
        while True:
            try:
                msg = await asyncio.to_thread(conn.recv)
            except EOFError:
                return
            if msg is None:
                return
            try:
                result: Any
                if isinstance(msg, Fill):
                    result = await asyncio.wait_for(holder.fill(msg), msg.timeout_s + 5)
                elif isinstance(msg, Cycle):
                    bound = msg.seconds + msg.warmup_s + msg.drain_timeout_s + 60
                    result = await asyncio.wait_for(holder.cycle(msg), bound)
                elif isinstance(msg, CancelWaiting):
                    result = await holder.cancel_waiting(msg)
                elif isinstance(msg, SettleAll):
                    result = await holder.settle_all(msg)
                else:
                    result = RuntimeError(f"unknown command {msg!r}")
            except Exception as exc:
                result = RuntimeError(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            conn.send(result)
    finally:
        with contextlib.suppress(Exception):
            await holder.close()


def holder_main(conn: Connection) -> None:
    """Process entry point of the holder."""
    os.dup2(2, 1)  # stdout belongs to the report
    import uvloop

    uvloop.run(_holder(conn))


def prober_main(conn: Connection, tenants: tuple[str, ...]) -> None:
    """Process entry point of the open-loop prober: bench_grpc's load
    generator with every Admit sent to ``tenants`` (in turn)."""
    # AdmitStream rows read _loadgen's module-level tenant cycle at each
    # round; unary Admits go to ``UnaryParams.tenants``, which bench_shaping
    # sets to the same tenants (its default is bound when _loadgen loads).
    vars(lg)["TENANT_CYCLE"] = tenants
    sys.setswitchinterval(0.0005)
    lg.loadgen_main(conn)
