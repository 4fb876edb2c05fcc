"""Memory a new child can get: the host's available memory, or less inside a cgroup v2 limit.

Under systemd (``MemoryMax=``) or in a container (``docker run -m``, a Kubernetes memory limit) the
kernel OOM-kills at the cgroup's ``memory.max`` however much the host has free, so the budget must
compare against that limit minus what the cgroup already uses. Every ancestor up to the root can
carry its own limit (a slice's ``MemoryMax=``), so the tightest level wins.

"Uses" is the working set, ``memory.current - inactive_file`` (what the kubelet evicts on): like
``MemAvailable`` on the host, page cache the kernel can drop under pressure is not counted as used.
A model file read once sits in the cgroup's page cache and would otherwise look like a second copy.

cgroup v1, a missing or unreadable file, or ``max`` everywhere: no cgroup figure, the host's stands.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import psutil

CGROUP_MOUNT = Path("sys/fs/cgroup")
PROC_SELF_CGROUP = Path("proc/self/cgroup")


@dataclass(frozen=True)
class Available:
    bytes: int
    source: str  # where the figure comes from, for the budget's lines and refusal


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None


def _own_cgroup(root: Path) -> str | None:
    """This process's cgroup v2 path ("0::/system.slice/x.service"); None on a v1-only host."""
    text = _read(root / PROC_SELF_CGROUP)
    if text is None:
        return None
    for line in text.splitlines():
        if line.startswith("0::"):
            return line[3:]
    return None


def _inactive_file(folder: Path) -> int:
    for line in (_read(folder / "memory.stat") or "").splitlines():
        key, _, value = line.partition(" ")
        if key == "inactive_file" and value.isdigit():
            return int(value)
    return 0


def cgroup_available_bytes(root: Path = Path("/")) -> tuple[int, str] | None:
    """Tightest ``memory.max - working set`` from our cgroup up to the root, with the cgroup named;
    None when no level has a limit (or cgroup v2 is not there)."""
    own = _own_cgroup(root)
    if own is None:
        return None
    mount = root / CGROUP_MOUNT
    # Inside a container's cgroup namespace the path is "/" and the mount is the container's own cgroup.
    parts = [p for p in own.split("/") if p and p != ".."]
    best: tuple[int, str] | None = None
    for depth in range(len(parts), -1, -1):
        folder = mount.joinpath(*parts[:depth])
        limit = _read(folder / "memory.max")
        current = _read(folder / "memory.current")
        if limit is None or limit == "max" or not limit.isdigit() or current is None or not current.isdigit():
            continue
        used = max(0, int(current) - _inactive_file(folder))
        free = max(0, int(limit) - used)
        if best is None or free < best[0]:
            best = (free, "/" + "/".join(parts[:depth]))
    return best


def available(root: Path = Path("/")) -> Available:
    """What the budget compares against: the host's MemAvailable, or the cgroup's room when smaller."""
    host = int(psutil.virtual_memory().available)
    cgroup = cgroup_available_bytes(root)
    if cgroup is not None and cgroup[0] < host:
        return Available(cgroup[0], f"cgroup {cgroup[1]} memory.max")
    return Available(host, "host")
