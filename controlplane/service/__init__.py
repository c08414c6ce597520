"""Use cases. This package is the only importer of ``fastpath``."""

from controlplane.service.admission import AdmissionService, BatchResult

__all__ = ["AdmissionService", "BatchResult"]
