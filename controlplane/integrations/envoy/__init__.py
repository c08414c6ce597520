"""Envoy's global rate-limit service API served by burstgate (docs/envoy.md):
config.py (the descriptor mapping file), mapping.py (request -> what is
asked), answers.py (the response and its headers), servicer.py (the RPC),
settle.py (the response-path settlement)."""
