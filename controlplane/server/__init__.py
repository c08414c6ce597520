"""The server: ``burstgate serve``'s process. ``app.ControlPlane`` composes
the parts; ``run`` serves until SIGTERM or SIGINT."""

from controlplane.server.app import ControlPlane, ReadyCallback, run, serve_forever

__all__ = ["ControlPlane", "ReadyCallback", "run", "serve_forever"]
