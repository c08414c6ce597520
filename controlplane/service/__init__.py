"""Use cases. This package is the only importer of ``fastpath``."""

from controlplane.service.admission import AdmissionService, BatchResult
from controlplane.service.restore import OpenReservation, Restore

__all__ = ["AdmissionService", "BatchResult", "OpenReservation", "Restore"]
