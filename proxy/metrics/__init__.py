"""Prometheus series: the proxy's own (``proxy``: requests, rejections, latencies, the admission gates'
gauges), llama-server's relabeled for every child (``llama``) and the optional unauthenticated loopback
listener that serves them (``listener``); and, not Prometheus, the last 15 minutes per model kept in
memory for the status page's charts (``history``, ``GET /admin/history``).

Where a metric is called: a component keeps its own counters (``DiskTier.stats``, the gate's figures) and
a collector reads them at scrape time (``tier``); only a request's outcomes are observed as they happen,
on the request's path, by the code that decides them (``proxy.routes.replay``: replays, poison verdicts).
"""
