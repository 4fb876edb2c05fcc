"""Benchmarks that back a number in docs/benchmarks.md and are not part of the product.

An operator measures their own host with ``llamagate bench`` (run, sweep, overload, experiment, soak,
scaleout). What lives here measures llamagate itself (the proxy's cost, startup and recovery, a scrape,
strict cache isolation, several models), so the team can reproduce every recorded table:
``python -m tests.benchmarks.NAME --help`` from the repository root. Each one is tied like a product
command: SIGTERM stops what it started and exits 130, SIGKILL leaves the kernel to end it (PDEATHSIG).
"""
