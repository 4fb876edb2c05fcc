"""One module per ``llamagate bench`` subcommand; each exposes ``register(subparsers)``."""
