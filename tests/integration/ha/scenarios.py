"""The acceptance scenarios over procs.py's cluster and loadgen.py's load
(docs/ha.md, "Acceptance"): the tenant mix, the load process, the fault
cycles (kill -9, SIGSTOP past the TTL, a cut database link, SIGTERM), the
config fan-out measurement, and ``analyze`` turning a run's records into
the acceptance figures. tests/integration/ha/test_acceptance.py (CI size)
and bench/ha_acceptance.py (full size) are thin drivers of this module.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import grpc
from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb
from burstgate_client._proto.burstgate.v1 import admission_pb2_grpc as pb_grpc

from controlplane.domain import TenantConfig
from tests.integration.ha import checks
from tests.integration.ha.loadgen import Spec, TenantLoad
from tests.integration.ha.procs import REPO_ROOT, Cluster, Event, Replica

MAIN_POOLS = [f"p{i}" for i in range(6)]
SPREAD_POOLS = [f"s{i}" for i in range(4)]
QUOTA_POOL, GATE_POOL = "q0", "g0"
CONFIG_TENANT = "cfg"


@dataclass
class Mix:
    """The tenants of a run and the load offered to them.

    - ``main``: generous, over six cells; every request admitted and
      completed with less than it reserved;
    - ``tight``: the same cells, a small bucket: mostly refused (cheap);
    - ``spread``: four cells, offered twice its rate (the spread figure);
    - ``quota``: one cell, an hourly quota the run exhausts (overshoot);
    - ``gate``: one cell, ``gate_limit`` requests in flight, each held
      ~2 TTL, so a takeover meets open reservations (restored, peak).
    Requests of spread and quota report what they reserved (no refund), so
    admitted tokens are settled tokens."""

    rate: float
    ttl_s: float
    hourly_quota: int
    gate_limit: int = 20
    weights: dict[str, float] = field(
        default_factory=lambda: {
            "main": 0.34,
            "tight": 0.38,
            "spread": 0.16,
            "quota": 0.06,
            "gate": 0.06,
        }
    )

    @property
    def spread_rate(self) -> float:
        """Half the spread tenant's demand (tokens/s): it asks for 2x."""
        return self.rate * self.weights["spread"] * 100 / 2

    def tenants(self) -> list[TenantConfig]:
        big = {"token_rate": Decimal(1_000_000), "burst_tokens": 10_000_000}
        spread = Decimal(round(self.spread_rate))
        return [
            TenantConfig("main", **big),  # type: ignore[arg-type]
            TenantConfig("tight", token_rate=Decimal(500), burst_tokens=1_000),
            TenantConfig("spread", token_rate=spread, burst_tokens=int(spread)),
            TenantConfig("quota", **big, hourly_quota=self.hourly_quota),  # type: ignore[arg-type]
            TenantConfig("gate", **big, max_concurrency=self.gate_limit),  # type: ignore[arg-type]
            TenantConfig(CONFIG_TENANT, token_rate=Decimal(1000), burst_tokens=1000),
        ]

    def loads(self) -> list[TenantLoad]:
        w = self.weights
        hold = (2 * self.ttl_s + 1.0, 2 * self.ttl_s + 2.0)
        return [
            TenantLoad("main", MAIN_POOLS, w["main"], 60, 40, 30),
            TenantLoad("tight", MAIN_POOLS, w["tight"], 60, 40, 30),
            TenantLoad("spread", SPREAD_POOLS, w["spread"], 60, 40, 40),
            TenantLoad("quota", [QUOTA_POOL], w["quota"], 60, 40, 40),
            TenantLoad("gate", [GATE_POOL], w["gate"], 60, 40, 30, hold),
        ]

    @staticmethod
    def cell_of() -> dict[str, str]:
        """Pool -> cell: every pool is its own cell (the default cells)."""
        return {p: p for p in [*MAIN_POOLS, *SPREAD_POOLS, QUOTA_POOL, GATE_POOL]}


def add_tenants(url: str, tenants: list[TenantConfig]) -> None:
    from tests.support import add_tenants as add

    add(url, *tenants)


def admin_key(url: str) -> str:
    from controlplane.domain.keys import Role
    from controlplane.store.db import make_engine
    from controlplane.store.keys import KeyStore

    engine = make_engine(url)
    try:
        key, _ = KeyStore(engine).create_key("ha-acceptance", Role.ADMIN)
    finally:
        engine.dispose()
    return key


# ------------------------------------------------------------ the load


