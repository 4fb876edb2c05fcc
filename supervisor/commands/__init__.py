"""One module per ``llamagate`` subcommand; each exposes ``register(subparsers)``."""
