"""The running service: one loop, signals, what it prepares before start and what it reports while it runs."""
