"""The server: ``burstgate serve``'s process. ``app.ControlPlane`` composes
the parts (the config and expiry loops in ``loops``, key last-use in
``keyuse``, health in ``health``, the doors in ``gateways``, the ledger's
wiring in ``metering``, the scale-out wiring in ``replicas``);
``process.run`` serves until SIGTERM or SIGINT."""

from controlplane.server.app import ControlPlane
from controlplane.server.process import ReadyCallback, run, serve_forever

__all__ = ["ControlPlane", "ReadyCallback", "run", "serve_forever"]
