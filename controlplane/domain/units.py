"""Units of the plane's integer fixed point, defined once.

The fast path owns them (``fastpath.codes``: its C builds repeat them as
compile-time constants and a test checks the copies); everything above it
imports them from here.
"""

from __future__ import annotations

from typing import Final

from fastpath.codes import MTOK_PER_TOKEN, NS_PER_DAY, NS_PER_HOUR, NS_PER_S, PPM

__all__ = ["MTOK_PER_TOKEN", "NS_PER_DAY", "NS_PER_HOUR", "NS_PER_MS", "NS_PER_S", "PPM"]

NS_PER_MS: Final = NS_PER_S // 1000
