"""What the pool gate (gate.py) keeps per engine pool, and the room a
pool's reports leave: plain records, kept apart from the gate's rules so
the rules read on their own."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from controlplane.domain import LoadSample
from controlplane.service.demand import WorkRate
from controlplane.service.pace import PoolPace

# Completions remembered per pool to measure its drain rate.
DRAIN_WINDOW = 64


@dataclass(frozen=True, slots=True)
class Room:
    """What a pool can take now, before the releases since its reports."""

    fallback: int  # >= 0 without fresh reports: in-flight requests allowed; -1 = reports
    slots: int = 0  # free sequence slots of engines with nothing waiting
    tokens: int = 0  # those engines' next-step token budget for new prompts
    waiting: int = 0  # how many more may wait before the target is reached
    # Some engine reports its running requests and max_num_seqs, so whether
    # a release starts at the next step can be told; without them every
    # lane goes by the waiting target alone.
    steps_known: bool = False


@dataclass(slots=True)
class PoolState:
    """One pool as the gate knows it: its engines' reports, its releases
    since them, and what it learned of its pace."""

    engines: dict[str, LoadSample] = field(default_factory=dict)
    # Releases since the reports, newest last: those that start at the next
    # step (times, and their prompt tokens: two deques of ints, because ints
    # are not tracked by the garbage collector and tuples are) and those that
    # will wait (times).
    starting: deque[int] = field(default_factory=deque)
    starting_prompts: deque[int] = field(default_factory=deque)
    starting_tokens: int = 0
    waiting: deque[int] = field(default_factory=deque)
    inflight: int = 0  # released and not yet completed
    done: deque[int] = field(default_factory=lambda: deque(maxlen=DRAIN_WINDOW))
    report_gap_ns: int = 0  # typical time between two reports of one engine
    held_until: int = 0  # a takeover hold: closed until then or the next report (0 = none)
    pace: PoolPace = field(default_factory=PoolPace)  # how fast it takes held work
    # per-engine work rate in gated seconds, for the autoscaler (service/demand.py)
    work: WorkRate = field(default_factory=WorkRate)
    first_prompt: float = 0.0  # fail-open lanes' mean prompt (exponential average)
    # The pool's room from its reports, cached until a report arrives, the
    # first fresh one goes stale or the policy changes.
    room: Room | None = None
    room_until: int = -1
