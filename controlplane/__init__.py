"""burstgate control plane: admission, metering and administration over gRPC."""

__version__ = "0.1.0"
