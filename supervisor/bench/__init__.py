"""llamagate's benchmarks: the capacity envelope harness and the supervisor/proxy/metrics cost benchmarks."""
