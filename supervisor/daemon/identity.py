"""The reproducible identity of what is served and where: logged at start, served to admins, and
written beside every benchmark result.

Two records with stable names (the benchmark harness imports them):
``host_identity()``: the machine; ``served_identity(...)``: the binary, the model and the capacity
settings, plus the host. Values are plain JSON types so a record can be dumped as it is.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping
from pathlib import Path

import psutil


def _cpu_model() -> str:
    # /proc/cpuinfo is the only place Linux names the CPU; platform.processor() is often empty.
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return platform.processor() or "unknown"
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("model name", "Hardware", "cpu model"):
            return value.strip()
    return platform.processor() or "unknown"


def _os_name() -> str:
    try:
        text = Path("/etc/os-release").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return platform.system()
    for line in text.splitlines():
        if line.startswith("PRETTY_NAME="):
            return line.split("=", 1)[1].strip().strip('"')
    return platform.system()


def host_identity() -> dict[str, object]:
    """CPU model, logical and physical cores, memory, OS, kernel, Python."""
    affinity: int | None
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = None
    return {
        "cpu_model": _cpu_model(),
        "cpu_logical": psutil.cpu_count(logical=True),
        "cpu_physical": psutil.cpu_count(logical=False),
        # A container or taskset may allow fewer CPUs than the host has; that is what we run on.
        "cpu_usable": affinity,
        "memory_total_bytes": psutil.virtual_memory().total,
        "os": _os_name(),
        "kernel": platform.release(),
        "machine": platform.machine(),
        "python": sys.version.split()[0],
    }


def served_identity(
    *,
    binary: Path,
    binary_sha256: str,
    build: Mapping[str, object] | None,
    model: Path,
    model_size: int,
    model_sha256: str,
    alias: str,
    serving: Mapping[str, object],
    host: Mapping[str, object] | None = None,
) -> dict[str, object]:
    """Everything needed to say what a number was measured on. ``build`` is the build receipt's
    facts (llama.cpp commit, build info, cmake args, compiler); None for a binary we did not build.
    ``serving``: the child's knobs (``prepare.serving_record``: threads, slots, context, caches...)."""
    return {
        "llama_cpp": dict(build) if build is not None else {"source": "external binary (no receipt)"},
        "binary": {"path": str(binary), "sha256": binary_sha256},
        "model": {"path": str(model), "size_bytes": model_size, "sha256": model_sha256, "alias": alias},
        "serving": dict(serving),
        "host": dict(host) if host is not None else host_identity(),
    }


def flatten(record: Mapping[str, object], prefix: str = "") -> dict[str, object]:
    """``{"model": {"sha256": x}}`` -> ``{"model.sha256": x}``: one log field per fact."""
    out: dict[str, object] = {}
    for key, value in record.items():
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