class LoadProc:
    """loadgen.py in its own process (its own session: killed at the end)."""

    def __init__(self, spec: Spec) -> None:
        self.spec = spec
        self.dir = Path(spec.out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "spec.json").write_text(spec.to_json())
        self.log = (self.dir / "loadgen.log").open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.ha.loadgen", str(self.dir / "spec.json")],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, cwd=REPO_ROOT,
            start_new_session=True,
        )  # fmt: skip
        self.started_ns = time.monotonic_ns()
        self._wait_line("ready", 60)

    def _wait_line(self, word: str, timeout: float) -> None:
        assert self.proc.stdout is not None
        got: list[bytes] = []
        reader = threading.Thread(target=lambda: got.append(self.proc.stdout.readline()))  # type: ignore[union-attr]
        reader.daemon = True
        reader.start()
        reader.join(timeout)
        if not got or got[0].strip() != word.encode():
            self.kill()
            raise RuntimeError(f"the load generator did not say {word!r} (see {self.dir})")

    def stop(self, timeout: float = 120.0) -> dict[str, Any]:
        """Stop sending, let it finish its Completes, read its summary."""
        assert self.proc.stdin is not None
        self.stopped_ns = time.monotonic_ns()
        with contextlib.suppress(BrokenPipeError):
            self.proc.stdin.write(b"stop\n")
            self.proc.stdin.flush()
        try:
            self.proc.wait(timeout)
        finally:
            self.kill()
        summary: dict[str, Any] = json.loads((self.dir / "summary.json").read_text())
        return summary

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, 9)
            self.proc.wait(10)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        self.log.close()

    def admits(self) -> list[checks.Admit]:
        return checks.read_admits(self.dir / "admits.csv")

    def completes(self) -> list[checks.Done]:
        return checks.read_completes(self.dir / "completes.csv")


# ------------------------------------------------------- waiting on state


def cell_owners(target: str, timeout: float = 2.0) -> dict[str, tuple[str, int]] | None:
    """cell -> (owner member, lease ms left) as ``target`` sees it; None if down."""
    try:
        with grpc.insecure_channel(target) as ch:
            got = pb_grpc.AdmissionServiceStub(ch).GetCellOwners(
                pb.GetCellOwnersRequest(), timeout=timeout
            )
    except grpc.RpcError:
        return None
    return {c.cell: (c.owner, c.lease_left_ms) for c in got.cells}


def wait_owned_without(
    cluster: Cluster, gone: Replica, cells: list[str], timeout: float
) -> float | None:
    """Seconds until every cell in ``cells`` is owned by a member other than
    ``gone`` (as a running survivor sees it); None on timeout."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        for r in cluster.replicas:
            if r is gone or r.pid is None or r.paused:
                continue
            owners = cell_owners(r.address)
            if owners is not None and all(
                owners.get(c, ("", 0))[0] not in ("", gone.member) for c in cells
            ):
                return time.monotonic() - t0
            break
        time.sleep(0.05)
    return None


def wait_until(pred: Callable[[], bool], timeout: float, interval: float = 0.1) -> bool:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if pred():
            return True
        time.sleep(interval)
    return pred()


def owner_of(cluster: Cluster, pool: str) -> Replica | None:
    for r in cluster.replicas:
        if r.pid is None or r.paused:
            continue
        owners = cell_owners(r.address)
        if owners and pool in owners:
            member = owners[pool][0]
            return next((x for x in cluster.replicas if x.member == member), None)
    return None


def hourly_remaining(cluster: Cluster, tenant: str, pool: str) -> int | None:
    """The tenant's hourly quota left as the owner of ``pool`` counts it."""
    r = owner_of(cluster, pool)
    if r is None:
        return None
    try:
        with grpc.insecure_channel(r.address) as ch:
            got = pb_grpc.AdmissionServiceStub(ch).GetLimits(
                pb.GetLimitsRequest(tenant_id=tenant), timeout=2
            )
    except grpc.RpcError:
        return None
    return int(got.hourly_remaining)


# --------------------------------------------------------- fault cycles


@dataclass
class Faults:
    """Runs fault cycles on ``cluster`` and keeps what they measured."""

    cluster: Cluster
    cells: list[str]
    log: Callable[[str], None] = print
    owned_again_s: list[float | None] = field(default_factory=list)
    restarts_s: list[float] = field(default_factory=list)

    @property
    def ttl(self) -> float:
        return self.cluster.ttl_s

    def kill(self, victim: Replica, restart: bool = True) -> Event:
        ev = self.cluster.kill(victim)
        took = wait_owned_without(self.cluster, victim, self.cells, 6 * self.ttl + 10)
        self.owned_again_s.append(took)
        self.log(f"kill -9 {victim.member}: its cells owned elsewhere after {took} s")
        if restart:
            self.restart(victim)
        return ev

    def restart(self, victim: Replica) -> None:
        victim.launch()
        self.cluster.note("start", victim)
        self.restarts_s.append(victim.wait_ready(90))

    def pause(self, victim: Replica, seconds: float | None = None) -> Event:
        seconds = 1.5 * self.ttl + 0.5 if seconds is None else seconds
        ev = self.cluster.pause(victim)
        time.sleep(seconds)
        self.cluster.resume(victim)
        self.log(f"SIGSTOP {victim.member} for {seconds:.1f} s, SIGCONT")
        return ev

    def cut(self, victim: Replica, seconds: float | None = None) -> Event:
        seconds = 1.5 * self.ttl + 0.5 if seconds is None else seconds
        ev = self.cluster.cut(victim)
        time.sleep(seconds)
        self.cluster.restore(victim)
        self.log(f"database link of {victim.member} cut for {seconds:.1f} s, restored")
        return ev

    def term(self, victim: Replica, restart: bool = True) -> Event:
        ev = self.cluster.term(victim)
        self.log(f"SIGTERM {victim.member}: exited")
        if restart:
            self.restart(victim)
        return ev

    def settle(self, timeout: float | None = None) -> bool:
        """Every cell owned by some live member (after a rejoin's handoffs)."""
        live = [r for r in self.cluster.replicas if r.pid is not None and not r.paused]

        def ok() -> bool:
            owners = cell_owners(live[0].address) if live else None
            members = {r.member for r in live}
            return owners is not None and all(
                owners.get(c, ("", 0))[0] in members for c in self.cells
            )

        return wait_until(ok, 6 * self.ttl + 10 if timeout is None else timeout)


