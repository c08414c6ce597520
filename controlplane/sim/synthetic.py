"""Synthetic traces for ``burstgate simulate``, so that no claim rests on the
one shared Azure trace.

``synthetic:NAME[:SEED[:DURATION_S]]`` names one (the TRACE argument):

- ``heavy-burst``: code-completion-like requests (prompts 1.5k-2.5k tokens,
  outputs of tens of tokens) arriving as an on/off modulated Poisson
  process: a base rate, and rare bursts at 50x it lasting 2-6 s, separated
  by quiet spells of 100-300 s. Per-second arrival CV 3.2-3.4, peak/mean 23-33
  (seeds 0-7).
- ``long-prompt``: conversation with long contexts (prompts log-normal,
  mean ~11k tokens, capped at 64k: well under a 128k context and an
  engine's 400k tokens of KV) and outputs of a few hundred tokens; gentle
  modulation (2x for 20-60 s every few minutes).
- ``diurnal``: chat-like requests (prompts ~1k, outputs ~200) over a day
  compressed into three hours (the trough a quarter of the peak), with
  waves of 8-40 minutes on top: minute-scale swings for the autoscalers
  (``simulate --autoscale``), drawn per seed.
- ``chat-sessions``: multi-turn conversations with prefix reuse, for the
  prefix cache (``simulate`` models one per engine): conversations start as
  a Poisson process; each has 1-10 turns (1 + geometric, mean ~2.5) some
  seconds of thinking apart (log-normal, median 20 s); turn k's prompt is
  its tenant's system prompt + the conversation so far (a first-turn
  context document, every earlier question and answer) + the new question,
  so its leading blocks repeat turn k-1's. Requests carry block ids
  (``TraceRequest.blocks``, ``block_tokens`` tokens each) and a ``session``:
  a conversation keeps one tenant, and :func:`bind_system_prompts` puts
  each tenant's own system prompt (512-3072 tokens, drawn per tenant) in
  front once tenants are assigned. Reuse exists without a public trace.

Generation is seeded and deterministic (``random.Random(seed)``, nothing
else), times are rounded to 100 ns so that the Azure CSV written by
:func:`write_azure_csv` (seven fractional digits) reads back exactly.

Why on/off and not a Markov-modulated process with exponential spells: with
exponential quiet spells a ten-minute trace has no burst at all one seed in
seven; bounded spells keep every seed's trace what its name says, which the
tests assert (:func:`per_second_stats`).
"""

from __future__ import annotations

import hashlib
import itertools
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np

from controlplane.analysis.stats import series_stats
from controlplane.domain.units import NS_PER_S
from controlplane.sim.trace import TraceRequest

PREFIX = "synthetic:"
_TICK_NS = 100  # the Azure CSV's resolution: seven fractional digits
# Written traces start here: any fixed instant would do (the loader shifts
# the first arrival to 0); a fixed one keeps the file byte-identical per seed.
_EPOCH = datetime(2024, 1, 1, tzinfo=UTC)


@dataclass(frozen=True, slots=True)
class OnOff:
    """Poisson arrivals at ``base_rps``, times ``factor`` during bursts.
    Spell lengths are uniform in their (low, high) ranges, seconds."""

    base_rps: float
    factor: float
    burst_s: tuple[float, float]
    quiet_s: tuple[float, float]


@dataclass(frozen=True, slots=True)
class Diurnal:
    """Poisson arrivals whose rate swings on two time scales: one compressed
    "day" over the whole trace (a trough of ``trough`` x the peak, the peak
    mid-trace) times ``swings`` slower waves of minutes (each a sine of a
    period drawn from ``swing_period_s`` and an amplitude from
    ``swing_amplitude``, random phase; all drawn per seed). What an
    autoscaler is for: demand that moves over minutes, not seconds."""

    peak_rps: float
    trough: float
    swings: int
    swing_period_s: tuple[float, float]
    swing_amplitude: tuple[float, float]


