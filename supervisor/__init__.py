"""llamagate's supervisor: the pinned llama-server's artifacts, its process, and the daemon.

The proxy (package ``proxy``) never imports this package; the daemon wires the two together. The folders
are named for their roles (commands, bench, daemon, artifacts, budget, child, config, launch; README's
Layout) and imports point down that list, never back: tests/unit/test_layout.py holds the order.
"""

__version__ = "0.1.0"
