"""Where llamagate keeps what it builds and fetches. One place, so every command agrees."""

from __future__ import annotations

import os
from pathlib import Path

# The cache holds built binaries (keyed by the lock's digest), the demo model and the hash cache.
# Order: explicit override, XDG, then the XDG default. The override exists for systemd's
# CacheDirectory= and for tests that need a private cache.
CACHE_ENV = "LLAMAGATE_CACHE_DIR"


def cache_root(env: dict[str, str] | None = None) -> Path:
    environ = os.environ if env is None else env
    explicit = environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit).expanduser()
    xdg = environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "llamagate"


def default_lock_path() -> Path:
    """The lock shipped with the package; a checkout's top-level ``llama-build.lock`` wins when present."""
    here = Path(__file__).resolve().parent
    checkout = here.parent / "llama-build.lock"
    if checkout.is_file():
        return checkout
    return here / "data" / "llama-build.lock"
