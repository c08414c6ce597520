"""The soak's load: what a fleet of sidecars and engines sends, open loop.

* unary ``Admit`` at ``rate * (1 - stream_share)`` per second, each sent at
  its scheduled time (a stalled server does not slow the offered load);
* ``AdmitStream`` batches of ``batch`` entries carrying the rest of the
  rate, over one long-lived stream that is reopened when it breaks (a
  server restart);
* ``Complete`` for each admitted request after a short "execution" delay,
  except a fraction ``unsettled`` left open on purpose (the reservation TTL
  frees them); retried on UNAVAILABLE / DEADLINE_EXCEEDED / CANCELLED as a
  sidecar would (it is idempotent); a fraction ``replay`` of the acknowledged ones sent again, which
  must answer the same figures with ``duplicate=true``;
* ``ReportLoad`` from ``engines`` fake engines every ``report_interval_s``.

Every acknowledged Complete is appended to ``acks_path`` (CSV: tenant,
request id, duplicate, user charge, actual cost, attempt): the ledger
reconciliation at the end reads that file, so the driver keeps nothing per
request in memory beyond the calls in flight (at most ``max_in_flight``
unary calls; beyond that a send is skipped and counted) and the pending
Completes (rate x at most ``complete_delay_s[1]`` + retries).

Per interval (``take()``): latencies per RPC, call outcomes by status code,
decisions by reason. The load never raises: every failure is counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import grpc
from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb
from burstgate_client._proto.burstgate.v1 import admission_pb2_grpc as pb_grpc
from burstgate_client.protoclient import KEEPALIVE_OPTIONS

# Reconnect fast after a restart (grpc's default backoff grows to 120 s).
CHANNEL_OPTIONS: list[tuple[str, int]] = [
    *KEEPALIVE_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
# Complete is idempotent: retried when the answer may be lost (CANCELLED: a
# call still open when a stopping server's grace ran out).
RETRY_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
)
POOL = "soak-pool"
MODEL = "soak-model"


@dataclass(frozen=True)
class TenantLoad:
    tenant_id: str
    weight: float  # share of the admissions


@dataclass(frozen=True)
class LoadConfig:
    target: str
    token: str | None
    tenants: tuple[TenantLoad, ...]
    rate: float  # admissions per second (unary + stream entries)
    stream_share: float
    batch: int
    unsettled: float
    replay: float
    engines: int
    report_interval_s: float
    max_in_flight: int
    run_id: str
    acks_path: Path
    seed: int
    complete_delay_s: tuple[float, float] = (0.05, 1.5)
    admit_timeout_s: float = 5.0
    complete_timeout_s: float = 10.0
    complete_attempts: int = 5


@dataclass
class Interval:
    """What the load saw in one reporting interval."""

    latency_ms: dict[str, list[float]] = field(default_factory=dict)
    codes: Counter[tuple[str, str]] = field(default_factory=Counter)  # (rpc, status)
    decisions: Counter[str] = field(default_factory=Counter)  # admit | <reason>
    skipped: int = 0  # unary sends skipped: max_in_flight open, or > 1 s behind
    stream_skipped: int = 0  # stream entries not sent while the stream was reopened
    completes_acked: int = 0
    completes_not_found: int = 0  # reservation gone (restart) or expired
    replays_ok: int = 0
    replay_mismatches: list[str] = field(default_factory=list)

    def lat(self, rpc: str, ms: float) -> None:
        self.latency_ms.setdefault(rpc, []).append(ms)


class Load:
    def __init__(self, cfg: LoadConfig, epoch: Callable[[], int]) -> None:
        """``epoch()`` counts server restarts: a replayed Complete may get
        NOT_FOUND only if the server restarted since the first one."""
        self.cfg = cfg
        self.epoch = epoch
        self.rng = random.Random(cfg.seed)
        self.cur = Interval()
        self.in_flight = 0
        self.tasks: set[asyncio.Task[None]] = set()
        self.stub: Any = None  # set by run()
        self.timers: set[asyncio.TimerHandle] = set()
        self.md: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {cfg.token}"),) if cfg.token else ()
        )
        cum = 0.0
        self._cum: list[tuple[float, str]] = []
        for t in cfg.tenants:
            cum += t.weight
            self._cum.append((cum, t.tenant_id))
        # "w": a new run in an old output directory must not reconcile the
        # old run's acknowledgements against its own database.
        self._acks: TextIO = open(cfg.acks_path, "w")  # noqa: SIM115 (closed in close())
        self.acks_written = 0
        self._stopping = False

    # ----------------------------------------------------------- plumbing

    def take(self) -> Interval:
        """This interval's figures; a new interval starts."""
        cur, self.cur = self.cur, Interval()
        self._acks.flush()
        return cur

    def _tenant(self) -> str:
        x = self.rng.random() * self._cum[-1][0]
        for cum, tenant in self._cum:
            if x < cum:
                return tenant
        return self._cum[-1][1]

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _later(self, delay: float, coro_fn: Callable[[], Any]) -> None:
        loop = asyncio.get_running_loop()

        def fire() -> None:
            self.timers.discard(handle)
            if not self._stopping:
                self._spawn(coro_fn())

        handle = loop.call_later(delay, fire)
        self.timers.add(handle)

    @staticmethod
    def _code(exc: BaseException) -> str:
        if isinstance(exc, grpc.RpcError):
            code = exc.code()
            return code.name if code is not None else "NONE"
        return type(exc).__name__

    async def _ticker(self, per_s: float, until: float, fire: Callable[[int], None]) -> None:
        """Call ``fire(i)`` at ``t0 + i / per_s`` until ``until``; if the
        loop falls more than a second behind, the missed sends are skipped
        (counted) rather than sent at once."""
        if per_s <= 0:
            return
        t0 = time.monotonic()
        i = 0
        while True:
            t = t0 + i / per_s
            now = time.monotonic()
            if t >= until:
                return
            if t > now:
                await asyncio.sleep(t - now)
            elif now - t > 1.0:
                missed = int((now - t) * per_s)
                self.cur.skipped += missed
                i += missed
                continue
            fire(i)
            i += 1

    # ---------------------------------------------------------- the load

    async def run(self, until: float) -> None:
        """Send the load until ``until`` (time.monotonic()), then wait (at
        most ~30 s) for the Completes already due."""
        cfg = self.cfg
        async with grpc.aio.insecure_channel(cfg.target, options=CHANNEL_OPTIONS) as channel:
            self.stub = pb_grpc.AdmissionServiceStub(channel)
            unary = cfg.rate * (1 - cfg.stream_share)
            batches = cfg.rate * cfg.stream_share / cfg.batch
            jobs = [
                self._ticker(unary, until, lambda i: self._send(self._admit(i))),
                self._stream(batches, until),
                *(self._engine(e, until) for e in range(cfg.engines)),
            ]
            await asyncio.gather(*jobs)
            # Let the pending Completes (and their retries) finish.
            deadline = time.monotonic() + cfg.complete_delay_s[1] + 60
            while (self.tasks or self.timers) and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            self._stopping = True
            for h in list(self.timers):
                h.cancel()
            for task in list(self.tasks):
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*self.tasks, return_exceptions=True)

    def close(self) -> None:
        self._acks.close()

    def _send(self, coro: Any) -> None:
        if self.in_flight >= self.cfg.max_in_flight:
            coro.close()
            self.cur.skipped += 1
            return
        self._spawn(coro)

    def _admitted(self, tenant: str, rid: str, prompt: int, granted: int) -> None:
        """A request was admitted: settle it after its "execution", unless it
        is one of those left open on purpose."""
        if self.rng.random() < self.cfg.unsettled:
            return
        lo, hi = self.cfg.complete_delay_s
        delay = self.rng.uniform(lo, hi)
        generated = self.rng.randint(0, max(0, granted))
        cached = self.rng.randint(0, prompt // 2)
        self._later(delay, lambda: self._complete(tenant, rid, prompt, generated, cached))

    async def _admit(self, i: int) -> None:
        cfg, cur = self.cfg, self.cur
        tenant = self._tenant()
        rid = f"{cfg.run_id}-u{i}"
        lane = self.rng.choices(("", "premium", "batch"), (0.7, 0.1, 0.2))[0]
        prompt = self.rng.randint(50, 800)
        req = pb.AdmitRequest(
            tenant_id=tenant, request_id=rid, lane=lane, prompt_tokens=prompt,
            max_tokens=self.rng.randint(16, 512), model=MODEL, pool=POOL,
        )  # fmt: skip
        self.in_flight += 1
        t0 = time.perf_counter()
        try:
            resp = await self.stub.Admit(req, timeout=cfg.admit_timeout_s, metadata=self.md)
        except (grpc.RpcError, asyncio.InvalidStateError) as exc:
            self.cur.codes["Admit", self._code(exc)] += 1
            return
        finally:
            self.in_flight -= 1
        cur = self.cur  # the interval may have turned during the call
        # An Admit that waited in a queue (a tenant short of tokens, by
        # design up to its lane's bound) is timed apart from one decided at
        # once: the first measures the policy, the second the server.
        rpc = "Admit(queued)" if resp.queue_wait_ms else "Admit"
        cur.lat(rpc, (time.perf_counter() - t0) * 1000)
        cur.codes["Admit", "OK"] += 1
        if resp.decision == pb.DECISION_ADMIT:
            cur.decisions["admit"] += 1
            self._admitted(tenant, rid, prompt, resp.granted_max_tokens)
        else:
            cur.decisions[pb.Reason.Name(resp.reason).removeprefix("REASON_").lower()] += 1

    async def _stream(self, per_s: float, until: float) -> None:
        """One AdmitStream at a time, reopened 0.5 s after it breaks; a batch
        due while it is down is sent on the next one (the ticker skips what
        falls more than 1 s behind)."""
        if per_s <= 0:
            return
        cfg = self.cfg
        j = 0
        interval = 1.0 / per_s
        next_t = time.monotonic()
        while time.monotonic() < until:
            call = self.stub.AdmitStream(metadata=self.md)
            sent: deque[tuple[float, pb.AdmitBatch]] = deque()
            reader = asyncio.get_running_loop().create_task(self._read_stream(call, sent))
            try:
                while not reader.done():
                    now = time.monotonic()
                    if next_t >= until:
                        break
                    if next_t > now:
                        await asyncio.sleep(next_t - now)
                    elif now - next_t > 1.0:
                        missed = int((now - next_t) / interval)
                        self.cur.stream_skipped += missed * cfg.batch
                        next_t += missed * interval
                        continue
                    if reader.done():
                        break
                    batch = self._batch(j)
                    sent.append((time.perf_counter(), batch))
                    await call.write(batch)
                    j += 1
                    next_t += interval
                if not reader.done():
                    await call.done_writing()
                await reader
            except (grpc.RpcError, asyncio.InvalidStateError, RuntimeError) as exc:
                code = self._code(exc)
                if not reader.done():
                    call.cancel()
                    with contextlib.suppress(BaseException):
                        await reader
                if isinstance(exc, asyncio.InvalidStateError):  # written after it ended
                    with contextlib.suppress(BaseException):
                        code = (await call.code()).name
                self.cur.codes["AdmitStream", code] += len(sent) or 1
                await asyncio.sleep(0.5)
                continue
            code_enum = await call.code()
            code = code_enum.name if code_enum is not None else "NONE"
            if code != "OK":
                self.cur.codes["AdmitStream", code] += len(sent) or 1
                await asyncio.sleep(0.5)

    def _batch(self, j: int) -> pb.AdmitBatch:
        n = self.cfg.batch
        return pb.AdmitBatch(
            batch_id=j,
            tenant_id=[self._tenant() for _ in range(n)],
            request_id=[f"{self.cfg.run_id}-s{j}-{k}" for k in range(n)],
            prompt_tokens=[self.rng.randint(50, 800) for _ in range(n)],
            max_tokens=[self.rng.randint(16, 512) for _ in range(n)],
            model=MODEL,
            pool=POOL,
        )

    async def _read_stream(self, call: Any, sent: deque[tuple[float, pb.AdmitBatch]]) -> None:
        while True:
            res = await call.read()
            if res is grpc.aio.EOF:
                return
            t_sent, batch = sent.popleft()
            cur = self.cur
            cur.lat("AdmitStream", (time.perf_counter() - t_sent) * 1000)
            cur.codes["AdmitStream", "OK"] += 1
            if res.batch_id != batch.batch_id:
                raise RuntimeError(f"AdmitStream answered {res.batch_id} for {batch.batch_id}")
            for k, decision in enumerate(res.decision):
                if decision == pb.DECISION_ADMIT:
                    cur.decisions["admit"] += 1
                    self._admitted(batch.tenant_id[k], batch.request_id[k],
                                   batch.prompt_tokens[k], res.granted_max_tokens[k])  # fmt: skip
                else:
                    name = pb.Reason.Name(res.reason[k]).removeprefix("REASON_").lower()
                    cur.decisions[name] += 1

    async def _complete(self, tenant: str, rid: str, prompt: int, generated: int,
                        cached: int) -> None:  # fmt: skip
        cfg = self.cfg
        end = time.time_ns()
        req = pb.CompleteRequest(
            tenant_id=tenant, request_id=rid, prompt_tokens=prompt, generated_tokens=generated,
            cached_prompt_tokens=cached, kv_cache_miss_rate=self.rng.uniform(0.05, 0.5),
            kv_cache_miss_rate_reported=True, exec_start_unix_ns=end - 50_000_000,
            exec_end_unix_ns=end,
        )  # fmt: skip
        epoch = self.epoch()
        for attempt in range(1, cfg.complete_attempts + 1):
            t0 = time.perf_counter()
            try:
                resp = await self.stub.Complete(
                    req, timeout=cfg.complete_timeout_s, metadata=self.md
                )
            except (grpc.RpcError, asyncio.InvalidStateError) as exc:
                code = self._code(exc)
                self.cur.codes["Complete", code] += 1
                if code == "NOT_FOUND":
                    self.cur.completes_not_found += 1
                    return
                if isinstance(exc, grpc.RpcError) and exc.code() in RETRY_CODES:
                    await asyncio.sleep(2.0 ** (attempt - 1))  # 1, 2, 4, 8 s: past a restart
                    continue
                return
            cur = self.cur
            cur.lat("Complete", (time.perf_counter() - t0) * 1000)
            cur.codes["Complete", "OK"] += 1
            cur.completes_acked += 1
            self._acks.write(f"{tenant},{rid},{int(resp.duplicate)},{resp.user_charge},"
                             f"{resp.actual_cost},{attempt}\n")  # fmt: skip
            self.acks_written += 1
            if self.rng.random() < cfg.replay:
                self._later(2.0, functools.partial(self._replay, req, resp, epoch))
            return

    async def _replay(self, req: pb.CompleteRequest, first: pb.CompleteResponse,
                      epoch: int) -> None:  # fmt: skip
        """The same Complete again: the same figures, duplicate=true."""
        try:
            again = await self.stub.Complete(
                req, timeout=self.cfg.complete_timeout_s, metadata=self.md
            )
        except (grpc.RpcError, asyncio.InvalidStateError) as exc:
            code = self._code(exc)
            self.cur.codes["Complete(replay)", code] += 1
            # After a restart the settled-id cache is gone: NOT_FOUND is the
            # documented answer. Unavailable: the server is restarting.
            if code not in ("UNAVAILABLE", "DEADLINE_EXCEEDED") and not (
                code == "NOT_FOUND" and self.epoch() != epoch
            ):
                self.cur.replay_mismatches.append(f"{req.request_id}: {code}")
            return
        self.cur.codes["Complete(replay)", "OK"] += 1
        same = (again.duplicate, again.user_charge, again.actual_cost) == (
            True, first.user_charge, first.actual_cost,
        )  # fmt: skip
        if same:
            self.cur.replays_ok += 1
        else:
            self.cur.replay_mismatches.append(
                f"{req.request_id}: duplicate={again.duplicate} {again.user_charge} "
                f"vs {first.user_charge}"
            )

    async def _engine(self, e: int, until: float) -> None:
        """A fake engine: moderate load (room in the pool, no shedding)."""
        rng = random.Random(self.cfg.seed * 1000 + e)
        interval = self.cfg.report_interval_s
        next_t = time.monotonic() + rng.uniform(0, interval)
        while next_t < until:
            now = time.monotonic()
            if next_t > now:
                await asyncio.sleep(next_t - now)
            next_t = max(next_t + interval, time.monotonic())
            running = rng.randint(20, 120)
            rep = pb.LoadReport(
                pool=POOL, engine_id=f"soak-engine-{e}", batch_tokens=rng.randint(1000, 8000),
                max_batch_tokens=16384, queue_depth=rng.randint(0, 1), queue_capacity=0,
                kv_cache_miss_rate=rng.uniform(0.1, 0.4), gpu_utilization=rng.uniform(0.5, 0.8),
                requests_running=running, max_num_seqs=256,
                kv_cache_usage=rng.uniform(0.3, 0.7),
            )  # fmt: skip
            t0 = time.perf_counter()
            try:
                await self.stub.ReportLoad(rep, timeout=2.0, metadata=self.md)
            except (grpc.RpcError, asyncio.InvalidStateError) as exc:
                self.cur.codes["ReportLoad", self._code(exc)] += 1
                continue
            self.cur.lat("ReportLoad", (time.perf_counter() - t0) * 1000)
            self.cur.codes["ReportLoad", "OK"] += 1
