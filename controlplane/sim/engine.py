"""A discrete-event model of a vLLM-like inference engine, and a pool of them.

What it models, in vLLM's terms (V1 scheduler, simplified):

- **Continuous batching with chunked prefill.** Each iteration ("step") has
  a budget of ``max_num_batched_tokens``. Running requests are served
  first, in the order they started: a decoding request takes one token, a
  request still in prefill takes the next chunk of its prompt. Then waiting
  requests start, **first come first served**, while fewer than
  ``max_num_seqs`` run and budget is left (the head of the queue may start
  with a partial chunk). The waiting queue is unbounded: whatever is sent
  to the engine waits there, in arrival order.
- **A KV cache in blocks** of ``block_size`` tokens, ``kv_capacity_tokens``
  in all. A request holds blocks for every token it has computed. When a
  running request needs a block and none is free, the most recently started
  request is **preempted**: its blocks are freed and it goes back to the
  front of the waiting queue, to be **recomputed** from scratch (prompt and
  the tokens generated so far), as vLLM does by default.
- **Step time** = ``step_base_us`` (reading the weights, scheduling)
  + ``prefill_token_us`` x prompt tokens computed in the step (prefill
  chunks, and recomputation after a preemption)
  + ``decode_token_us`` x tokens decoded in the step (one per decoding
  request)
  + ``prefill_attention_us_per_pair`` x (query, key) pairs of the prefill
  chunks' causal attention (what makes a long prompt cost more than its
  length: a chunk of n tokens after c cached ones attends over
  n*c + n*(n+1)/2 pairs)
  + ``attention_us_per_kv_token`` x KV tokens the step's requests attend
  over (reading the KV cache). A request's first token is produced at the
  end of the step that completes its prefill; then one token per step.
  Prefill and decode tokens are priced apart because public vLLM figures
  price them apart (and so a sensitivity run can slow prefill alone).

- **A prefix cache** (optional, ``prefix_unit_tokens``): requests that
  carry block ids (a trace's ``hash_ids``) start with the leading run of
  their blocks found in the engine's cache already computed, so their
  prefill costs only the missed tokens; cached blocks live in the free part
  of the KV cache and are evicted when running requests need the memory
  (``prefixcache.py`` says how faithfully). Without block ids, or without
  the cache, nothing changes.

It is deterministic: no randomness, integer nanoseconds. The named
calibrations (``h100-8b`` the default, ``h100-8b-peak``, ``h100x4-70b``)
are in ``profiles.py`` with their public sources; docs/simulate.md derives
them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import yaml

from controlplane.domain.units import NS_PER_S
from controlplane.sim.prefixcache import PrefixCache

NS_PER_US = NS_PER_S // 1_000_000
DEFAULT_PARAMS_FILE = Path(__file__).with_name("engine.yaml")


# Costs that may be zero: a profile without a term (h100-8b-peak has no
# prefill attention term, as the model had none before it was split).
_MAY_BE_ZERO = frozenset({"prefill_attention_us_per_pair"})
# The old single per-token cost, still read from --engine-config files:
# it sets the prefill and the decode cost alike.
LEGACY_PER_TOKEN = "per_token_us"


@dataclass(frozen=True, slots=True)
class EngineParams:
    """One engine's parameters. The defaults are the ``h100-8b`` profile
    (controlplane/sim/profiles.py has each figure's source)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    kv_capacity_tokens: int = 400_000
    block_size: int = 16
    step_base_us: float = 6_000.0
    prefill_token_us: float = 39.0
    decode_token_us: float = 22.0
    prefill_attention_us_per_pair: float = 0.0013
    attention_us_per_kv_token: float = 0.039

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            ok = value >= 0 if f.name in _MAY_BE_ZERO else value > 0
            if not ok:
                bound = ">= 0" if f.name in _MAY_BE_ZERO else "> 0"
                raise ValueError(f"engine.{f.name}: must be {bound}, got {value!r}")
        if self.kv_capacity_tokens < self.block_size:
            raise ValueError("engine.kv_capacity_tokens: smaller than one block")

    @property
    def kv_blocks(self) -> int:
        return self.kv_capacity_tokens // self.block_size

    def with_prefill_slowdown(self, factor: float) -> EngineParams:
        """The same engine with prefill ``factor`` times as costly (the
        per-token matmuls and the causal attention of prompts); decode, the
        step's fixed cost and KV reads unchanged."""
        if not factor > 0:
            raise ValueError(f"prefill slowdown: must be > 0, got {factor!r}")
        return replace(
            self,
            prefill_token_us=self.prefill_token_us * factor,
            prefill_attention_us_per_pair=self.prefill_attention_us_per_pair * factor,
        )

    @classmethod
    def from_mapping(cls, values: dict[str, Any]) -> EngineParams:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known - {LEGACY_PER_TOKEN})
        if unknown:
            raise ValueError(f"engine: unknown parameter(s) {unknown}; known: {sorted(known)}")
        values = dict(values)
        if LEGACY_PER_TOKEN in values:
            split = {"prefill_token_us", "decode_token_us"} & set(values)
            if split:
                raise ValueError(
                    f"engine.{LEGACY_PER_TOKEN}: give it or {sorted(split)}, not both "
                    f"({LEGACY_PER_TOKEN} sets the prefill and decode cost alike)"
                )
            per_token = values.pop(LEGACY_PER_TOKEN)
            values |= {"prefill_token_us": per_token, "decode_token_us": per_token}
            values.setdefault("prefill_attention_us_per_pair", 0.0)  # the old model had none
        return cls(**values)

    @classmethod
    def load(cls, path: str | Path = DEFAULT_PARAMS_FILE) -> EngineParams:
        """Parameters from a YAML file's ``engine:`` mapping."""
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict) or not isinstance(data.get("engine"), dict):
            raise ValueError(f"{path}: expected a mapping with an 'engine:' section")
        return cls.from_mapping(data["engine"])


