"""The rows of BENCHMARKS.md's targets table, as each benchmark measures them.

A benchmark that measures a target calls :func:`record` once per row, with
the figure it measured and the baseline it measured *in the same run* (the
empty handler, Redis + Lua, the engine without the sidecar, ...). When the
environment variable ``BURSTGATE_BENCH_SUMMARY`` names a file (the
regeneration command, ``make bench``, sets it), each row is appended to it
as one JSON line; otherwise :func:`record` does nothing, so a benchmark run
by hand prints its own report and writes nothing else.

Rows are compared only within one run: ``ratio`` is ours over the baseline
of the same run (never a figure from another day).
"""

from __future__ import annotations

import json
import os
from typing import Any

ENV = "BURSTGATE_BENCH_SUMMARY"


def record(
    *,
    what: str,
    ours: float,
    unit: str,
    target: str,
    met: bool | None,
    baseline: float | None = None,
    baseline_name: str = "",
    ratio: float | None = None,
    note: str = "",
    bench: str = "",
) -> None:
    """One row of the targets table.

    ``what``: the row's name ("AdmitStream, batch 100"); ``ours`` and
    ``unit``: our figure ("decisions/s", "µs CPU/request"); ``baseline`` and
    ``baseline_name``: the reference measured in the same run; ``ratio``:
    ours / baseline unless given (a row may state its own, e.g. a CPU ratio
    per call); ``target``: the target as text ("≥ 0.8x empty"); ``met``:
    whether this run met it (None: no target, reported only); ``note``: a
    few words the reader needs (a profile's conclusion for a missed one);
    ``bench``: the command that measured it.
    """
    path = os.environ.get(ENV)
    if not path:
        return
    if ratio is None and baseline:
        ratio = ours / baseline
    row: dict[str, Any] = {
        "what": what, "ours": ours, "unit": unit, "baseline": baseline,
        "baseline_name": baseline_name, "ratio": ratio, "target": target, "met": met,
        "note": note, "bench": bench,
    }  # fmt: skip
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row, ensure_ascii=False) + "\n")
