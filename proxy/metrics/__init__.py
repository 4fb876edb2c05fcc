"""Prometheus series: the proxy's own (``proxy``: requests, rejections, latencies, the admission gates'
gauges), llama-server's relabeled for every child (``llama``) and the optional unauthenticated loopback
listener that serves them (``listener``); and, not Prometheus, the last 15 minutes per model kept in
memory for the status page's charts (``history``, ``GET /admin/history``)."""
