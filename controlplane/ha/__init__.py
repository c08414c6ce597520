"""Scale-out and high availability (docs/ha.md): the use case.

Several replicas on one PostgreSQL; each *cell* (one or more engine pools)
has exactly one owner at a time, held as a lease row with a fencing epoch.
This package decides and runs; it holds no SQL and no pure rules of its own:

- ``coordinator``: one replica's loop: heartbeat, renew, acquire, hand off,
  self-fence, drain;
- ``serving``: what ``serve`` asks: is a pool's cell ours, and if not,
  whose (redirects; claim on demand); owner discovery; metrics;
- ``shares``: the loop that renews this replica's shares of its tenants'
  limits and installs them in the service;
- ``trace``: the ownership trace (a test and diagnostic aid).

Beneath it: ``controlplane.store.leases`` (the lease and member tables, and
``fence``) and ``controlplane.store.shares`` (the share rows); the pure
pieces are in ``controlplane.domain``: ``rendezvous`` (which live member a
cell belongs to), ``cells`` (which cell a pool is in), ``shares`` (the share
rules). On SQLite the server keeps its one-replica file lock
(``controlplane.store.replica_lock``) and every cell is local.
"""