@dataclass(frozen=True, slots=True)
class Sessions:
    """Conversations starting at ``sessions_per_s`` (Poisson); 1 + a
    geometric number of further turns (each one more with probability
    ``more_turns``, at most ``max_turns``), ``think_s`` (median, sigma) of a
    log-normal apart; stopped once a prompt would pass ``max_prompt``."""

    sessions_per_s: float
    more_turns: float
    max_turns: int
    think_s: tuple[float, float]
    max_prompt: int
    system_tokens: tuple[int, int]  # a tenant's system prompt, drawn per tenant


@dataclass(frozen=True, slots=True)
class Shape:
    name: str
    arrivals: OnOff | Diurnal | Sessions
    duration_s: float  # default length of the trace
    prompt: Callable[[random.Random], int]
    output: Callable[[random.Random], int]
    summary: str


def _clip_lognormal(
    median: float, sigma: float, lo: int, hi: int
) -> Callable[[random.Random], int]:
    mu = math.log(median)
    return lambda rng: min(hi, max(lo, round(rng.lognormvariate(mu, sigma))))


SHAPES: dict[str, Shape] = {
    s.name: s
    for s in (
        Shape(
            "heavy-burst",
            # 20 requests/s between bursts and bursts at 50x: the mean
            # (~35/s) is near four h100-8b engines' capacity on this length
            # mix, so at --engines 4 --load 1 the trace is hardly rescaled
            # and its per-second shape is the one simulated. Bursts of 2-6 s
            # every 100-300 s: ~2 % of the time at 50x gives CV ~3.3 and
            # peak/mean ~28.
            OnOff(base_rps=20.0, factor=50.0, burst_s=(2.0, 6.0), quiet_s=(100.0, 300.0)),
            duration_s=600.0,  # ~21k requests: a 5-policy run in about a minute
            # Code completion: the file around the cursor (1.5k-2.5k
            # tokens, most near 2k), a completion of tens of tokens.
            prompt=lambda rng: round(rng.triangular(1_500, 2_500, 2_000)),
            output=_clip_lognormal(30, 0.6, 4, 256),
            summary="code completion (prompts 1.5k-2.5k, outputs ~30) in rare 40x bursts",
        ),
        Shape(
            "long-prompt",
            # Conversation: a gentle 2x for 20-60 s every 2-6 minutes; the
            # point of this trace is the lengths, not the bursts. ~4/s is
            # about four h100-8b engines' capacity on this mix.
            OnOff(base_rps=3.5, factor=2.0, burst_s=(20.0, 60.0), quiet_s=(120.0, 360.0)),
            duration_s=1_800.0,  # ~7k requests
            # Log-normal, median 7k, sigma 1: mean ~11k before the cap; the
            # cap (64k) is half a 128k context and a sixth of an engine's
            # KV cache, so every request fits an engine on its own.
            prompt=_clip_lognormal(7_000, 1.0, 256, 64_000),
            output=_clip_lognormal(250, 0.5, 16, 1_500),
            summary="long-context conversation (prompts ~11k mean, up to 64k; outputs ~280)",
        ),
        Shape(
            "diurnal",
            # A day compressed into three hours (trough a quarter of the
            # peak) with two waves of 8-40 minutes of +-15-30 % on top: the
            # minute-scale swings the autoscalers are scored on. The
            # peak (~24/s) is about four h100-8b engines' capacity on this
            # mix, so at --engines 4 --load ~0.5 it is hardly rescaled.
            Diurnal(
                peak_rps=24.0,
                trough=0.25,
                swings=2,
                swing_period_s=(480.0, 2_400.0),
                swing_amplitude=(0.15, 0.30),
            ),
            duration_s=10_800.0,  # ~150k requests
            # Chat, as the Azure conversation trace: prompts ~1k tokens
            # (log-normal, median 800, up to 16k), answers ~200.
            prompt=_clip_lognormal(800, 0.9, 16, 16_000),
            output=_clip_lognormal(180, 0.7, 4, 2_000),
            summary="chat (prompts ~1k, outputs ~200) whose rate swings over minutes and hours",
        ),
        Shape(
            "chat-sessions",
            # ~2.5 requests per conversation: ~5/s, about one h100-8b
            # engine's capacity on this mix (simulate rescales it anyway).
            Sessions(
                2.0,
                more_turns=0.6,
                max_turns=10,
                think_s=(20.0, 0.8),
                max_prompt=32_000,
                system_tokens=(512, 3_072),
            ),
            duration_s=600.0,  # ~3k requests
            # A question (median 120 tokens); the first turn also brings a
            # context document (median 800: a file, a retrieved passage).
            # prompt: the question; the document is drawn with CONTEXT.
            prompt=_clip_lognormal(120, 0.8, 8, 2_000),
            output=_clip_lognormal(200, 0.7, 8, 1_500),
            summary="multi-turn chat with per-tenant system prompts (prefix reuse; block ids)",
        ),
    )
}
# The first turn's context document (chat-sessions).
CONTEXT = _clip_lognormal(800, 0.8, 0, 8_000)
DEFAULT_BLOCK_TOKENS = 64  # chat-sessions' block ids: 4 of the engine's 16-token blocks


