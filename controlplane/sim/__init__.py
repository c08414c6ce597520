"""``burstgate simulate``: a discrete-event model of vLLM-like engines and a
harness that replays a trace through an admission policy in front of them,
with simulated time.

- ``engine``  the engine model (continuous batching, chunked prefill, a KV
              cache in blocks, preemption) and the router in front of a pool
- ``trace``   request traces (Azure CSV, JSON Lines, with block ids when
              they have ``hash_ids``), time scaling, tenant assignment,
              injected bursts
- ``prefixcache`` each engine's prefix cache (vLLM's automatic prefix
              caching, in the KV cache's free blocks)
- ``reuse``   what the prefix caches did per lane and pricing window, and
              the billing drift under fixed and dynamic prices

burstgate itself is driven through its real service layer
(``controlplane.service.AdmissionService``) with simulated time, never
re-implemented here.
"""
