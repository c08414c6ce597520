"""Drop-in integrations for the gateways people already run (issue 17):
``controlplane.integrations.litellm`` is a LiteLLM proxy callback
(docs/litellm.md)."""