def diurnal_rate(shape: Diurnal, rng: random.Random, duration_s: float) -> Callable[[float], float]:
    """The rate (requests/s) at time t of one seed's diurnal trace."""
    waves = [
        (rng.uniform(*shape.swing_period_s), rng.uniform(*shape.swing_amplitude),
         rng.uniform(0, 2 * math.pi))
        for _ in range(shape.swings)
    ]  # fmt: skip
    low = shape.trough

    def rate(t: float) -> float:
        day = low + (1 - low) * math.sin(math.pi * t / duration_s) ** 2
        m = 1.0
        for period, amp, phase in waves:
            m *= 1 + amp * math.sin(2 * math.pi * t / period + phase)
        return shape.peak_rps * day * m

    return rate


def _diurnal_arrivals(rng: random.Random, shape: Diurnal, duration_s: float) -> list[int]:
    """Arrival times in ns by thinning a Poisson process at the highest rate."""
    rate = diurnal_rate(shape, rng, duration_s)
    top = shape.peak_rps * math.prod(1 + shape.swing_amplitude[1] for _ in range(shape.swings))
    out: list[int] = []
    t = rng.expovariate(top)
    while t < duration_s:
        if rng.random() * top < rate(t):
            out.append(round(t * NS_PER_S / _TICK_NS) * _TICK_NS)
        t += rng.expovariate(top)
    return out


def _arrivals(
    rng: random.Random, shape: OnOff | Diurnal | Sessions, duration_s: float
) -> list[int]:
    """Arrival times in ns, ascending, rounded to the CSV's 100 ns."""
    if isinstance(shape, Diurnal):
        return _diurnal_arrivals(rng, shape, duration_s)
    assert isinstance(shape, OnOff)  # sessions have their own (_sessions)
    out: list[int] = []
    t = 0.0
    burst = False
    # Start at a random point of a quiet spell, not at its beginning: a
    # short trace then has its first burst ~100 s in, not 100-300 s in.
    first = rng.uniform(0, rng.uniform(*shape.quiet_s))
    while t < duration_s:
        spell = first if t == 0 else rng.uniform(*(shape.burst_s if burst else shape.quiet_s))
        end = min(duration_s, t + spell)
        rate = shape.base_rps * (shape.factor if burst else 1.0)
        t += rng.expovariate(rate)
        while t < end:
            out.append(round(t * NS_PER_S / _TICK_NS) * _TICK_NS)
            t += rng.expovariate(rate)
        t = end  # memoryless: the next spell starts its own Poisson clock
        burst = not burst
    return out


