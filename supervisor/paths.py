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


def state_root(env: dict[str, str] | None = None) -> Path:
    """Where the daemon keeps its state (the accounts store): systemd's ``StateDirectory=`` when it runs
    the unit (it sets ``$STATE_DIRECTORY``, /var/lib/llamagate), else ``$XDG_STATE_HOME/llamagate``
    (~/.local/state/llamagate for a user run)."""
    environ = os.environ if env is None else env
    systemd = environ.get("STATE_DIRECTORY")
    if systemd:
        return Path(systemd.split(":")[0])  # several StateDirectory= entries come colon-separated
    xdg = environ.get("XDG_STATE_HOME")
    # The XDG spec ignores a relative value; so do we, rather than resolve it against the cwd.
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".local" / "state"
    return base / "llamagate"


def default_store_path(env: dict[str, str] | None = None) -> Path:
    return state_root(env) / "llamagate.db"


def umask() -> int:
    """The process umask, read without changing it (Linux reports it in /proc/self/status)."""
    try:
        for line in Path("/proc/self/status").read_text(encoding="ascii").splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    # Elsewhere the only way is to set it and put it back (a tiny race with other threads' files).
    current = os.umask(0o022)
    os.umask(current)
    return current


def new_file_mode() -> int:
    """The mode ``open()`` would give a new file: 0o666 less the umask (0o644 under the usual 022).

    Files written atomically through ``tempfile.mkstemp`` (the receipt, the hash cache) would otherwise
    stay 0600: a cache built by root, as in a container image, is then unreadable by the service user
    that runs from it. Nothing in the cache is secret; the umask still lets an operator say otherwise."""
    return 0o666 & ~umask()


def default_lock_path() -> Path:
    """The lock shipped with the package; a checkout's top-level ``llama-build.lock`` wins when present."""
    here = Path(__file__).resolve().parent
    checkout = here.parent / "llama-build.lock"
    if checkout.is_file():
        return checkout
    return here / "data" / "llama-build.lock"
