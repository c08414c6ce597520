"""burstgate's client wing, distributed on its own (``burstgate-client``):
the SDK (``burstgate_client.sdk``), the HTTP sidecar
(``burstgate_client.sidecar``, the ``burstgate-sidecar`` command), the
LiteLLM hook (``burstgate_client.litellm``), the thin ``ProtoClient`` and
the admin client, over the generated stubs of the API
(``burstgate_client._proto``). It imports nothing of the server's."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("burstgate-client")
except PackageNotFoundError:  # pragma: no cover - a source tree not installed
    __version__ = "0+unknown"
