"""Before the app: the listening socket and the request head. The guarded uvicorn protocol
(``protocol``) refuses heads that are too long, too slow or one connection too many with a status line
(408, 414, 431, 503 at the cap; ``refusals``), and ``guard.FrontDoor`` counts what it refused, holds a
file descriptor in reserve and tells /readyz when the listener cannot take a new connection."""
