"""Tenants as accounts: the proxy's own state, kept in a store that outlives the daemon.

This folder holds the key store (keys made and revoked while the daemon serves, as digests only), the
usage ledger (one row per finished request, rolled up per hour) and the budget windows (tokens and
requests per minute and per day, per tenant and per key), behind one small interface (``store.Store``)
with SQLite as its first engine and plain SQL migrations shipped beside it. The request path never
touches the disk: it reads an in-memory view of the keys (``keyview``), asks and charges the budgets in
memory (``budgets``), and hands usage to a queue (``ledger``) that a writer thread (``writer``) writes in
batches; ``service.Accounts`` owns those pieces and their threads. It imports only the standard library
and the proxy's top-level ``settings``, ``auth`` and ``errors``, so the supervisor's commands may use it
and it never reaches into the request path's other folders.
"""
