"""What one modelled engine sustains on a trace's length mix: the capacity
``simulate``'s loads are multiples of."""

from __future__ import annotations

import random

from controlplane.domain.units import NS_PER_S
from controlplane.sim.engine import Engine, EngineParams, SimRequest
from controlplane.sim.trace import TraceRequest


def estimate_capacity_rps(
    trace: list[TraceRequest],
    params: EngineParams,
    *,
    sample: int = 2_000,
    seed: int = 0,
    prefix_unit_tokens: int | None = None,
) -> float:
    """Requests per second one engine sustains on this trace's length mix.

    ``sample`` requests drawn from the trace are all offered at once (the
    engine saturated, its own scheduler deciding); the rate is measured
    between the 10th and the 90th percentile of completions, so neither the
    ramp-up nor the tail of the last long requests counts. A trace shorter
    than ``sample`` is drawn from with replacement: a few hundred requests
    offered at once mostly run side by side (256 sequences) and would
    measure the ramp, not the engine's sustained rate.

    Saturated with long prompts the engine starts more requests than its
    KV cache holds, then preempts and recomputes them (the long-prompt
    trace recomputes each prompt ~2.6 times): that is what vLLM's scheduler
    does, so the estimate keeps it. A stream of requests at up to this rate
    does not thrash; ~10-20 % above it, on long prompts, it does (the load
    at which the engine falls behind is what "1.0x" means).

    With a prefix cache (``prefix_unit_tokens``) the sample keeps the
    trace's order and block ids, so the engine reuses what a saturated
    engine can: shared prefixes of requests running side by side, little
    else (a saturated engine's KV cache has no room left to cache in)."""
    rng = random.Random(seed)
    few = len(trace) < sample
    picked = rng.choices(trace, k=sample) if few else rng.sample(trace, sample)
    if prefix_unit_tokens is not None:
        picked.sort(key=lambda r: (r.t_ns, r.row))
    return _saturated_rps(picked, params, prefix_unit_tokens)


def _saturated_rps(
    picked: list[TraceRequest], params: EngineParams, prefix_unit_tokens: int | None = None
) -> float:
    engine = Engine(0, params, prefix_unit_tokens)
    for i, tr in enumerate(picked):
        blocks = tr.blocks if prefix_unit_tokens is not None else ()
        engine.submit(SimRequest(i, tr.prompt_tokens, tr.output_tokens, 0, blocks), 0)
    now = 0
    done: list[int] = []
    while engine.busy:
        end = engine.start_step(now)
        if end is None:  # pragma: no cover - a busy engine always schedules
            break
        done += [end] * len(engine.finish_step(end).finished)
        now = end
    lo, hi = len(done) // 10, len(done) * 9 // 10
    if hi - lo < 2 or done[hi - 1] <= done[lo]:
        return len(done) * NS_PER_S / max(1, now)
    return (hi - lo - 1) * NS_PER_S / (done[hi - 1] - done[lo])
