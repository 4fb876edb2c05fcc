"""llamagate's proxy: the only door to llama-server. Never imports ``supervisor``.

The folders are named for their roles and imports point down these layers, never back
(tests/unit/test_layout.py holds the order; README's Layout shows it): ``app`` -> ``listener``,
``middleware``, ``routes`` -> ``state`` (the door's state) -> ``models`` (which child answers),
``metrics``, ``telemetry`` (OpenTelemetry) -> ``admission``, ``streams``, ``upstream``, ``accounts``
(tenants' keys, ledger and budgets), ``cluster`` (limits shared with the other replicas), ``schema``
(the request schema) -> ``conversations`` (which conversation a request continues, which slot holds it,
its state on disk) -> ``asgi``, ``auth``, ``errors``, ``settings``, ``source`` (what the daemon hands
the proxy). A request's story is told by ``routes.inference``.
"""
