"""What the replicas of one service share (``cluster.redis_url``): a tenant's concurrency held as expiring
leases in Redis (``scripts``, ``leases``), taken at admission beside each replica's own slot gate
(``limiter``: when Redis is unreachable, per-replica limits or 503, and back once it answers; every
replica watches Redis, traffic or not), the accounts' budget windows counted in the same Redis
(``budget_scripts``, ``budgets``), and the poison requests' verdicts (``poison_scripts``, ``poison``:
a body that killed two children is refused by every replica)."""
