"""The HTTP sidecar: an OpenAI-compatible reverse proxy in front of an
engine (vLLM, SGLang, TGI) that asks burstgate before forwarding and
settles with the engine's usage (docs/sidecar.md)."""

from burstgate_client.sidecar.config import SidecarConfig, load
from burstgate_client.sidecar.server import Sidecar

__all__ = ["Sidecar", "SidecarConfig", "load"]
