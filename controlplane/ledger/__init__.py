"""Metering: the dual ledger, dynamic cost-aware pricing windows,
margin warnings and billing exports. See docs/ledger.md.

The use cases of metering:

- ``pricing``   pricing windows (``PricingBook``, the admission path's
                ``Pricing``)
- ``spool``     the local append-only, fsynced spool
- ``writer``    ``LedgerWriter``: group commit off the Admit path, spool
                fallback and replay
- ``metering``  ``Metering``: Complete made durable exactly once
- ``export``    deterministic streaming exports with a reconciling manifest
- ``usage``     usage summaries over the ledger
- ``revenue``   sums with the base charge (at multiplier 1) and the
                dynamic revenue, per record
- ``margin``    the margin report over any period (``burstgate margin``)

Elsewhere by layer: the pure types in ``controlplane.domain`` (``money``,
``catalog``, ``ledger_records``, ``pricing``: the step table), the SQL in
``controlplane.store.ledger``, ``burstgate.v1.LedgerService`` in
``controlplane.rpc.ledger``, the CLI in ``controlplane.cli.ledger``,
``controlplane.cli.margin`` and ``controlplane.cli.pricing``.
"""