class SimRequest:
    """One request inside the model. Times are ns on the simulation clock;
    -1 = not yet."""

    __slots__ = (
        "arrival_ns",
        "block_ids",
        "blocks",
        "cached_tokens",
        "computed",
        "done_ns",
        "engine",
        "first_token_ns",
        "generated",
        "held",
        "key",
        "output",
        "preemptions",
        "prefill_computed",
        "prompt",
        "registered",
        "released_ns",
        "started_ns",
    )

    def __init__(
        self,
        key: Any,
        prompt: int,
        output: int,
        arrival_ns: int,
        block_ids: tuple[int, ...] = (),
    ) -> None:
        self.key = key  # the harness's identity of the request
        self.prompt = prompt
        self.output = max(1, output)  # an LLM answers with at least one token
        self.arrival_ns = arrival_ns  # reached the front door (the admission policy)
        self.released_ns = -1  # sent to an engine
        self.started_ns = -1  # first scheduled by the engine (left its waiting queue)
        self.first_token_ns = -1
        self.done_ns = -1
        self.engine = -1
        self.computed = 0  # tokens whose KV is in the cache
        self.generated = 0  # output tokens produced
        self.blocks = 0
        self.preemptions = 0
        # The prefix cache's: the prompt's block ids (a trace's hash_ids),
        # the cached units this request references, how many of its ids
        # were looked at for caching, and what its first lookup found.
        self.block_ids = block_ids
        self.held: list[int] = []
        self.registered = 0
        self.cached_tokens = -1  # prompt tokens found cached when it first started
        self.prefill_computed = 0  # prompt (and recomputed) tokens the engine computed

    @property
    def known_tokens(self) -> int:
        return self.prompt + self.generated


@dataclass(slots=True)
class StepResult:
    end_ns: int
    first_tokens: list[SimRequest]
    finished: list[SimRequest]


