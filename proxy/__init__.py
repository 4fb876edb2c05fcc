"""llamagate's proxy: the only door to llama-server. Never imports ``supervisor``.

The folders are named for their roles and imports point down these layers, never back
(tests/unit/test_layout.py holds the order; README's Layout shows it): ``app`` -> ``listener``,
``middleware``, ``routes`` -> ``state`` (the door's state) -> ``models`` (which child answers),
``metrics`` -> ``admission``, ``streams``, ``upstream`` -> ``asgi``, ``auth``, ``errors``, ``settings``,
``source`` (what the daemon hands the proxy). A request's story is told by ``routes.inference``.
"""
