"""Use cases of admission: the in-process API of the decision plane. This
package is the only importer of ``fastpath``.

``AdmissionService`` (admission.py) is a façade. It keeps what simulators,
replays, benchmarks and the gRPC layer drive, all times in the injected
clock's nanoseconds:

- ``AdmissionService(limits, clock=, pricing=)``: ``limits`` a
  ``ServiceLimits`` (the settings the service reads;
  ``ServiceLimits.of(settings)``).
- ``apply_config(tenants, lanes, policy)``: install a whole config, live;
  ``restore_usage(hour, day)``: quota use from the ledger, at start.
- ``admit(...)``: decide one request now, never wait.
- ``admit_or_wait(..., deadline_ns=)``: decide, or queue the request when
  only waiting stands between it and admission; returns an
  ``AdmitDecision`` or a ``Waiter`` whose ``on_done`` callback is called
  once with the final decision. ``waiting``: how many wait.
- ``tick()`` at ``next_wakeup_ns()``: time passed; ``cancel(waiter)``: the
  caller went away.
- ``complete(...)``: settle with real usage and refund; ``expire()``:
  release reservations past their TTL.
- ``report_load(...)``: an engine's load report (vLLM's terms); it rescores
  the pool and may release held requests.
- ``prepare_gc_freeze()``; the counters in ``stats``; ``policy``,
  ``pricing``, ``signer``, ``price_check``.

The other doors are parts with one job each, reached as attributes, so
each group of callers sees only its own:

- ``views`` (views.py, ``ServiceViews``): read-only answers for metrics,
  status, admin and Envoy: tenant state and limits, ``check_only``,
  ``record`` (a ``RecordView``: the named, read-only form of what the
  plane remembers of a request; the positional record stays inside this
  package), queue depths, pool views, ``pool_demand``, gate counts.
- ``batches`` (batch_admission.py, ``BatchAdmission``): ``admit`` (an
  AdmitStream batch, never waits) and ``admit_waiting`` (AdmitBatch).
- ``settlement`` (completion.py, ``Completions``): ``prepare`` and
  ``apply``, a Complete in two steps around the ledger's durable write.
- ``replicas`` (replicas.py, ``ReplicaDoors``): several replicas
  (docs/ha.md): ``route``/``pool_of`` for the owner check (pass the route
  on to ``admit_or_wait(route=)``: it is computed once),
  ``restore_reservation``, ``hold_pools``, ``forget_pools``.
- ``shares`` (sharing.py): a replica's share of each tenant's limits.
- ``offline`` (offline.py): booking requests a sidecar admitted while the
  server was unreachable.

Where a request goes is one rule, ``TenantDirectory.route`` (tenants.py):
tenant, lane, length-aware placement, pool. Inside, only the façade and
the dispatcher start a dispatch: a part that frees capacity hands what it
freed to the façade.
"""

from controlplane.service.admission import AdmissionService
from controlplane.service.answers import BatchResult
from controlplane.service.recordview import RecordView
from controlplane.service.restore import OpenReservation, Restore
from controlplane.service.service_limits import ServiceLimits
from controlplane.service.tenants import Route

__all__ = [
    "AdmissionService",
    "BatchResult",
    "OpenReservation",
    "RecordView",
    "Restore",
    "Route",
    "ServiceLimits",
]
