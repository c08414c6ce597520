"""burstgate in LiteLLM's proxy (docs/litellm.md): a ``CustomLogger``
callback that admits every chat and text completion through burstgate
before LiteLLM calls the model, and settles it with LiteLLM's usage after.

In the proxy's ``config.yaml``::

    litellm_settings:
      callbacks: ["burstgate_client.litellm.handler"]

LiteLLM imports ``burstgate_client.litellm`` (no file next to the
config is needed: a dotted path that is not a file there is imported) and
takes its attribute ``handler``: a :class:`~.hook.BurstgateHook` made on
first access from the ``BURSTGATE_LITELLM_*`` settings (config.py), so a
bad setting fails the proxy's start with the field named.

Modules: config.py (settings), mapping.py (tenant, lane, pool, tokens,
degradation, usage), refusal.py (LiteLLM's exceptions), settle.py (exactly
one Complete per admission), hook.py (the callback). Importing this package
does not import litellm; ``handler`` and ``BurstgateHook`` do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from burstgate_client.litellm.hook import BurstgateHook

__all__ = ["BurstgateHook", "handler"]


def __getattr__(name: str) -> Any:
    if name == "BurstgateHook":
        from burstgate_client.litellm.hook import BurstgateHook

        return BurstgateHook
    if name == "handler":
        from burstgate_client.litellm.hook import BurstgateHook

        instance = BurstgateHook()
        globals()["handler"] = instance  # made once: later lookups find it
        return instance
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