def _sessions(
    rng: random.Random, shape: Shape, duration_s: float, block_tokens: int
) -> list[TraceRequest]:
    """chat-sessions' requests, times in ns from the first conversation's
    start, prompts without their system prompt (:func:`bind_system_prompts`)."""
    cfg = shape.arrivals
    assert isinstance(cfg, Sessions)
    ids = itertools.count(1)  # conversation block ids; system prompts live above 2**62
    out: list[tuple[int, int, int, int, tuple[int, ...]]] = []  # t, session, prompt, output, ids
    t, session = rng.expovariate(cfg.sessions_per_s), 0
    mu = math.log(cfg.think_s[0])
    while t < duration_s:
        full: list[int] = []  # ids of the conversation's whole blocks so far
        length, at, turn = CONTEXT(rng), t, 0
        while at < duration_s and turn < cfg.max_turns:
            length += shape.prompt(rng)
            if length + cfg.system_tokens[1] > cfg.max_prompt:
                break
            whole, part = divmod(length, block_tokens)
            full += [next(ids) for _ in range(whole - len(full))]
            # A partial last block is this prompt's own: more text follows it next turn.
            blocks = (*full, next(ids)) if part else tuple(full)
            output = shape.output(rng)
            at_ns = round(at * NS_PER_S / _TICK_NS) * _TICK_NS
            out.append((at_ns, session, length, output, blocks))
            length += output  # the answer is part of the next turn's prompt
            turn += 1
            if rng.random() >= cfg.more_turns:
                break
            at += min(300.0, rng.lognormvariate(mu, cfg.think_s[1]))
        session += 1
        t += rng.expovariate(cfg.sessions_per_s)
    out.sort(key=lambda x: (x[0], x[1]))
    t0 = out[0][0] if out else 0
    return [
        TraceRequest(at - t0, prompt, output, "", row, blocks, sess)
        for row, (at, sess, prompt, output, blocks) in enumerate(out)
    ]


_SYSTEM_ID_BASE = 1 << 62  # system prompt ids: apart from any conversation's


def system_prompt_tokens(name: str, seed: int, tenant: str, block_tokens: int) -> int:
    """The tenant's system prompt length in ``name``'s trace (whole blocks)."""
    shape = SHAPES[name].arrivals
    assert isinstance(shape, Sessions)
    lo, hi = shape.system_tokens
    tokens = random.Random(f"{name}:{seed}:system:{tenant}").randint(lo, hi)
    return max(1, round(tokens / block_tokens)) * block_tokens


