"""llamagate's supervisor: the pinned llama-server's artifacts, its process, and the daemon.

The proxy (package ``proxy``) never imports this package; the daemon wires the two together.
"""

__version__ = "0.1.0"
