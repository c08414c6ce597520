"""Metering (issue 4): the dual ledger, dynamic cost-aware pricing windows,
margin warnings and billing exports. See docs/ledger.md.

- ``money``     exact decimal arithmetic and the fixed formats of amounts
- ``catalog``   the price catalog and the two ledger formulas
- ``pricing``   pricing windows and the step table (``PricingBook``, the
                admission path's ``Pricing``)
- ``records``   one ledger row
- ``spool``     the local append-only, fsynced spool
- ``store``     SQL: ledger rows, catalog, windows, margin warnings
- ``writer``    ``LedgerWriter``: group commit off the Admit path, spool
                fallback and replay
- ``metering``  ``Metering``: Complete made durable exactly once
- ``export``    deterministic streaming exports with a reconciling manifest
- ``rpc``       ``burstgate.v1.LedgerService``
"""
