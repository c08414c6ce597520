"""The alert rules and their runbook (docs/runbook.md) stay in step: every
rule's ``runbook_url`` is of the one shape and lands on a ``## <alert>``
section (GitHub's anchor of the heading), every section is an alert's, and
each section talks about what its alert measures (a metric of its
expression), so a renamed alert or metric cannot leave a dead link or a
runbook about something else."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.metrics.promql import metric_names
from tests.unit.test_doc_links import anchor, prose

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "burstgate-alerts.yml"
RUNBOOK = ROOT / "docs" / "runbook.md"
URL = "https://github.com/burstgate/burstgate/blob/main/docs/runbook.md#"
# Sections written before their rules exist: the sidecar group is appended
# to the rule file in another change (issue 35). Each is accepted only while
# its alert is absent; once the rule exists it is checked like every other.
def rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [r for g in groups for r in g["rules"] if "alert" in r]


def sections() -> dict[str, str]:
    """``## `` heading -> the section's text (code blocks left out)."""
    parts = re.split(r"^## (.+)$", prose(RUNBOOK), flags=re.M)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts), 2)}


def test_github_anchor_rule() -> None:
    # The rule the URLs rely on, on the shapes a heading could take.
    assert anchor("BurstgateDown") == "burstgatedown"
    assert anchor("Upgrades and rollback") == "upgrades-and-rollback"
    assert anchor("`burstgate plan`: capacity") == "burstgate-plan-capacity"


@pytest.mark.parametrize("rule", rules(), ids=lambda r: r["alert"])
def test_every_alert_links_its_runbook_section(rule: dict[str, Any]) -> None:
    name = rule["alert"]
    url = rule.get("annotations", {}).get("runbook_url")
    assert url == URL + anchor(name), f"{name}: runbook_url is {url!r}"
    assert name in sections(), f"{name}: docs/runbook.md has no '## {name}' section"


def test_every_section_is_an_alerts() -> None:
    alerts = {r["alert"] for r in rules()}
    headings = list(sections())
    assert len(headings) == len(set(headings)), "a heading twice gets GitHub's '-1' anchor"
    orphans = [h for h in headings if h not in alerts]
    assert not orphans, f"runbook sections without an alert: {orphans}"


@pytest.mark.parametrize("rule", rules(), ids=lambda r: r["alert"])
def test_each_section_names_a_metric_its_alert_reads(rule: dict[str, Any]) -> None:
    text = sections().get(rule["alert"], "")
    # A histogram's _bucket series is read under its own name or the family's.
    names = {n for m in metric_names(rule["expr"]) for n in (m, m.removesuffix("_bucket"))}
    assert any(n in text for n in names), (
        f"{rule['alert']}: its section names none of {sorted(names)}"
    )
