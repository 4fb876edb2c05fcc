"""Talking to llama-server: a hand-written HTTP/1.1 client (``connection``: one httptools-parsed
asyncio protocol per connection, with flow control both ways) and its keep-alive pool (``pool``:
retry-once rules, connections kept per child and dropped when a child is replaced)."""
