"""Prometheus series: the proxy's own (``proxy``: requests, rejections, latencies, the admission gates'
gauges), llama-server's relabeled for every child (``llama``) and the optional unauthenticated loopback
listener that serves them (``listener``)."""