# ------------------------------------------------------- config fan-out


def config_changes(cluster: Cluster, key: str, n: int, pause_s: float = 0.2) -> list[float]:
    """``n`` changes of a tenant's rate through the admin API, each on the
    next replica in turn; per change the seconds from sending UpdateTenant
    until every running replica's GetLimits answers the new rate."""
    from burstgate_client._proto.burstgate.v1 import admin_pb2 as apb
    from burstgate_client.admin import AdminClient
    from google.protobuf.field_mask_pb2 import FieldMask

    live = [r for r in cluster.replicas if r.pid is not None]
    chans = [grpc.insecure_channel(r.address) for r in live]
    stubs = [pb_grpc.AdmissionServiceStub(c) for c in chans]
    out = []
    try:
        for k in range(n):
            rate = Decimal(2000 + k)
            via = live[k % len(live)]
            with AdminClient(via.address, key) as admin:
                t0 = time.monotonic()
                admin.call("UpdateTenant", apb.UpdateTenantRequest(
                    tenant=apb.Tenant(tenant_id=CONFIG_TENANT, token_rate=str(rate)),
                    update_mask=FieldMask(paths=["token_rate"]),
                ))  # fmt: skip
                seen: set[int] = set()
                while len(seen) < len(stubs) and time.monotonic() - t0 < 30:
                    for i, stub in enumerate(stubs):
                        if i in seen:
                            continue
                        with contextlib.suppress(grpc.RpcError):
                            got = stub.GetLimits(
                                pb.GetLimitsRequest(tenant_id=CONFIG_TENANT), timeout=2
                            )
                            if Decimal(got.token_rate) == rate:
                                seen.add(i)
                    time.sleep(0.002)
                out.append(time.monotonic() - t0 if len(seen) == len(stubs) else float("inf"))
            time.sleep(pause_s)
    finally:
        for c in chans:
            c.close()
    return out


# ---------------------------------------------------------------- analysis


def analyze(
    cluster: Cluster, loads: list[LoadProc], mix: Mix, *, end_ns: int | None = None
) -> dict[str, Any]:
    """The figures every run reports (the drivers add timing ones)."""
    cell_of = mix.cell_of()
    member_of = {r.address: r.member for r in cluster.replicas}
    trace = checks.read_traces(cluster.traces(), cluster.deaths())
    admits = [a for load in loads for a in load.admits()]
    completes = [d for load in loads for d in load.completes()]
    end_ns = end_ns or time.monotonic_ns()
    events = cluster.events
    over = checks.overlaps(trace)
    stale, ambiguous = checks.stale_writes(trace)
    outside = checks.decided_outside_lease(admits, trace, cell_of, member_of)
    failovers = checks.failover_times(events, ["kill"], admits, trace, cell_of, member_of)
    stops = checks.failover_times(events, ["pause"], admits, trace, cell_of, member_of)
    cuts = checks.failover_times(events, ["cut"], admits, trace, cell_of, member_of)
    terms = checks.failover_times(events, ["term"], admits, trace, cell_of, member_of)
    return {
        "double_owners": len(over),
        "double_owner_samples": [[vars(a), vars(b)] for a, b in over[:5]],
        "epoch_disorder": len(checks.epoch_disorder(trace)),
        "intervals": len(trace.intervals),
        "admitted_outside_lease": len(outside),
        "admitted_outside_lease_samples": [str(a) for a in outside[:5]],
        "window_writes_landed": len(trace.writes),
        "window_writes_refused": len(trace.refused),
        "stale_window_writes_landed": len(stale),
        "window_writes_ending_after_takeover": ambiguous,
        "ledger": checks.reconcile(cluster.url, completes, [load.spec.run_id for load in loads]),
        "quota": checks.quota_overshoot(cluster.url, "quota", mix.hourly_quota),
        "kill": failovers,
        "pause": stops,
        "cut": cuts,
        "term": terms,
        "gate": checks.gate_figures(
            admits, completes, "gate", mix.gate_limit, events, trace, GATE_POOL, member_of, end_ns
        ),
        "admits": {o: sum(1 for a in admits if a.outcome == o) for o in ("A", "R", "N", "O")},
        "completes": len(completes),
    }


def latencies_ms(admits: list[checks.Admit], start_ns: int, end_ns: int) -> list[float]:
    """Admit latencies (ms) of decided answers sent in [start, end)."""
    return [(a.got - a.sent) / 1e6 for a in admits if a.decided and start_ns <= a.sent < end_ns]
