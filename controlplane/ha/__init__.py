"""Scale-out and high availability (issue 16; docs/ha.md).

Several replicas on one PostgreSQL; each *cell* (one or more engine pools)
has exactly one owner at a time, held as a lease row with a fencing epoch.

- ``rendezvous``: which live member a cell belongs to (HRW hashing);
- ``cells``: which cell a pool is in;
- ``store``: the lease and member tables (SQL, PostgreSQL only) and ``fence``;
- ``coordinator``: one replica's loop: heartbeat, renew, acquire, hand off,
  self-fence, drain.

Step 1 of the issue: a library, not yet wired into the server (which keeps
its one-replica guard, ``controlplane.store.replica_lock``).
"""
