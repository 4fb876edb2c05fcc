"""The small ASGI vocabulary every route uses: the per-request record (``context``), the few ways to
answer (``responses``), reading and checking a JSON request body (``body``) and noticing a client that
leaves (``disconnect``). Nothing here knows about models, tenants or llama-server."""
