"""A pool of modelled engines behind a router, growing and shrinking as an
autoscaler asks (the engines themselves: ``engine.py``)."""

from __future__ import annotations

from controlplane.domain.units import NS_PER_S
from controlplane.sim.engine import Engine, EngineParams


class Pool:
    """Identical engines behind a least-outstanding-tokens router.

    The pool may grow and shrink while a run goes on (an autoscaler in the
    loop, sim/scaling.py): an engine ``start``ed now is provisioned (it
    costs engine-seconds) but serves nothing until it is made ``ready`` an
    engine start-up later; a ``drain``ed engine takes no new work, finishes
    what it holds and is ``retire``d once idle (a Kubernetes pod's graceful
    termination). ``engines`` are the engines serving (ready or draining),
    ``starting`` those not up yet; ``engine_ns`` integrates how many are
    provisioned (starting, serving, draining) over time."""

    def __init__(
        self, n_engines: int, params: EngineParams, prefix_unit_tokens: int | None = None
    ) -> None:
        if n_engines < 1:
            raise ValueError(f"engines: must be >= 1, got {n_engines}")
        self.params = params
        self.prefix_unit_tokens = prefix_unit_tokens  # each engine's prefix cache (None: none)
        self.engines = [Engine(i, params, prefix_unit_tokens) for i in range(n_engines)]
        self.by_id = {e.engine_id: e for e in self.engines}
        self.starting: list[Engine] = []
        self.draining: set[int] = set()  # engine ids
        self.retired: list[Engine] = []
        self.engines_max = n_engines
        self._changed_ns = 0
        self._engine_ns = 0

    # ------------------------------------------------------------- routing

    def route(self) -> Engine:
        """The ready engine with the fewest outstanding tokens (lowest id on ties)."""
        return min(
            (e for e in self.engines if e.engine_id not in self.draining),
            key=lambda e: (e.outstanding_tokens, e.engine_id),
        )

    # ------------------------------------------------------------- scaling

    @property
    def provisioned(self) -> int:
        return len(self.engines) + len(self.starting)

    @property
    def replicas(self) -> int:
        """Engines counted as the Deployment's replicas: starting or ready,
        not draining (a terminating pod is no longer a replica)."""
        return self.provisioned - len(self.draining)

    def _account(self, now_ns: int) -> None:
        self._engine_ns += self.provisioned * (now_ns - self._changed_ns)
        self._changed_ns = now_ns

    def engine_seconds(self, until_ns: int) -> float:
        """Engine-seconds provisioned from 0 to ``until_ns``."""
        return (self._engine_ns + self.provisioned * (until_ns - self._changed_ns)) / NS_PER_S

    def start(self, now_ns: int) -> Engine:
        """Provision a new engine; it serves once :meth:`ready` is called."""
        self._account(now_ns)
        engine = Engine(max(self.by_id) + 1, self.params, self.prefix_unit_tokens)
        self.by_id[engine.engine_id] = engine
        self.starting.append(engine)
        self.engines_max = max(self.engines_max, self.provisioned)
        return engine

    def ready(self, engine: Engine) -> bool:
        """A started engine is up; False if it was cancelled meanwhile."""
        if engine not in self.starting:
            return False
        self.starting.remove(engine)
        self.engines.append(engine)
        return True

    def stop_one(self, now_ns: int) -> Engine | None:
        """Take one replica away: the newest engine still starting (it has
        cost start-up time only), else the serving engine with the least
        outstanding work is drained. Returns the engine drained (to be
        retired once idle), or None when a starting one was cancelled or
        no replica can go (one ready engine is always kept)."""
        self._account(now_ns)
        if self.starting:
            self.starting.pop()
            return None
        ready = [e for e in self.engines if e.engine_id not in self.draining]
        if len(ready) <= 1:
            return None
        victim = min(ready, key=lambda e: (e.outstanding_tokens, -e.engine_id))
        self.draining.add(victim.engine_id)
        return victim

    def retire_idle(self, now_ns: int) -> None:
        """Retire every draining engine that has finished its work."""
        for engine in [e for e in self.engines if e.engine_id in self.draining]:
            if not engine.busy and not engine.stepping:
                self._account(now_ns)
                self.engines.remove(engine)
                self.draining.discard(engine.engine_id)
                self.retired.append(engine)

    @property
    def all_engines(self) -> list[Engine]:
        """Every engine that ever served (for counters such as preemptions)."""
        return [*self.engines, *self.retired]
