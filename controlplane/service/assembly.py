"""How the admission service's parts are built and wired together.

One function, so the façade's constructor reads as "build the parts, keep
the ones it drives" and each part's inputs are visible in one place. The
order matters only where a part takes another: the table and the request
log first, then the tenant directory and the gates, then the parts that
decide, queue and settle, and last the doors over them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from controlplane.domain.units import NS_PER_MS, NS_PER_S
from controlplane.service.answers import Outcomes
from controlplane.service.batch_admission import BatchAdmission
from controlplane.service.completion import Completions
from controlplane.service.deadlines import Deadlines
from controlplane.service.decider import Decider
from controlplane.service.dispatcher import Dispatcher
from controlplane.service.gate import PoolGate
from controlplane.service.offline import Booking
from controlplane.service.pressure import PressureGate
from controlplane.service.pricing import Pricing
from controlplane.service.queueing import WaitQueues
from controlplane.service.records import Record, RequestLog
from controlplane.service.replicas import ReplicaDoors
from controlplane.service.restore import Restorer
from controlplane.service.service_limits import ServiceLimits
from controlplane.service.settlement import Settler
from controlplane.service.sharing import ShareControl
from controlplane.service.signing import AdmissionSigner
from controlplane.service.stats import AdmissionStats
from controlplane.service.tenants import TenantDirectory
from controlplane.service.unary import UnaryAdmission
from controlplane.service.views import ServiceViews
from fastpath import TokenBucketTable

# (ended reservations, now, pools the gate forgets): the façade frees what
# they held and dispatches.
Released = Callable[[list[Record], int, Sequence[str]], None]


@dataclass(frozen=True, slots=True, kw_only=True)
class Parts:
    table: TokenBucketTable
    log: RequestLog
    stats: AdmissionStats
    tenants: TenantDirectory
    pressure: PressureGate
    gate: PoolGate
    deadlines: Deadlines
    signer: AdmissionSigner
    dispatcher: Dispatcher
    settler: Settler
    shares: ShareControl
    offline: Booking
    unary: UnaryAdmission
    batches: BatchAdmission
    replicas: ReplicaDoors
    settlement: Completions
    views: ServiceViews


def assemble(
    limits: ServiceLimits, clock: Callable[[], int], pricing: Pricing, released: Released
) -> Parts:
    table = TokenBucketTable()
    # Memory protection: every open reservation is remembered until settled or
    # expired, so their number is capped (refused OPEN_RESERVATIONS beyond).
    table.set_open_limits(limits.max_open_reservations, limits.max_open_reservations_per_tenant)
    ttl_ns = int(limits.reservation_ttl_s * NS_PER_S)
    log = RequestLog(
        ttl_ns=ttl_ns,
        replay_ns=int(limits.rejection_replay_s * NS_PER_S),
        settled_ns=int(limits.settled_id_window_s * NS_PER_S),
    )
    stats = AdmissionStats()
    tenants = TenantDirectory(table, limits.policy, limits.default_tenant)
    stale_ns = int(limits.load_report_stale_s * NS_PER_S)
    pressure = PressureGate(stale_ns=stale_ns)
    gate = PoolGate(stale_ns=stale_ns)
    queues = WaitQueues()
    deadlines = Deadlines(tenants, gate, pressure, queues, limits.retry_memory)
    # Signs every admission so that Reannounce restores only what this
    # deployment issued (signing.py); the server installs the deployment's
    # keys (store/signing.py) before serving.
    signer = AdmissionSigner()
    decider = Decider(
        table=table, tenants=tenants, pressure=pressure, gate=gate, pricing=pricing,
        concurrency_retry_ns=limits.concurrency_retry_ms * NS_PER_MS, deadlines=deadlines,
        signer=signer, first_reservation=max(1, clock() // 1000),  # microseconds: see Decider
    )  # fmt: skip
    outcomes = Outcomes(log, stats, tenants, signer)
    dispatcher = Dispatcher(
        tenants=tenants, decider=decider, outcomes=outcomes, stats=stats, gate=gate,
        queues=queues, deadlines=deadlines,
    )  # fmt: skip
    settler = Settler(table, log, limits.complete_max_overrun_ratio)
    unary = UnaryAdmission(
        clock=clock, tenants=tenants, log=log, outcomes=outcomes, dispatcher=dispatcher,
        deadlines=deadlines, decider=decider, stats=stats,
    )  # fmt: skip
    restorer = Restorer(
        tenants=tenants, log=log, dispatcher=dispatcher, decider=decider, gate=gate,
        stats=stats, ttl_ns=ttl_ns, signer=signer,
    )  # fmt: skip
    return Parts(
        table=table, log=log, stats=stats, tenants=tenants, pressure=pressure, gate=gate,
        deadlines=deadlines, signer=signer, dispatcher=dispatcher, settler=settler,
        # Several replicas deciding for one tenant: controlplane/ha/shares.py
        # drives this (service/shares.py); unused in process and on SQLite.
        shares=ShareControl(
            tenants=tenants, decider=decider, queues=queues, stats=stats, table=table,
            clock=clock, changed=dispatcher.dispatch,
        ),
        # Booking the requests a sidecar admitted while this server was
        # unreachable, from their Complete (CompleteRequest.offline).
        offline=Booking(
            tenants=tenants, log=log, dispatcher=dispatcher, decider=decider, outcomes=outcomes,
            stats=stats, max_overrun_ratio=limits.complete_max_overrun_ratio,
        ),
        unary=unary,
        batches=BatchAdmission(
            clock=clock, tenants=tenants, log=log, queues=queues, deadlines=deadlines,
            decider=decider, stats=stats, unary=unary, max_batch=limits.max_batch,
        ),
        replicas=ReplicaDoors(
            clock=clock, tenants=tenants, log=log, gate=gate, settler=settler,
            restorer=restorer, released=released,
        ),
        settlement=Completions(
            clock=clock, settler=settler, gate=gate, stats=stats, released=released
        ),
        views=ServiceViews(
            clock=clock, table=table, tenants=tenants, log=log, queues=queues,
            deadlines=deadlines, pressure=pressure, gate=gate, stats=stats,
            target_utilization=limits.autoscale_target_utilization,
            engine_startup_s=limits.autoscale_engine_startup_s,
        ),
    )  # fmt: skip
