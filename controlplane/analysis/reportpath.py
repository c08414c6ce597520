"""Where ``analyze --html TARGET`` writes, decided before the log is read.

TARGET is the report file itself, unless it names a directory: one that
exists, or one spelt with a trailing slash (``reports/``), which gets
``index.html`` inside. Nothing is created but the file: a missing directory
is an error naming it, found before minutes of analysis rather than after.
Kept free of matplotlib so the CLI can check the path without loading it.
"""

from __future__ import annotations

import os
from pathlib import Path

INDEX = "index.html"


class ReportPathError(ValueError):
    """The --html target cannot be written; the message says why."""


def report_path(target: str) -> Path:
    if not target:
        raise ReportPathError("--html needs a file name (report.html) or a directory (reports/)")
    path = Path(target)
    as_directory = target.endswith(("/", os.sep))
    if path.is_dir():
        return path / INDEX
    if as_directory:
        if path.exists():
            raise ReportPathError(f"--html {target}: not a directory")
        raise ReportPathError(
            f"--html {target}: no such directory (create it, or give a file name such as "
            f"{path.name or 'report'}.html)"
        )
    parent = path.parent
    if not parent.exists():
        raise ReportPathError(f"--html {target}: directory {parent} does not exist")
    if not parent.is_dir():
        raise ReportPathError(f"--html {target}: {parent} is not a directory")
    return path
