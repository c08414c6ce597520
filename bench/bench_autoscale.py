"""Issue 32's acceptance, on demand: autoscalers in ``burstgate simulate``'s
loop on traffic that swings over minutes, seed by seed.

    .venv/bin/python bench/bench_autoscale.py                    # seeds 0-2, 6 h each
    .venv/bin/python bench/bench_autoscale.py --duration 10800   # the 3 h default trace

For each seed of ``synthetic:diurnal`` it runs burstgate with the fixed pool
(``off``: ``--engines`` engines, provisioned for the peak) and with each
autoscaler (``reactive`` on desired_engines, ``predictive`` on its forecast
too, ``queue-length``: the usual recipe on the engines' own queues), all on
the same arrivals, and prints one Markdown row per (seed, mode): premium /
standard / batch SLO attainment, engine-seconds and their share of off's,
the most engines, and for ``predictive`` its forecast alarms. Then the
issue's two checks per seed:

- predictive keeps premium within 1 point of off with at most 70 % of its
  engine-seconds;
- reactive on desired_engines beats the queue-length recipe on premium.

Seeds run in parallel processes (``--jobs``, default: the CPUs). The
defaults are the figures in BENCHMARKS.md: the day over 6 hours, 5 engines
(the peak minute at the 0.8 target utilisation on this mix), load 0.32 of
them, start-up 120 s, the recipes' 300 s scale-down window.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODES = ("off", "reactive", "predictive", "queue-length")


@dataclass(frozen=True)
class Row:
    seed: int
    mode: str
    slo: tuple[float, float, float]  # premium, standard, batch (%)
    engine_seconds: float
    engines_max: int
    scaling: dict[str, object]


def run_seed(seed: int, args: argparse.Namespace) -> list[Row]:
    from controlplane.sim.run import SimSpec
    from controlplane.sim.run import simulate as run_simulation

    spec = SimSpec(
        trace=f"synthetic:diurnal:{seed}:{args.duration:g}",
        policies=("burstgate",),
        loads=(args.load,),
        engines=args.engines,
        autoscale=MODES,
        min_engines=args.min_engines,
        engine_startup_s=args.startup,
        scale_down_delay_s=args.scale_down_delay,
        seed=seed,
    )
    rows = []
    for r in run_simulation(spec):
        slo = tuple(100 * r.lanes[lane].attainment for lane in ("premium", "standard", "batch"))
        rows.append(Row(seed, r.autoscale, slo, r.engine_seconds, r.engines_max, r.scaling))  # type: ignore[arg-type]
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds of synthetic:diurnal")
    ap.add_argument("--duration", type=float, default=21_600.0, help="trace seconds (before load)")
    ap.add_argument("--engines", type=int, default=5, help="off's pool, the autoscalers' maximum")
    ap.add_argument("--min-engines", type=int, default=1)
    ap.add_argument("--load", type=float, default=0.32)
    ap.add_argument("--startup", type=float, default=120.0, help="engine start-up, seconds")
    ap.add_argument("--scale-down-delay", type=float, default=300.0)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    if not seeds:
        ap.error("--seeds: give at least one")
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=max(1, min(args.jobs, len(seeds)))) as pool:
        results = list(pool.map(run_seed, seeds, [args] * len(seeds)))
    wall = time.perf_counter() - t0
    print(
        f"synthetic:diurnal, {args.duration:g} s per seed, {args.engines} engines at "
        f"{args.load:g}x (off; the autoscalers' maximum), min {args.min_engines}, start-up "
        f"{args.startup:g} s, scale-down window {args.scale_down_delay:g} s; {wall:.0f} s wall\n"
    )
    print("| seed | autoscale | SLO met % (premium / standard / batch) | engine-seconds | "
          "vs off | engines max | forecast alarms (false) | lead time p50 s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    checks = []
    for rows in results:
        by = {r.mode: r for r in rows}
        off = by["off"]
        for r in rows:
            sc = r.scaling
            alarms = "-"
            if r.mode == "predictive":
                alarms = f"{sc.get('alarms', 0)} ({sc.get('false_alarms', 0)})"
                if sc.get("fell_back_at_s") is not None:
                    alarms += f", fell back at {sc['fell_back_at_s']:,.0f} s"
            lead = sc.get("lead_time_median_s")
            print(
                f"| {r.seed} | {r.mode} | {' / '.join(f'{x:.1f}' for x in r.slo)} | "
                f"{r.engine_seconds:,.0f} | {r.engine_seconds / off.engine_seconds:.0%} | "
                f"{r.engines_max} | {alarms} | {'-' if lead is None else f'{lead:.0f}'} |"
            )
        pred, react, queue = by["predictive"], by["reactive"], by["queue-length"]
        share = pred.engine_seconds / off.engine_seconds
        gap = off.slo[0] - pred.slo[0]
        checks.append(
            f"seed {off.seed}: predictive premium {pred.slo[0]:.1f} vs off {off.slo[0]:.1f} "
            f"({'within' if gap <= 1.0 else 'NOT within'} 1 point), engine-seconds {share:.0%} "
            f"of off ({'<=' if share <= 0.70 else 'NOT <='} 70 %); reactive premium "
            f"{react.slo[0]:.1f} {'>' if react.slo[0] > queue.slo[0] else 'NOT >'} "
            f"queue-length {queue.slo[0]:.1f}"
        )
    print("\nChecks (issue 32, done when):\n")
    for line in checks:
        print(f"- {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
