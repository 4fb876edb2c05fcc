"""Pure ASGI layers around every request (none buffers a body): the request record, error mapping and
access log (``context``), CORS (``cors``), believing ``X-Forwarded-For`` only from trusted peers
(``forwarded``) and Anthropic's credentials header and error shape on its routes (``anthropic``)."""
