"""What a read produces: the request columns, bad rows, and how the input was
understood (preset, time decision, check findings). Split from reader.py so
the reader stays about reading."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from controlplane.analysis.presets import Resolution
from controlplane.analysis.timeunits import TimeDecision


class LogReadError(Exception):
    """The log cannot be analysed (missing file, no timestamp column, bad row
    under ``--on-bad-row fail``). The CLI turns it into exit code 2."""


@dataclass(frozen=True, slots=True)
class BadRow:
    line: int  # 1-based physical line number in the file (header is line 1)
    reason: str


@dataclass(frozen=True, slots=True)
class Finding:
    """Something wrong with the input as a whole (checks.py)."""

    code: str  # missing_tokens | implausible_span | zero_gaps | span_too_long | ...
    message: str
    fatal: bool  # refused unless --force
    overridable: bool = True  # False: refused even with --force

    def as_dict(self) -> dict[str, object]:
        return {"code": self.code, "message": self.message, "fatal": self.fatal}


@dataclass(slots=True)
class RequestLog:
    """One request per index across all columns; codes index the name lists."""

    source: str
    fmt: str
    columns: dict[str, str]  # canonical field -> column name found in the file
    ts_us: npt.NDArray[np.int64]
    prompt_tokens: npt.NDArray[np.int64]
    output_tokens: npt.NDArray[np.int64]
    tenant_codes: npt.NDArray[np.int32]
    tenant_names: list[str]
    lane_codes: npt.NDArray[np.int32]
    lane_names: list[str]
    decision_codes: npt.NDArray[np.int32]
    decision_names: list[str]
    queue_wait_ms: npt.NDArray[np.float64]  # NaN where unknown
    latency_ms: npt.NDArray[np.float64]  # NaN where unknown
    rows_read: int = 0
    bad_rows: list[BadRow] = field(default_factory=list)
    bad_row_count: int = 0
    # How the input was understood (printed, and under "input" in --json).
    resolution: Resolution | None = None
    time: TimeDecision | None = None
    column_names: list[str] = field(default_factory=list)  # all columns seen
    findings: list[Finding] = field(default_factory=list)  # set by checks.check_log
    grid_us: int | None = None  # the timestamps' step (grid.py); set by checks.check_log
    forced: bool = False  # fatal findings were overridden with --force
    # Block ids (blockids.py), when the log has a block-id column: request r's
    # ids (as int64 codes) are block_codes[block_offsets[r]:block_offsets[r + 1]].
    block_offsets: npt.NDArray[np.int64] | None = None
    block_codes: npt.NDArray[np.int64] | None = None
    blocks_missing: int = 0  # requests whose block ids were missing (counted as none)

    def __len__(self) -> int:
        return int(self.ts_us.size)

    @property
    def has_tenants(self) -> bool:
        return "tenant" in self.columns

    @property
    def has_tokens(self) -> bool:
        return "prompt_tokens" in self.columns or "output_tokens" in self.columns

    @property
    def has_decisions(self) -> bool:
        return "decision" in self.columns

    @property
    def has_block_ids(self) -> bool:
        return self.block_offsets is not None

    @property
    def has_lanes(self) -> bool:
        return "lane" in self.columns

    def input_to_dict(self) -> dict[str, object]:
        """The ``input`` object of the JSON outputs (docs/analysis.md)."""
        preset = None if self.resolution is None else self.resolution.preset
        return {
            "file_format": self.fmt,
            "preset": None if preset is None else preset.name.value,
            "preset_source": None if preset is None else self.resolution.how,  # type: ignore[union-attr]
            "description": "" if self.resolution is None else self.resolution.describe(),
            "time": None if self.time is None else self.time.as_dict(),
            "grid_s": None if self.grid_us is None else self.grid_us / 1_000_000,
            "findings": [f.as_dict() for f in self.findings],
            "forced": self.forced,
        }
