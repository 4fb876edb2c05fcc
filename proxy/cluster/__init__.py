"""Limits shared by the replicas of one service (``cluster.redis_url``): a tenant's concurrency held as
expiring leases in Redis (``scripts``, ``leases``), taken at admission beside each replica's own slot
gate (``limiter``: when Redis is unreachable, per-replica limits or 503, and back once it answers), and
the accounts' budget windows counted in the same Redis (``budget_scripts``, ``budgets``)."""
