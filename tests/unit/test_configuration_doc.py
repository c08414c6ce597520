"""docs/configuration.md is generated from the settings object
(tools/configdoc.py): every setting has a description, and the committed
page is what the generator prints now."""

from __future__ import annotations

from controlplane.domain.policy import Policy
from controlplane.settings import Settings
from tools import configdoc


def test_every_setting_has_a_description() -> None:
    assert configdoc.undocumented() == []


def test_the_committed_page_is_current() -> None:
    assert configdoc.PAGE.read_text() == configdoc.page(), (
        "docs/configuration.md is stale: run `python tools/configdoc.py > docs/configuration.md`"
    )


def test_every_setting_and_policy_key_is_on_the_page() -> None:
    text = configdoc.PAGE.read_text()
    for name in Settings.model_fields:
        assert f"`BURSTGATE_{name.upper()}`" in text, name
    for name in Policy.model_fields:
        assert f"`BURSTGATE_POLICY__{name.upper()}`" in text, name
