"""Synthetic request logs with known shape, for the analysis tests."""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

# 2023-11-16T18:00:00Z: any fixed epoch works; this one is near the Azure trace.
T0_US = 1_700_157_600_000_000
AZURE_HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
LEDGER_HEADER = (
    "tenant_id",
    "request_id",
    "lane",
    "model",
    "pool",
    "arrival_ts",
    "queue_start_ts",
    "exec_start_ts",
    "end_ts",
    "prompt_tokens",
    "cached_tokens",
    "output_tokens",
    "decision",
)


def iso(ts_us: int, *, zone: bool = False) -> str:
    """ISO 8601 like the Azure trace (naive, 7 digits) or UTC with Z."""
    moment = datetime(1970, 1, 1) + timedelta(microseconds=ts_us)
    if zone:
        return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return moment.strftime("%Y-%m-%d %H:%M:%S.%f") + "0"


def write_csv(path: Path, header: Sequence[str], rows: Iterable[Sequence[Any]]) -> Path:
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> Path:
    with path.open("w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
    return path


def azure_rows(
    offsets_s: Sequence[float], prompt: Sequence[int], output: Sequence[int]
) -> list[tuple[str, int, int]]:
    return [
        (iso(T0_US + round(o * 1_000_000)), p, g)
        for o, p, g in zip(offsets_s, prompt, output, strict=True)
    ]


def poisson_arrivals(
    rng: np.random.Generator, rates: npt.NDArray[np.float64]
) -> npt.NDArray[np.float64]:
    """Sorted arrival offsets (s): Poisson counts per second, uniform within it."""
    counts = rng.poisson(rates)
    seconds = np.repeat(np.arange(rates.size, dtype=np.float64), counts)
    return np.sort(seconds + rng.random(seconds.size))


def burst_rates(
    seconds: int, base: float, bursts: Sequence[tuple[int, int, float]]
) -> npt.NDArray[np.float64]:
    """Constant ``base`` rate with (start, end, rate) plateaus on top."""
    rates = np.full(seconds, base)
    for start, end, rate in bursts:
        rates[start:end] = rate
    return rates
