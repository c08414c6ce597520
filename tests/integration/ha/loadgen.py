"""The acceptance harness's load generator, run as its own process:

    python -m tests.integration.ha.loadgen <spec.json>

Open loop: every ``tick_s`` it starts ``rate x tick_s`` Admits (whatever the
answers), spread over the tenants by weight and over each tenant's pools in
turn, through the SDK (``AsyncAdmissionClient`` with every replica as a
seed: AdmitStream micro-batches, NOT_OWNER redirects, failover, Completes
to the admitting replica, the completion spool). Admits that arrive in one
tick go out as one batch per (replica, pool), which keeps the client and
the servers cheap enough for ~1,500 Admits/s on two cores. Each admitted
request is completed after its tenant's hold time with its real usage.

Records, one CSV line each, every time on ``time.monotonic_ns()`` (the
clock of the servers' trace files and of the harness's fault events):

- ``admits.csv``: sent, answered, tenant, request id, pool, outcome (A
  admitted, R refused by a decision, N not-owner after the SDK's hops, O
  decided by the SDK offline: nothing reachable), reason, the replica that
  admitted it (the SDK's record; "" when not admitted), reserved tokens;
- ``completes.csv``: sent, answered, tenant, request id, prompt and generated
  tokens sent, delivered (1: acknowledged by a server; 0: buffered in the
  SDK's spool, delivered later), duplicate, error ("" when none).

Runs until a line ``stop`` (or EOF) on stdin; then waits for the Completes
still due, flushes the SDK's spool, writes ``summary.json`` and exits.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO


@dataclass
class TenantLoad:
    tenant: str
    pools: list[str]
    weight: float  # share of the rate
    prompt: int = 60
    max_tokens: int = 40
    generated: int = 30  # tokens generated, reported by Complete
    hold_s: tuple[float, float] = (0.02, 0.1)  # admitted -> Complete, uniform


@dataclass
class Spec:
    seeds: list[str]
    rate: float
    tenants: list[TenantLoad]
    out_dir: str
    run_id: str = "run"
    tick_s: float = 0.02
    deadline_s: float = 0.5
    max_in_flight: int = 20_000
    seed: int = 7
    drain_s: float = 30.0

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str) -> Spec:
        raw = json.loads(text)
        raw["tenants"] = [TenantLoad(**{**t, "hold_s": tuple(t["hold_s"])}) for t in raw["tenants"]]
        return Spec(**raw)


def weighted_cycle(weights: list[float], n: int = 1000) -> list[int]:
    """Indexes in a smooth weighted round robin (a fixed mix per tick)."""
    total = sum(weights)
    current = [0.0] * len(weights)
    out = []
    for _ in range(n):
        for i, w in enumerate(weights):
            current[i] += w
        best = max(range(len(weights)), key=current.__getitem__)
        current[best] -= total
        out.append(best)
    return out


@dataclass
class Load:
    spec: Spec
    admits: TextIO
    completes: TextIO
    in_flight: int = 0
    skipped: int = 0
    sent: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    async def run(self, stop: asyncio.Event) -> Any:
        from burstgate_client.sdk import AsyncAdmissionClient

        spec = self.spec
        out = Path(spec.out_dir)
        client = AsyncAdmissionClient(
            spec.seeds, deadline_s=spec.deadline_s, wait_in_gate=False,
            spool_path=out / "sdk-spool.jsonl", batch_window_s=0.002,
        )  # fmt: skip
        rng = random.Random(spec.seed)
        cycle = weighted_cycle([t.weight for t in spec.tenants])
        next_pool = [0] * len(spec.tenants)
        print("ready", flush=True)
        t0 = time.monotonic()
        k, sent_total = 0, 0.0
        while not stop.is_set():
            k += 1
            due = spec.rate * k * spec.tick_s
            n = int(due) - int(sent_total)
            sent_total = due
            for _ in range(n):
                if self.in_flight >= spec.max_in_flight:
                    self.skipped += 1
                    continue
                ti = cycle[self.sent % len(cycle)]
                t = spec.tenants[ti]
                pool = t.pools[next_pool[ti] % len(t.pools)]
                next_pool[ti] += 1
                rid = f"{spec.run_id}-{self.sent}"
                self.sent += 1
                self.in_flight += 1
                task = asyncio.ensure_future(self.one(client, t, pool, rid, rng.uniform(*t.hold_s)))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
            delay = t0 + k * spec.tick_s - time.monotonic()
            if delay > 0:
                with _suppress_timeout():
                    await asyncio.wait_for(stop.wait(), delay)
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=spec.drain_s)
        flushed = await client.flush(spec.drain_s) if client.pending_completions else 0
        summary = {
            "sent": self.sent,
            "skipped": self.skipped,
            "unfinished": len(self.tasks),
            "errors": self.errors,
            "spool_flushed": flushed,
            "spool_pending": client.pending_completions,
            "counters": client.counters.as_dict(),
            "seconds": time.monotonic() - t0,
        }
        await client.aclose(flush_timeout_s=5.0)
        return summary

    async def one(self, client: Any, t: TenantLoad, pool: str, rid: str, hold: float) -> None:
        try:
            sent = time.monotonic_ns()
            a = await client.admit(
                t.tenant, rid, prompt_tokens=t.prompt, max_tokens=t.max_tokens, pool=pool
            )
            got = time.monotonic_ns()
            if a.offline:
                outcome = "O"
            elif a.reason == "not_owner":
                outcome = "N"
            else:
                outcome = "A" if a.admitted else "R"
            replica = admitted_by(client, t.tenant, rid) if a.admitted else ""
            self.admits.write(
                f"{sent},{got},{t.tenant},{rid},{pool},{outcome},{a.reason},{replica},"
                f"{t.prompt + t.max_tokens}\n"
            )
            if not a.admitted or a.offline:
                return
            await asyncio.sleep(hold)
            err, delivered, dup = "", 0, 0
            at = time.monotonic_ns()
            try:
                c = await client.complete(
                    t.tenant, rid, prompt_tokens=t.prompt, generated_tokens=t.generated
                )
                delivered, dup = int(c.delivered), int(c.duplicate)
            except Exception as exc:  # not acknowledged: recorded as such
                err = type(exc).__name__
            self.completes.write(
                f"{at},{time.monotonic_ns()},{t.tenant},{rid},{t.prompt},{t.generated},"
                f"{delivered},{dup},{err}\n"
            )
        except Exception as exc:
            name = type(exc).__name__
            self.errors[name] = self.errors.get(name, 0) + 1
        finally:
            self.in_flight -= 1


def admitted_by(client: Any, tenant: str, rid: str) -> str:
    """The replica that admitted (tenant, rid): the SDK keeps it to send the
    Complete there (``Admitted.address``; a private record read here, not
    part of the SDK's API: "" if it ever goes)."""
    rec = getattr(client, "_admitted", {}).get((tenant, rid))
    return str(getattr(rec, "address", "") or "")


class _suppress_timeout:
    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        return exc_type is not None and issubclass(exc_type, TimeoutError)


def main(argv: list[str]) -> int:
    import uvloop

    spec = Spec.from_json(Path(argv[0]).read_text())
    out = Path(spec.out_dir)
    out.mkdir(parents=True, exist_ok=True)

    async def run() -> Any:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()

        def watch_stdin() -> None:
            for line in sys.stdin:
                if line.strip() == "stop":
                    break
            loop.call_soon_threadsafe(stop.set)

        threading.Thread(target=watch_stdin, daemon=True).start()
        with (
            (out / "admits.csv").open("w", buffering=1 << 16) as admits,
            (out / "completes.csv").open("w", buffering=1 << 16) as completes,
        ):
            return await Load(spec, admits, completes).run(stop)

    summary = uvloop.run(run())
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
