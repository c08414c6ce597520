"""The ``simulate`` engine model (controlplane/sim/engine.py) run in scaled
real time, for a fake engine that answers HTTP.

One :class:`LiveEngine` is one vLLM instance: the same continuous batching,
chunked prefill, KV blocks and preemption as the simulator, stepped by an
asyncio task instead of an event queue. A step the model says takes 8 ms
takes 8 ms of wall time at ``speed`` 1, and 0.8 ms at ``speed`` 10. After
each step every request that produced tokens gets them on its queue, so a
streamed answer comes out token by token at the model's pace.

Times reported by the engine (its metrics' TTFT, queue and end-to-end
latencies) are **model time**: what the modelled GPU would have taken. At
``speed`` 1 that is the wall time a client sees; at ``speed`` 10 the client
sees a tenth of it.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from controlplane.domain.units import NS_PER_S
from controlplane.sim.engine import Engine, EngineParams, SimRequest

Clock = Callable[[], int]


class RequestTooLong(ValueError):
    """The prompt and output do not fit the engine's KV cache (vLLM: the
    model's maximum context length)."""


@dataclass(eq=False)
class LiveRequest:
    """A request in the live engine: its model state and the queue its
    HTTP handler reads (new token counts; ``None`` once finished)."""

    sim: SimRequest
    tokens: asyncio.Queue[int | None] = field(default_factory=asyncio.Queue)
    sent: int = 0
    aborted: bool = False
    cached_tokens: int = 0  # prompt tokens found in the prefix cache

    @property
    def ttft_s(self) -> float:
        """Time to first token in model seconds (-1 before it)."""
        r = self.sim
        return -1.0 if r.first_token_ns < 0 else (r.first_token_ns - r.arrival_ns) / NS_PER_S

    @property
    def queue_s(self) -> float:
        r = self.sim
        return -1.0 if r.started_ns < 0 else (r.started_ns - r.arrival_ns) / NS_PER_S

    @property
    def e2e_s(self) -> float:
        r = self.sim
        return -1.0 if r.done_ns < 0 else (r.done_ns - r.arrival_ns) / NS_PER_S


# Listeners the metrics module registers: called with the finished request.
FinishListener = Callable[[LiveRequest], None]
# ... and with the tokens of every step the engine finishes (its batch).
StepListener = Callable[[int], None]


class LiveEngine:
    """One modelled engine, stepped in real time by :meth:`run`."""

    def __init__(
        self,
        params: EngineParams,
        *,
        speed: float = 1.0,
        clock: Clock = time.monotonic_ns,
    ) -> None:
        if not speed > 0:
            raise ValueError(f"speed: must be > 0, got {speed!r}")
        self.params = params
        self.engine = Engine(0, params)
        self.speed = speed
        self._clock = clock
        self._t0 = clock()
        self._ids = itertools.count(1)
        self._live: dict[int, LiveRequest] = {}
        self._aborts: list[LiveRequest] = []
        self._wake = asyncio.Event()
        self.on_finish: list[FinishListener] = []
        self.on_step: list[StepListener] = []
        self.aborted_total = 0

    def model_now(self) -> int:
        """Nanoseconds of model time since the engine started."""
        return int((self._clock() - self._t0) * self.speed)

    def submit(self, prompt_tokens: int, output_tokens: int, cached_tokens: int = 0) -> LiveRequest:
        """Queue a request (first come, first served, as vLLM does)."""
        if prompt_tokens + max(1, output_tokens) > self.params.kv_capacity_tokens:
            raise RequestTooLong(
                f"{prompt_tokens} prompt + {output_tokens} output tokens exceed the "
                f"engine's context ({self.params.kv_capacity_tokens} tokens)"
            )
        key = next(self._ids)
        sim = SimRequest(key, prompt_tokens, output_tokens, self.model_now())
        live = LiveRequest(sim, cached_tokens=cached_tokens)
        self.engine.submit(sim, sim.arrival_ns)
        self._live[key] = live
        self._wake.set()
        return live

    def abort(self, live: LiveRequest) -> None:
        """The client went away: the request leaves the engine at the next
        step boundary (a step in flight finishes first, as on a GPU)."""
        if live.aborted or live.sim.done_ns >= 0:
            return
        live.aborted = True
        self._aborts.append(live)
        self._wake.set()

    def _apply_aborts(self) -> None:
        for live in self._aborts:
            if self.engine.abort(live.sim):
                self.aborted_total += 1
            self._live.pop(live.sim.key, None)
        self._aborts.clear()

    async def run(self) -> None:
        """Step the engine for ever (cancel the task to stop)."""
        engine = self.engine
        while True:
            self._apply_aborts()
            now = self.model_now()
            end = engine.start_step(now)
            if end is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            # Sleep until the step's end in wall time; a late wake-up (a busy
            # event loop) delays the next step, as a slow host would.
            await asyncio.sleep(max(0.0, (end - self.model_now()) / self.speed / NS_PER_S))
            engine.finish_step(max(end, self.model_now()))
            for listener in self.on_step:
                listener(engine.last_batch_tokens)
            self._deliver()

    def _deliver(self) -> None:
        done: list[int] = []
        for key, live in self._live.items():
            sim = live.sim
            new = sim.generated - live.sent
            if new > 0:
                live.sent = sim.generated
                live.tokens.put_nowait(new)
            if sim.done_ns >= 0:
                live.tokens.put_nowait(None)
                done.append(key)
        for key in done:
            live = self._live.pop(key)
            for listener in self.on_finish:
                listener(live)
