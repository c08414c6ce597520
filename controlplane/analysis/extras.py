"""The tools' optional packages: the ``analysis`` extra.

The HTML reports of ``burstgate analyze``, ``simulate`` and ``loadtest`` draw
their figures with matplotlib, and ``analyze`` reads JSON and Parquet logs
faster with pyarrow. Neither belongs in a server or sidecar install, so both
come with ``pip install 'burstgate[analysis]'`` (``make test`` installs every
extra). A command that needs one checks before it starts its run, so a
missing package costs a clear message, not a finished run without its report.
"""

from __future__ import annotations

import importlib.util

ANALYSIS_EXTRA = "pip install 'burstgate[analysis]'"


def plotting_missing(option: str) -> str | None:
    """Why ``option`` cannot be honoured (matplotlib is not installed), or
    None when it can."""
    if importlib.util.find_spec("matplotlib") is None:
        return f"{option} draws with matplotlib, which is not installed: {ANALYSIS_EXTRA}"
    return None
