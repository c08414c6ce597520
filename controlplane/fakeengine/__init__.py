"""An OpenAI-compatible fake engine on the ``simulate`` engine model, in
scaled real time (``burstgate fake-engine``): the engine the load tests
and the sidecar's end-to-end tests run against. docs/loadtest.md."""

from controlplane.fakeengine.server import FakeEngine

__all__ = ["FakeEngine"]
