"""The SDK's counters: plain ints on one object (``client.counters``), for
the sidecar to export as it likes. Monotonic since the client started; only
the event loop thread writes them (reads from another thread see a recent
value)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(slots=True)
class Counters:
    # Admit
    admits: int = 0  # admit() calls answered (every way below)
    batches: int = 0  # AdmitBatches sent on the stream
    streamed: int = 0  # entries sent in those batches
    unary_admits: int = 0  # Admits sent unary (re-asked after a stream error)
    queued: int = 0  # entries the server held in its queue (answered by a release)
    joined: int = 0  # admit() calls that joined one in flight for the same request id
    offline_admits: int = 0  # fail-open: admitted locally
    offline_refusals: int = 0  # fail-closed: refused with reason "unavailable"
    gate_timeouts: int = 0  # held by the server past the caller's deadline
    late_releases: int = 0  # late server admissions the caller was refused for: released
    stream_opens: int = 0
    stream_failures: int = 0
    breaker_trips: int = 0
    # Complete
    completes: int = 0  # complete() calls
    completes_buffered: int = 0  # buffered while unreachable
    completes_delivered_late: int = 0  # buffered ones delivered (and late releases' Completes)
    completes_spool_full: int = 0  # refused (ControlPlaneUnavailable): the spool was full
    completes_undeliverable: int = 0  # buffered ones the server refused for good (logged)
    # Several replicas (docs/ha.md)
    redirects: int = 0  # NOT_OWNER answers followed to the owner
    failovers: int = 0  # calls resent to another replica after theirs was unreachable
    reannounced: int = 0  # open reservations sent to a pool's new owner (Reannounce)
    reannounce_restored: int = 0  # of those, restored by it (not known there already)
    reannounce_failures: int = 0  # Reannounce calls that failed (retried on the next call)
    # ReportLoad, GetLimits
    report_load_failures: int = 0
    limits_failures: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)
