"""burstgate's Python client SDK: what a sidecar links to ask
burstgate for admission, settle, report load and read limits.

    async with AsyncAdmissionClient("127.0.0.1:50051",
                                    fail_policy={"": FailPolicy.CLOSED,
                                                 "batch": FailPolicy.OPEN}) as c:
        a = await c.admit("acme", "req-1", prompt_tokens=900, max_tokens=256)
        if a.admitted:
            ...  # run it, generating at most a.granted_max_tokens
            await c.complete("acme", "req-1", prompt_tokens=900, generated_tokens=120)

:class:`AdmissionClient` is the same, synchronous and thread-safe. The
design decisions (micro-batching, deadlines, what "unreachable" means, the
completion spool and why delivery is exactly once, backoff) are in each
module's docstring and in docs/sdk.md:

- aio.py: the asyncio client; sync.py: the synchronous one
- batcher.py: Admits micro-batched onto one AdmitStream, the gate's releases
  (session.py: one stream; answers.py, deadlines.py: who gets which answer, when;
  suspects.py: values that broke a stream go unary)
- breaker.py: unreachable = the channel fails; fail fast while down
- spool.py, spoolfile.py: buffered Completes, bounded, on disk, exactly once
- backoff.py: exponential backoff with full jitter for refused callers
- model.py: the answer types; limits.py: GetLimits, cached
- ``pb``: the burstgate.v1 admission messages (LoadReport for report_load)
"""

from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb
from burstgate_client.admin import TlsFiles
from burstgate_client.sdk.aio import AsyncAdmissionClient
from burstgate_client.sdk.backoff import Backoff
from burstgate_client.sdk.counters import Counters
from burstgate_client.sdk.model import (
    Admission,
    Completion,
    ControlPlaneUnavailable,
    FailPolicy,
    Limits,
)
from burstgate_client.sdk.sync import AdmissionClient

__all__ = [
    "Admission",
    "AdmissionClient",
    "AsyncAdmissionClient",
    "Backoff",
    "Completion",
    "ControlPlaneUnavailable",
    "Counters",
    "FailPolicy",
    "Limits",
    "TlsFiles",
    "pb",
]
