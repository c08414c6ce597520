"""Open-loop load against a running control plane (``burstgate loadtest``):
profiles, the load generator and its report. docs/loadtest.md."""
