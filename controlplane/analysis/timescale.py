"""How the report names a moment: UTC clock time, or time since the log's zero.

Most request logs carry wall-clock timestamps (ISO 8601 or epoch seconds) and
an SRE reads an incident by the clock: "18:58 UTC". Some public traces carry
*relative* timestamps (seconds or milliseconds from the trace's start); read as
epoch values they land in January 1970, and a clock axis would print a
meaningless "00:12". Those are shown as time since the log's zero instead,
and the report says so.
"""

from __future__ import annotations

from dataclasses import dataclass

from controlplane.analysis.parsing import US_PER_S, format_timestamp_us
from controlplane.analysis.stats import Timeline

# No LLM request log predates 2000-01-01T00:00:00Z: a first arrival before it
# means the timestamps count from the trace's start, not from the epoch.
RELATIVE_BEFORE_US = 946_684_800 * US_PER_S
SECONDS_PER_DAY = 86_400


def is_relative(t0_us: int) -> bool:
    return t0_us < RELATIVE_BEFORE_US


def since_zero(seconds: int) -> str:
    """``+1:02:03`` (or ``+2d 01:02:03``): time since the log's zero."""
    days, rest = divmod(seconds, SECONDS_PER_DAY)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    clock = f"{hours}:{minutes:02d}:{secs:02d}"
    return f"+{days}d {hours:02d}:{minutes:02d}:{secs:02d}" if days else f"+{clock}"


@dataclass(frozen=True, slots=True)
class TimeScale:
    """Names per-second bins of one timeline for tables and axes."""

    timeline: Timeline
    relative: bool

    @classmethod
    def of(cls, timeline: Timeline) -> TimeScale:
        return cls(timeline=timeline, relative=is_relative(timeline.t0_us))

    @property
    def zone(self) -> str:
        """Column-header suffix: what the times in that column mean."""
        return "since the log's zero" if self.relative else "UTC"

    def moment(self, ts_us: int) -> str:
        """``2023-11-16 18:58:03`` or ``+0:42:17`` (to the second)."""
        if self.relative:
            return since_zero(ts_us // US_PER_S)
        return format_timestamp_us(ts_us)[:19].replace("T", " ")

    def at(self, index: int) -> str:
        """The start of per-second bin ``index``."""
        return self.moment(self.timeline.bin_start_us(index))

    def note(self) -> str:
        """One sentence for the report when the times are not clock times."""
        if not self.relative:
            return ""
        return (
            "The log's timestamps are relative (they count from the trace's start, not from "
            "a calendar date), so times are shown as time since the log's zero (+H:MM:SS)."
        )
