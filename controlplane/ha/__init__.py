"""Scale-out and high availability (issue 16; docs/ha.md).

Several replicas on one PostgreSQL; each *cell* (one or more engine pools)
has exactly one owner at a time, held as a lease row with a fencing epoch.

- ``rendezvous``: which live member a cell belongs to (HRW hashing);
- ``cells``: which cell a pool is in;
- ``store``: the lease and member tables (SQL, PostgreSQL only) and ``fence``;
- ``coordinator``: one replica's loop: heartbeat, renew, acquire, hand off,
  self-fence, drain;
- ``serving``: what ``serve`` asks (step 2): is a pool's cell ours, and if
  not, whose (redirects; claim on demand); owner discovery; metrics.

On SQLite the server keeps its one-replica file lock
(``controlplane.store.replica_lock``) and every cell is local.
"""
