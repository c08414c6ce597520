"""The admission client the sidecar runs on: the SDK's
``AsyncAdmissionClient``, with the lanes' fail policies from the config."""

from __future__ import annotations

from burstgate_client.sdk import AsyncAdmissionClient, FailPolicy
from burstgate_client.sidecar.config import SidecarConfig


def sdk_client(cfg: SidecarConfig) -> AsyncAdmissionClient:
    """Create inside the running event loop (the channel is bound to it).
    Lane ``""`` (the tenant's default, unknown to the sidecar) and lanes
    the config does not list take ``default_lane``'s policy."""
    policies = {name: FailPolicy(lane.fail_policy.value) for name, lane in cfg.lanes.items()}
    policies[""] = FailPolicy(cfg.default_lane.fail_policy.value)
    return AsyncAdmissionClient(
        cfg.control_plane, api_key=cfg.control_plane_api_key, fail_policy=policies,
        spool_path=cfg.spool_path,
    )  # fmt: skip
