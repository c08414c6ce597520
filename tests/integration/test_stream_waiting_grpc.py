"""AdmitStream entries that may wait (AdmitBatch.max_wait_ms) over real gRPC:
the first result marks held entries ``queued``, each gets exactly one
release result later (admitted when the gate opens, QUEUE_TIMEOUT at its
max wait), a half-closed stream stays open until its releases are sent, a
cancelled one takes its entries out of the queues; without max_wait_ms the
answers are as before."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from decimal import Decimal
from typing import Any

import grpc
import pytest
from burstgate_client.protoclient import ProtoClient, pb

from controlplane.domain import TenantConfig
from controlplane.domain.policy import Policy
from tests.support import add_tenants, wait_until

FULL = {"queue_depth": 5, "requests_running": 256, "max_num_seqs": 256}
ROOM = {"queue_depth": 0, "requests_running": 0, "max_num_seqs": 256}


def load(**fields: Any) -> pb.LoadReport:
    return pb.LoadReport(pool="gpu-a", engine_id="e0", max_batch_tokens=8192, **fields)


def batch(batch_id: int, ids: list[str], **kw: Any) -> pb.AdmitBatch:
    n = len(ids)
    return pb.AdmitBatch(
        batch_id=batch_id, tenant_id=["acme"] * n, request_id=ids, prompt_tokens=[10] * n,
        max_tokens=[10] * n, pool="gpu-a", **kw,
    )  # fmt: skip


class Stream:
    """An AdmitStream fed from a queue: send batches when the test says,
    read results on a thread."""

    def __init__(self, c: ProtoClient) -> None:
        self._in: queue.Queue[pb.AdmitBatch | None] = queue.Queue()
        self.results: queue.Queue[pb.AdmitBatchResult | BaseException | None] = queue.Queue()
        self.call = c.stub.AdmitStream(self._requests())
        threading.Thread(target=self._read, daemon=True).start()

    def _requests(self) -> Iterator[pb.AdmitBatch]:
        while (b := self._in.get()) is not None:
            yield b

    def _read(self) -> None:
        try:
            for res in self.call:
                self.results.put(res)
            self.results.put(None)  # the stream ended OK
        except BaseException as exc:  # grpc.RpcError
            self.results.put(exc)

    def send(self, b: pb.AdmitBatch) -> None:
        self._in.put(b)

    def close(self) -> None:
        self._in.put(None)

    def next(self, timeout: float = 10) -> pb.AdmitBatchResult | BaseException | None:
        return self.results.get(timeout=timeout)


@pytest.fixture
def gated(migrated_url: str, make_server: Callable[..., Any]) -> Any:
    add_tenants(
        migrated_url, TenantConfig(tenant_id="acme", token_rate=Decimal(1000), burst_tokens=10**6)
    )
    return make_server(migrated_url, policy=Policy(pool_gate=True))


def test_held_entries_are_released_when_the_pool_has_room(gated: Any) -> None:
    with ProtoClient(gated.target, timeout=10) as c:
        c.report_load(load(**FULL))
        s = Stream(c)
        s.send(batch(7, ["a", "b", "c"], max_wait_ms=[5_000]))
        first = s.next()
        assert isinstance(first, pb.AdmitBatchResult)
        assert first.batch_id == 7 and not first.entry
        assert list(first.queued) == [True, True, True]
        assert list(first.decision) == [pb.DECISION_UNSPECIFIED] * 3
        assert gated.on_loop(lambda: gated.plane.service.waiting) == 3
        time.sleep(0.1)
        assert s.results.empty(), "released while the pool had no room"
        c.report_load(load(**ROOM))
        answered: dict[int, int] = {}
        while len(answered) < 3:
            res = s.next()
            assert isinstance(res, pb.AdmitBatchResult) and res.batch_id == 7
            assert len(res.entry) == len(res.decision) == len(res.queue_wait_ms) > 0
            for k, i in enumerate(res.entry):
                assert i not in answered, f"entry {i} answered twice"
                answered[i] = res.decision[k]
                assert res.reservation_id[k] > 0 and res.queue_wait_ms[k] >= 100
            assert res.pricing_multiplier == "1.000000"
        assert answered == {0: pb.DECISION_ADMIT, 1: pb.DECISION_ADMIT, 2: pb.DECISION_ADMIT}
        s.close()
        assert s.next() is None  # everything owed was sent: the stream ends OK
        # they are real reservations: Complete settles them
        done = c.complete("acme", "b", prompt_tokens=10, generated_tokens=3)
        assert done.refunded_tokens == 7


def test_a_held_entry_times_out_at_its_max_wait_and_a_half_closed_stream_waits_for_it(
    gated: Any,
) -> None:
    with ProtoClient(gated.target, timeout=10) as c:
        c.report_load(load(**FULL))
        s = Stream(c)
        # entry 0 may wait 300 ms, entry 1 not at all
        s.send(batch(1, ["slow", "now"], max_wait_ms=[300, 0]))
        s.close()  # half-closed at once: the release is still owed
        first = s.next()
        assert isinstance(first, pb.AdmitBatchResult)
        assert list(first.queued) == [True, False]
        assert first.decision[1] == pb.DECISION_REJECT
        assert first.reason[1] == pb.REASON_BACKPRESSURE and first.retryable[1]
        started = time.monotonic()
        release = s.next()
        assert isinstance(release, pb.AdmitBatchResult)
        assert list(release.entry) == [0]
        assert release.reason[0] == pb.REASON_QUEUE_TIMEOUT
        assert release.decision[0] == pb.DECISION_REJECT
        assert time.monotonic() - started < 5
        assert release.queue_wait_ms[0] >= 300
        assert s.next() is None


def test_a_cancelled_stream_takes_its_entries_out_of_the_queue(gated: Any) -> None:
    with ProtoClient(gated.target, timeout=10) as c:
        c.report_load(load(**FULL))
        s = Stream(c)
        s.send(batch(1, ["x", "y"], max_wait_ms=[10_000]))
        assert isinstance(s.next(), pb.AdmitBatchResult)
        assert gated.on_loop(lambda: gated.plane.service.waiting) == 2
        s.call.cancel()
        wait_until(lambda: gated.on_loop(lambda: gated.plane.service.waiting) == 0,
                   message="the cancelled stream's entries to leave the queue")  # fmt: skip
        # nothing was admitted for them: once the pool has room, the same
        # ids are decided afresh (not replayed as admissions)
        c.report_load(load(**ROOM))
        again = c.admit("acme", "x", prompt_tokens=10, max_tokens=10, pool="gpu-a")
        assert again.decision == pb.DECISION_ADMIT and not again.duplicate


def test_entries_that_fit_are_answered_at_once_and_batches_without_waits_never_queue(
    gated: Any,
) -> None:
    with ProtoClient(gated.target, timeout=10) as c:
        c.report_load(load(**ROOM))
        s = Stream(c)
        s.send(batch(1, ["p", "q"], max_wait_ms=[1_000]))
        first = s.next()
        assert isinstance(first, pb.AdmitBatchResult)
        assert list(first.queued) == [False, False]
        assert list(first.decision) == [pb.DECISION_ADMIT] * 2
        c.report_load(load(**FULL))
        s.send(batch(2, ["r"]))  # no max_wait_ms: the fast path, refused at once
        second = s.next()
        assert isinstance(second, pb.AdmitBatchResult)
        assert not second.queued and second.reason[0] == pb.REASON_BACKPRESSURE
        s.close()
        assert s.next() is None


@pytest.mark.parametrize(
    ("waits", "message"),
    [
        ([1, 2], "batch 3: max_wait_ms: must have 0, 1 or 3 entries, got 2"),
        ([0, -1, 0], "batch 3: max_wait_ms[1]: must be in [0, 3600000], got -1"),
        ([3_600_001], "batch 3: max_wait_ms[0]: must be in [0, 3600000], got 3600001"),
    ],
)
def test_bad_max_wait_ends_the_stream_naming_the_field_and_decides_nothing(
    gated: Any, waits: list[int], message: str
) -> None:
    with ProtoClient(gated.target, timeout=10) as c:
        s = Stream(c)
        s.send(batch(3, ["a", "b", "c"], max_wait_ms=waits))
        err = s.next()
        assert isinstance(err, grpc.RpcError)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.details() == message
        assert gated.on_loop(lambda: gated.plane.service.views.record("acme", "a")) is None


def test_an_id_already_waiting_for_another_call_fails_the_batch(gated: Any) -> None:
    with ProtoClient(gated.target, timeout=10) as c:
        c.report_load(load(**FULL))
        s1 = Stream(c)
        s1.send(batch(1, ["dup"], max_wait_ms=[10_000]))
        assert isinstance(s1.next(), pb.AdmitBatchResult)
        s2 = Stream(c)
        s2.send(batch(2, ["fresh", "dup"], max_wait_ms=[10_000]))
        err = s2.next()
        assert isinstance(err, grpc.RpcError)
        assert err.code() == grpc.StatusCode.ALREADY_EXISTS
        assert err.details().startswith("batch 2: request_id[1]: ")
        # nothing of batch 2 was decided or queued
        assert gated.on_loop(lambda: gated.plane.service.waiting) == 1
        s1.call.cancel()


def test_degraded_entries_carry_their_own_tenants_fallback_model(
    migrated_url: str, make_server: Callable[..., Any]
) -> None:
    from burstgate_client.sdk.model import admissions_of_result

    add_tenants(
        migrated_url,
        *(TenantConfig(tenant_id=t, token_rate=Decimal(1000), burst_tokens=10**6,
                       fallback_model=f"small-{t}") for t in ("acme", "beta")),
        TenantConfig(tenant_id="gamma", token_rate=Decimal(1000), burst_tokens=10**6),
    )  # fmt: skip
    srv = make_server(migrated_url, policy=Policy(degrade_gpu_util=0.9, degrade_max_tokens=8))
    with ProtoClient(srv.target, timeout=10) as c:
        c.report_load(pb.LoadReport(pool="default", engine_id="g", max_batch_tokens=8192,
                                    gpu_utilization=0.97, requests_running=0,
                                    max_num_seqs=256))  # fmt: skip
        for waits in ([], [1_000]):  # the columnar fast path, then entries that may wait
            tag = f"w{len(waits)}"
            b = pb.AdmitBatch(batch_id=1, tenant_id=["acme", "beta", "gamma", "acme"],
                              request_id=[f"{tag}-{i}" for i in range(4)],
                              lane=["standard", "standard", "standard", "premium"],
                              prompt_tokens=[10] * 4, max_tokens=[100] * 4,
                              max_wait_ms=waits)  # fmt: skip
            (res,) = c.admit_stream(iter([b]))
            assert list(res.degraded) == [True, True, True, False]  # premium is not degradable
            assert list(res.fallback_model) == ["small-acme", "small-beta", "", ""]
            got = admissions_of_result(res, range(4), list(b.request_id))
            assert [a.fallback_model for a in got] == ["small-acme", "small-beta", "", ""]
            assert [a.granted_max_tokens for a in got] == [8, 8, 8, 100]
