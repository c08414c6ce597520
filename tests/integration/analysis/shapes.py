"""Small synthetic logs in the shapes of well-known request logs (no public data)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from controlplane.domain.ledger_records import iso_ns
from controlplane.ledger.export import REQUEST_COLUMNS, _Parquet, _Text
from tests.integration.analysis.synth import poisson_arrivals

NS_PER_S = 1_000_000_000
# 2026-11-29T12:00:00Z in ns: the ledger's clock.
LEDGER_T0_NS = 1_795_953_600 * NS_PER_S


def mooncake_offsets_ms(rate: float, seconds: int, seed: int = 5) -> npt.NDArray[np.int64]:
    """Poisson arrivals at ``rate``/s for ``seconds``, as integer ms from the start."""
    offsets = poisson_arrivals(np.random.default_rng(seed), np.full(seconds, rate))
    return np.floor(offsets * 1000).astype(np.int64)


def write_mooncake(
    path: Path, ts_ms: Sequence[int], prompt: Sequence[int], output: Sequence[int]
) -> Path:
    """Mooncake FAST'25 lines: timestamp (ms from start), lengths, KV block hashes."""
    with path.open("w", encoding="utf-8") as handle:
        for t, p, o in zip(ts_ms, prompt, output, strict=True):
            blocks = list(range(int(p) // 512 + 1))
            row = {"timestamp": int(t), "input_length": int(p), "output_length": int(o)}
            handle.write(json.dumps({**row, "hash_ids": blocks}) + "\n")
    return path


def openai_response(created: int, prompt: int, completion: int, **extra: Any) -> dict[str, Any]:
    """A completion response as vLLM's OpenAI-compatible server returns it."""
    return {
        "id": f"cmpl-{created}-{prompt}",
        "object": "text_completion",
        "created": created,
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "choices": [{"index": 0, "text": "", "finish_reason": "length"}],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        },
        **extra,
    }


def batch_line(response: dict[str, Any], n: int) -> dict[str, Any]:
    """An OpenAI Batch API output line wrapping ``response``."""
    return {
        "id": f"batch_req_{n}",
        "custom_id": f"request-{n}",
        "response": {"status_code": 200, "request_id": f"req_{n}", "body": response},
        "error": None,
    }


def ledger_rows(count: int, seed: int = 3) -> list[list[Any]]:
    """Rows in REQUEST_COLUMNS order, as controlplane.ledger.export writes them."""
    rng = np.random.default_rng(seed)
    rows: list[list[Any]] = []
    arrival = LEDGER_T0_NS
    for i in range(count):
        arrival += int(rng.integers(50_000_000, 400_000_000)) + 123  # sub-µs digits too
        queued = arrival + 1_000_000
        started = queued + int(rng.integers(0, 300)) * 1_000_000
        ended = started + int(rng.integers(200, 3_000)) * 1_000_000
        values: dict[str, Any] = {
            "tenant_id": ("acme", "globex", "initech")[i % 3],
            "request_id": f"r{i}",
            "lane": ("interactive", "batch")[i % 2],
            "model": "m",
            "pool": "p",
            "arrival_ts": iso_ns(arrival),
            "queue_start_ts": iso_ns(queued),
            "exec_start_ts": iso_ns(started),
            "end_ts": iso_ns(ended),
            "prompt_tokens": int(rng.integers(10, 4000)),
            "cached_tokens": 0,
            "output_tokens": int(rng.integers(1, 500)),
            "decision": "admit",
            "settled_ts": iso_ns(ended + 5_000_000),
            "reservation_id": i + 1,
            "reserved_tokens": 5000,
            "kv_cache_miss_rate": "0.100000",
            "miss_rate_source": "reported",
            "pricing_multiplier": "1.000000",
            "pricing_window_start": "",
            "lane_multiplier": "1.000000",
            "currency": "USD",
            "user_charge": "0.000001000",
            "actual_cost": "0.000000500",
            "price_id": 1,
            "correlation_id": "",
        }
        rows.append([values[c] for c in REQUEST_COLUMNS])
    return rows


def write_ledger_export(path: Path, fmt: str, rows: list[list[Any]]) -> Path:
    """The file ``burstgate export --format FMT`` writes for these rows."""
    writer: _Text | _Parquet = (
        _Parquet(REQUEST_COLUMNS, "request") if fmt == "parquet" else _Text(fmt, REQUEST_COLUMNS)
    )
    for row in rows:
        writer.add(writer.prepare(row))
    path.write_bytes(writer.take(final=True))
    return path