def bind_system_prompts(
    name: str, seed: int, trace: Sequence[TraceRequest], block_tokens: int
) -> list[TraceRequest]:
    """Put each tenant's system prompt in front of its requests (tenants
    assigned): its tokens, and block ids of its own shared by every request
    of the tenant (``shared_blocks``: what a burst's copy keeps)."""
    if not is_sessions(name):
        return list(trace)
    prompts: dict[str, tuple[int, tuple[int, ...]]] = {}
    out = []
    for r in trace:
        got = prompts.get(r.tenant)
        if got is None:
            tokens = system_prompt_tokens(name, seed, r.tenant, block_tokens)
            digest = hashlib.blake2b(f"{name}:{seed}:{r.tenant}".encode(), digest_size=6).digest()
            base = _SYSTEM_ID_BASE + (int.from_bytes(digest, "big") << 10)
            got = prompts[r.tenant] = (tokens, tuple(range(base, base + tokens // block_tokens)))
        tokens, ids = got
        out.append(
            replace(r, prompt_tokens=tokens + r.prompt_tokens, blocks=ids + r.blocks,
                    shared_blocks=len(ids))
        )  # fmt: skip
    return out


def is_sessions(name: str) -> bool:
    shape = SHAPES.get(name)
    return shape is not None and isinstance(shape.arrivals, Sessions)


def generate(
    name: str,
    *,
    seed: int = 0,
    duration_s: float | None = None,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
) -> list[TraceRequest]:
    """The synthetic trace ``name``: deterministic for (name, seed, duration)
    (and ``block_tokens``, the size of chat-sessions' block ids)."""
    shape = SHAPES.get(name)
    if shape is None:
        raise ValueError(f"TRACE: unknown synthetic trace {name!r}; known: {', '.join(SHAPES)}")
    duration = shape.duration_s if duration_s is None else duration_s
    if not (math.isfinite(duration) and duration > 0):
        raise ValueError(f"TRACE: synthetic duration must be > 0 seconds, got {duration!r}")
    rng = random.Random(f"{name}:{seed}")  # a str seed: stable across processes
    if isinstance(shape.arrivals, Sessions):
        if block_tokens < 1:
            raise ValueError(f"--block-tokens: must be >= 1, got {block_tokens}")
        reqs = _sessions(rng, shape, duration, block_tokens)
        if len(reqs) < 2:
            raise ValueError(f"TRACE: {name} over {duration:g} s has fewer than 2 requests")
        return reqs
    times = _arrivals(rng, shape.arrivals, duration)
    if len(times) < 2:
        raise ValueError(f"TRACE: {name} over {duration:g} s has fewer than 2 requests")
    t0 = times[0]
    return [
        TraceRequest(t - t0, shape.prompt(rng), shape.output(rng), "", row)
        for row, t in enumerate(times)
    ]


def parse_spec(text: str) -> tuple[str, int, float | None] | None:
    """``synthetic:NAME[:SEED[:DURATION_S]]`` -> (name, seed, duration);
    None when ``text`` is not a synthetic spec (a file name)."""
    if not text.startswith(PREFIX):
        return None
    parts = text[len(PREFIX) :].split(":")
    if not 1 <= len(parts) <= 3 or not parts[0]:
        raise ValueError(
            f"TRACE: expected synthetic:NAME[:SEED[:DURATION_S]] "
            f"(NAME one of {', '.join(SHAPES)}), got {text!r}"
        )
    try:
        seed = int(parts[1]) if len(parts) > 1 else 0
        duration = float(parts[2]) if len(parts) > 2 else None
    except ValueError:
        raise ValueError(
            f"TRACE: SEED must be an integer and DURATION_S a number, got {text!r}"
        ) from None
    if parts[0] not in SHAPES:
        raise ValueError(f"TRACE: unknown synthetic trace {parts[0]!r}; known: {', '.join(SHAPES)}")
    return parts[0], seed, duration


@dataclass(frozen=True, slots=True)
class Burstiness:
    """Per-second arrival counts from the first arrival (the convention of
    ``burstgate analyze``): their coefficient of variation and peak/mean."""

    seconds: int
    mean_rps: float
    cv: float
    peak_to_mean: float


def per_second_stats(trace: Sequence[TraceRequest]) -> Burstiness:
    if not trace:
        raise ValueError("per_second_stats: empty trace")
    t0 = min(r.t_ns for r in trace)
    bins = np.fromiter(((r.t_ns - t0) // NS_PER_S for r in trace), dtype=np.int64)
    s = series_stats(np.bincount(bins).astype(np.float64))
    assert s is not None and s.cv is not None and s.peak_to_mean is not None  # n >= 1
    return Burstiness(s.seconds, s.mean, s.cv, s.peak_to_mean)


def write_azure_csv(trace: Sequence[TraceRequest], path: Path) -> None:
    """The trace in the Azure LLM inference trace layout
    (``TIMESTAMP,ContextTokens,GeneratedTokens``), times to 100 ns."""
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for r in sorted(trace, key=lambda r: (r.t_ns, r.row)):
        whole, frac = divmod(r.t_ns, NS_PER_S)
        stamp = (_EPOCH + timedelta(seconds=whole)).strftime("%Y-%m-%d %H:%M:%S")
        lines.append(f"{stamp}.{frac // _TICK_NS:07d},{r.prompt_tokens},{r.output_tokens}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
