"""How fast a pool takes new work and how soon a released request gets its
first token, learned from what the plane sees; nothing about the engines'
speed is configured or assumed.

Two different speeds, measured from two different signals:

- **The pace** (``rate``): the prompt tokens the pool gate releases per
  second while a backlog waits for the pool. When burstgate holds a
  backlog, the gate releases a request only when the engines have room
  for it, so the releases *are* the rate at which the engines take new
  work under their current load (prefill, decodes, sequence slots and the
  KV cache together). It says how long a request waits in burstgate behind
  ``tokens`` of held work: ``tokens / rate``.
- **Time to first token after release** (``ttft_ns``): what a sidecar
  measured (CompleteRequest.first_token_unix_ns) for the pool's recent
  requests, fitted as ``a + b x prompt`` by least squares with exponential
  forgetting: ``b`` is the time an engine takes per prompt token under its
  current load (a request is prefilled on one engine), ``a`` the rest
  (the step in progress, the release's trip). The pace is no substitute:
  a pool limited by its decodes or its KV cache takes new work far slower
  than it prefills it, so predictions from the pace would refuse requests
  that would have met their SLO. Without measured first tokens there is no
  prediction: the latest release falls back to a share of the lanes' SLOs
  (``gate_release_headroom``), and the gate's bound on a step's prefill to
  the pace (a lower bound on the prefill rate, PoolGate._step_tokens).
"""

from __future__ import annotations

from collections import deque

from controlplane.domain.units import NS_PER_S

# Releases remembered to measure the pace: enough to average over a few
# report intervals of a busy pool, few enough to follow a change of load.
PACE_WINDOW = 128
# Measured first tokens count with weights that shrink by 1 - 1/TTFT_MEMORY
# per newer sample (halved after ~140): the fit follows a change of load
# within a few hundred requests.
TTFT_MEMORY = 200
# Samples before the fit is trusted: a line needs a spread of prompt sizes.
TTFT_MIN_SAMPLES = 20


class PoolPace:
    __slots__ = (
        "_broken",
        "_fitted",
        "_last",
        "_n",
        "_released",
        "_s1",
        "_span",
        "_sx",
        "_sxx",
        "_sxy",
        "_sy",
        "_tokens",
    )

    def __init__(self) -> None:
        # (time since the previous paced release, its prompt tokens) for
        # releases the gate paced: made from the backlog after the gate had
        # held them. A release after the backlog emptied starts a new
        # stretch: the idle time between stretches is not the pool's pace.
        self._released: deque[tuple[int, int]] = deque(maxlen=PACE_WINDOW)
        self._span = 0  # sums over the window's entries that continue a stretch
        self._tokens = 0
        self._broken = True  # the next paced release starts a stretch
        self._last = 0
        # exponentially weighted sums of (prompt x, first-token time y in s)
        self._n = 0
        self._s1 = self._sx = self._sy = self._sxx = self._sxy = 0.0
        self._fitted: tuple[float, float] | None = None  # fit(), kept until a sample

    # ----------------------------------------------------------- the pace

    def paced(self, now: int, prompt: int) -> None:
        """A held request of ``prompt`` tokens was released at ``now``."""
        released = self._released
        if len(released) == released.maxlen:
            gap, tokens = released[0]
            self._span -= gap
            self._tokens -= tokens
        prompt = max(1, prompt)
        if self._broken:
            released.append((0, 0))  # a stretch starts: nothing measured yet
            self._broken = False
        else:
            gap = max(0, now - self._last)
            released.append((gap, prompt))
            self._span += gap
            self._tokens += prompt
        self._last = now

    def idle(self) -> None:
        """The pool's backlog emptied: the next paced release starts anew."""
        self._broken = True

    def rate(self) -> float | None:
        """Prompt tokens per second the pool took while it had a backlog
        (None until two paced releases in one stretch were seen, at
        different times)."""
        if self._span <= 0 or self._tokens <= 0:
            return None
        return self._tokens * NS_PER_S / self._span

    def wait_ns(self, tokens: int) -> int | None:
        """Time to release ``tokens`` of held work ahead of a request."""
        rate = self.rate()
        return None if rate is None else int(tokens * NS_PER_S / rate)

    # ------------------------------------------------- first tokens

    def observe_ttft(self, prompt: int, measured_ns: int) -> None:
        """A released request of ``prompt`` tokens got its first token
        ``measured_ns`` after its release (as its sidecar measured)."""
        if measured_ns <= 0 or prompt < 0:
            return
        keep = 1.0 - 1.0 / TTFT_MEMORY
        x, y = float(prompt), measured_ns / NS_PER_S
        self._s1 = self._s1 * keep + 1.0
        self._sx = self._sx * keep + x
        self._sy = self._sy * keep + y
        self._sxx = self._sxx * keep + x * x
        self._sxy = self._sxy * keep + x * y
        self._n += 1
        self._fitted = self._solve()

    @property
    def ttft_samples(self) -> int:
        """First tokens measured so far."""
        return self._n

    def fit(self) -> tuple[float, float] | None:
        """(a seconds, b seconds per prompt token), or None before enough
        samples with a spread of prompt sizes (solved once per sample: every
        decision asks)."""
        return self._fitted

    def _solve(self) -> tuple[float, float] | None:
        if self._n < TTFT_MIN_SAMPLES:
            return None
        s1, sx, sy = self._s1, self._sx, self._sy
        var = s1 * self._sxx - sx * sx
        if var <= 1e-9 * s1 * self._sxx:  # (nearly) one prompt size: a mean only
            return sy / s1, 0.0
        b = (s1 * self._sxy - sx * sy) / var
        b = max(b, 0.0)  # noise can tilt the line; longer prompts never go faster
        a = max((sy - b * sx) / s1, 0.0)
        return a, b

    def ttft_ns(self, prompt: int) -> int | None:
        """Predicted time from release to first token for a request of
        ``prompt`` tokens (None without enough measured first tokens)."""
        fit = self.fit()
        if fit is None:
            return None
        a, b = fit
        return int((a + b * prompt) * NS_PER_S)