class Engine:
    def __init__(
        self, engine_id: int, params: EngineParams, prefix_unit_tokens: int | None = None
    ) -> None:
        """``prefix_unit_tokens``: the tokens per block id of the requests'
        ``block_ids`` to cache prefixes by; None: no prefix cache."""
        self.engine_id = engine_id
        self.p = params
        self.cache: PrefixCache | None = None
        if prefix_unit_tokens is not None:
            self.cache = PrefixCache(prefix_unit_tokens, params.block_size)
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.free_blocks = params.kv_blocks
        self.stepping = False  # a step is in progress
        self.outstanding_tokens = 0  # prompt + output of unfinished requests (the router's measure)
        self.last_batch_tokens = 0
        # counters, in vLLM's metric terms
        self.preemptions = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.steps = 0
        self.finished_total = 0
        self.prefill_us_total = 0.0  # step time spent on prefill (tokens and their attention)
        # The prefix-cache miss rate its sidecar last reported (sim/harness.py).
        self.miss_rate_reported: float | None = None
        self._scheduled: list[tuple[SimRequest, int]] = []

    # ---------------------------------------------------------------- state

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use (vLLM's ``kv_cache_usage_perc``, as 0..1)."""
        total = self.p.kv_blocks
        return (total - self.free_blocks) / total

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def submit(self, req: SimRequest, now_ns: int) -> None:
        if req.prompt + req.output > self.p.kv_capacity_tokens:
            # vLLM refuses a request longer than the model's context; here it
            # would wait at the head of the FIFO forever.
            raise ValueError(
                f"request {req.key!r}: {req.prompt + req.output} tokens exceed the engine's "
                f"KV capacity ({self.p.kv_capacity_tokens})"
            )
        req.engine = self.engine_id
        req.released_ns = now_ns
        self.waiting.append(req)
        self.outstanding_tokens += req.prompt + req.output

    def cancel_waiting(self, req: SimRequest) -> bool:
        """Drop ``req`` if it is still waiting and was never started (its
        client went away before the engine scheduled it). Safe during a
        step: a request that never started holds no KV blocks and is not
        part of the step in flight. False if it had started or is not here."""
        if req.started_ns >= 0 or req.engine != self.engine_id:
            return False
        try:
            self.waiting.remove(req)
        except ValueError:
            return False
        self.outstanding_tokens -= req.prompt + req.output
        return True

    def abort(self, req: SimRequest) -> bool:
        """Drop ``req`` (its client went away), freeing its blocks, as vLLM
        aborts a request. Only between steps (not while ``stepping``); False
        if the request was not waiting or running here."""
        assert not self.stepping
        if req in self.running:
            self.running.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                return False
        self._release(req)
        self.outstanding_tokens -= req.prompt + req.output
        return True

    # ----------------------------------------------------------------- steps

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.p.block_size)

    def _grow(self, req: SimRequest, tokens: int) -> bool:
        """Hold blocks for ``tokens`` computed tokens; False when full."""
        need = self._blocks_for(tokens) - req.blocks
        if need <= 0:
            return True
        if need > self.free_blocks:
            return False
        self.free_blocks -= need
        req.blocks += need
        if self.cache is not None:
            self.cache.evict_to(self.free_blocks)
        return True

    def _release(self, req: SimRequest) -> None:
        """Free ``req``'s blocks; the cached units it held stay cached."""
        freed = req.blocks
        if req.held:
            assert self.cache is not None
            shared = len(req.held) * self.cache.unit_blocks
            freed += self.cache.release(req.held) * self.cache.unit_blocks - shared
            req.held = []
        req.registered = 0
        self.free_blocks += freed
        req.blocks = 0

    def _start_waiting(self, req: SimRequest, budget: int) -> int | None:
        """Tokens the head of the queue computes in this step (its prefix
        hit skipped), or None when the KV cache cannot hold them."""
        c = self.cache
        if c is None or req.computed or not req.block_ids:
            want = min(req.known_tokens - req.computed, budget)
            return want if self._grow(req, req.computed + want) else None
        # Look the prompt up: the leading cached run, all but the last token at most.
        hit, free = c.match(req.block_ids, (req.known_tokens - 1) // c.unit_tokens)
        hit_tokens = hit * c.unit_tokens
        want = min(req.known_tokens - hit_tokens, budget)
        private = self._blocks_for(hit_tokens + want) - hit * c.unit_blocks
        if private + free * c.unit_blocks > self.free_blocks:
            return None
        taken = req.block_ids[:hit]
        c.take(taken)
        self.free_blocks -= free * c.unit_blocks
        req.held = list(taken)
        req.registered = hit
        req.blocks = hit * c.unit_blocks
        req.computed = hit_tokens
        c.queries += req.known_tokens
        c.hits += hit_tokens
        if req.cached_tokens < 0:
            req.cached_tokens = min(hit_tokens, req.prompt)
        grown = self._grow(req, hit_tokens + want)
        assert grown  # checked above
        return want

    def _cache_computed(self, req: SimRequest) -> None:
        """Cache the prompt units ``req`` has now computed in full."""
        c = self.cache
        assert c is not None
        full = min(len(req.block_ids), min(req.computed, req.prompt) // c.unit_tokens)
        for unit in req.block_ids[req.registered : full]:
            if c.register(unit):
                req.held.append(unit)
        req.registered = max(req.registered, full)

    def _preempt(self, req: SimRequest) -> None:
        self.running.remove(req)
        self._release(req)
        req.computed = 0  # recompute: prompt and generated tokens again
        req.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(req)

    def start_step(self, now_ns: int) -> int | None:
        """Schedule one iteration starting at ``now_ns``; return its end time,
        or None when there is nothing to run."""
        assert not self.stepping
        budget = self.p.max_num_batched_tokens
        scheduled: list[tuple[SimRequest, int]] = []
        preempted = False
        # 1. running requests, oldest first
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            want = min(req.known_tokens - req.computed, budget)
            while not self._grow(req, req.computed + want):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                scheduled.append((req, want))
                budget -= want
                i += 1
                continue
            # req itself was preempted: the list shrank under it; i stays
        # 2. waiting requests, first come first served (not in a step that
        # had to preempt: memory is short)
        while (
            not preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.p.max_num_seqs
        ):
            req = self.waiting[0]
            if self.cache is None:  # (the common case, without a call)
                want = min(req.known_tokens - req.computed, budget)
                if not self._grow(req, req.computed + want):
                    break  # head-of-line: the FIFO waits for memory
            else:
                started = self._start_waiting(req, budget)
                if started is None:
                    break
                want = started
            self.waiting.popleft()
            if req.started_ns < 0:
                req.started_ns = now_ns
            self.running.append(req)
            scheduled.append((req, want))
            budget -= want
        if not scheduled:
            return None
        p = self.p
        tokens = prefill = pairs = context = 0
        for r, n in scheduled:
            tokens += n
            context += r.computed + n
            if r.computed < r.prompt:  # prompt (or recomputation) still being filled
                prefill += n
                pairs += n * r.computed + n * (n + 1) // 2
        dur_us = (
            p.step_base_us
            + p.prefill_token_us * prefill
            + p.decode_token_us * (tokens - prefill)
            + p.prefill_attention_us_per_pair * pairs
            + p.attention_us_per_kv_token * context
        )
        self.prefill_us_total += (
            p.prefill_token_us * prefill + p.prefill_attention_us_per_pair * pairs
        )
        self._scheduled = scheduled
        self.stepping = True
        self.last_batch_tokens = tokens
        self.steps += 1
        return now_ns + max(1, int(dur_us * NS_PER_US))

    def finish_step(self, end_ns: int) -> StepResult:
        """Apply the step started by ``start_step``, which ends at ``end_ns``."""
        assert self.stepping
        self.stepping = False
        first: list[SimRequest] = []
        finished: list[SimRequest] = []
        caching = self.cache is not None
        for req, n in self._scheduled:
            req.computed += n
            if caching and req.registered < len(req.block_ids):
                self._cache_computed(req)
            if req.computed < req.known_tokens:
                self.prompt_tokens_total += n
                req.prefill_computed += n
                continue  # a prefill chunk: no token sampled yet
            if req.generated == 0:
                self.prompt_tokens_total += n
                req.prefill_computed += n
            req.generated += 1
            self.generation_tokens_total += 1
            if req.first_token_ns < 0:
                req.first_token_ns = end_ns
                first.append(req)
            if req.generated >= req.output:
                req.done_ns = end_ns
                self.running.remove(req)
                self._release(req)
                self.outstanding_tokens -= req.prompt + req.output
                self.finished_total += 1
                finished.append(req)
        self._scheduled = []
        return StepResult(end_ns, first, finished)
