"""The admission client the sidecar runs on: the SDK's
``AsyncAdmissionClient``, with the lanes' fail policies and the completion
spool from the config."""

from __future__ import annotations

from pathlib import Path

from burstgate_client.errors import InvalidArgument
from burstgate_client.sdk import AsyncAdmissionClient, FailPolicy
from burstgate_client.sidecar.config import SidecarConfig
from burstgate_client.sidecar.spoollock import SpoolLock


class SidecarAdmissionClient(AsyncAdmissionClient):
    """The SDK's client, holding the spool file's lock (spoollock.py) until
    it is closed, and knowing where its spool is."""

    spool_file: Path | None = None
    _lock: SpoolLock | None = None

    async def aclose(self, flush_timeout_s: float = 1.0) -> None:
        try:
            await super().aclose(flush_timeout_s)
        finally:
            if self._lock is not None:
                self._lock.release()
                self._lock = None


def sdk_client(cfg: SidecarConfig) -> SidecarAdmissionClient:
    """Create inside the running event loop (the channel is bound to it).
    Lane ``""`` (the tenant's default, unknown to the sidecar) and lanes
    the config does not list take ``default_lane``'s policy. Raises
    InvalidArgument (--spool) when the spool file cannot be used."""
    policies = {name: FailPolicy(lane.fail_policy.value) for name, lane in cfg.lanes.items()}
    policies[""] = FailPolicy(cfg.default_lane.fail_policy.value)
    spool = cfg.spool_file()
    lock = SpoolLock(spool) if spool is not None else None
    if lock is not None:
        lock.acquire()
    try:
        client = SidecarAdmissionClient(
            cfg.control_plane, api_key=cfg.control_plane_api_key, fail_policy=policies,
            spool_path=spool, tls=cfg.tls_files(),
        )  # fmt: skip
    except BaseException as exc:
        if lock is not None:
            lock.release()
        if isinstance(exc, OSError) and spool is not None:  # reading the spool file
            raise InvalidArgument("--spool", f"cannot use {spool}: {exc.strerror or exc}") from None
        raise
    client.spool_file, client._lock = spool, lock
    return client
