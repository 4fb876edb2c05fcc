"""One llama-server's life: the pure state machine and the driver that acts for it (spawn, probes, readiness
gate, restart policy)."""
