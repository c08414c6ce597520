"""Drop-in integrations with the gateways people already run:
``burstgate_client.litellm`` is a LiteLLM proxy callback
(docs/litellm.md); ``controlplane.integrations.envoy`` serves Envoy's
rate-limit service API beside burstgate's own (docs/envoy.md)."""
