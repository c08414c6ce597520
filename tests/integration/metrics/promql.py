"""The metric names a PromQL expression selects, for checking shipped
dashboards and alert rules against a running server's /metrics.

Not a full parser: the expressions are also handed to promtool, Prometheus's
own parser (test_deploy_files.py), so what this reads is valid PromQL. In
valid PromQL a bare identifier is a metric name unless it is a function or
aggregation (followed by ``(``), a keyword, or inside a label matcher
(``{...}``), a range or subquery (``[...]``) or a grouping clause (``by``,
``without``, ``on``, ``ignoring``, ``group_left``, ``group_right``); strings
and Grafana variables (``$job``, ``${DS}``, ``$__rate_interval``) are never
names.
"""

from __future__ import annotations

import re

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"' r"|'(?:[^'\\]|\\.)*'" r"|`[^`]*`")
_GRAFANA_VAR = re.compile(r"\$\{[^}]*\}|\$\w+")
_MATCHERS = re.compile(r"\{[^{}]*\}")
_BRACKETS = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(
    r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", re.IGNORECASE
)
# An identifier not preceded by a word character or a dot (so not the
# exponent or suffix of a number such as 1e9 or 0.5e-3).
_IDENT = re.compile(r"(?<![\w.])([a-zA-Z_:][a-zA-Z0-9_:]*)")
_KEYWORDS = frozenset(
    {
        "and", "or", "unless", "by", "without", "on", "ignoring", "group_left",
        "group_right", "bool", "offset", "inf", "nan", "start", "end",
    }
)  # fmt: skip


def metric_names(expr: str) -> set[str]:
    """The metric names ``expr`` selects (empty for a constant expression)."""
    text = _STRING.sub(" ", expr)
    text = _GRAFANA_VAR.sub(" ", text)
    text = _MATCHERS.sub(" ", text)
    text = _BRACKETS.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    names = set()
    for m in _IDENT.finditer(text):
        name = m.group(1)
        after = text[m.end() :].lstrip()
        if after.startswith("(") or name.lower() in _KEYWORDS:
            continue  # a function or aggregation call, or a keyword
        names.add(name)
    return names


def label_values_metric(query: str) -> str | None:
    """The metric of a Grafana ``label_values(metric{...}, label)`` variable
    query (None for other query forms)."""
    m = re.match(r"\s*label_values\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)", query)
    return m.group(1) if m else None
