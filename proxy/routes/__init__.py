"""What each path does. ``table`` is the one list of routes (path, methods, access, cost kind, stream
format); ``build`` makes one endpoint per row. ``inference`` is the generation path (check, admit,
forward, relay: its docstring is the map of a request's story); ``passthrough``, ``probes``, ``admin``,
``models`` (GET /v1/models) and ``ui`` (the page's static files) are the rest."""
