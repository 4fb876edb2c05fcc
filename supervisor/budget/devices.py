"""The GPU devices a llama-server build sees, and their memory, from its own ``--list-devices``.

``llama-server --list-devices`` prints every non-CPU device of the backends the build has, one line each
(common/arg.cpp, ``common_print_available_devices``)::

    Available devices:
      Vulkan0: llvmpipe (LLVM 15.0.6, 256 bits) (2048 MiB, 2048 MiB free)

The memory is what the driver reports (``ggml_backend_dev_memory``). It is run with the child's own
environment (the knobs' variables such as GGML_VK_VISIBLE_DEVICES), so it lists what the child will see.
A device whose memory is host RAM (Mesa's llvmpipe, "lavapipe") is marked so that the budget counts its
share on the host side, where it really lives.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from supervisor.launch.flags import build_env
from supervisor.launch.knobs import LlamaKnobs

MIB = 1024 * 1024
_LINE = re.compile(
    r"^\s+(?P<name>[A-Za-z][A-Za-z0-9_]*): (?P<desc>.*) \((?P<total>\d+) MiB, (?P<free>\d+) MiB free\)$"
)
# Software Vulkan devices whose "device memory" is ordinary host memory.
_ON_HOST = ("llvmpipe", "lavapipe", "swiftshader")


@dataclass(frozen=True)
class Device:
    name: str  # what --device takes: Vulkan0, CUDA0
    description: str  # the driver's name for it: "llvmpipe (LLVM 15.0.6, 256 bits)"
    total_bytes: int
    free_bytes: int

    @property
    def on_host(self) -> bool:
        """Its memory is host RAM (a software device): the budget counts it there."""
        return any(word in self.description.lower() for word in _ON_HOST)

    def as_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "description": self.description,
            "total_bytes": self.total_bytes,
            "free_bytes": self.free_bytes,
            "memory_on_host": self.on_host,
        }


@dataclass(frozen=True)
class Devices:
    """What ``--list-devices`` said, or why it could not be read (``note``)."""

    listed: tuple[Device, ...]
    note: str | None = None

    def chosen(self, device: str | None) -> Device | None:
        """The device the layers go to: the first one ``--device`` names, else the first listed
        (llama-server splits layers over every device; the first carries the largest share)."""
        if device == "none":
            return None
        wanted = device.split(",")[0] if device else None
        return next((d for d in self.listed if wanted is None or d.name == wanted), None)


def parse_list_devices(text: str) -> tuple[Device, ...]:
    out = []
    for line in text.splitlines():
        m = _LINE.match(line.rstrip())
        if m:
            total, free = int(m["total"]) * MIB, int(m["free"]) * MIB
            out.append(Device(m["name"], m["desc"], total, free))
    return tuple(out)


def list_devices(binary: Path, knobs: LlamaKnobs, timeout_s: float = 60.0) -> Devices:
    """Run ``binary --list-devices`` as the child would run (scrubbed environment plus the knobs')."""
    with tempfile.TemporaryDirectory(prefix="llamagate-devices-") as tmp:
        (Path(tmp) / "config").mkdir()
        env = build_env("unused", Path(tmp), knobs)
        try:
            done = subprocess.run(
                [str(binary), "--list-devices"],
                capture_output=True,
                text=True,
                errors="replace",
                env=env,
                timeout=timeout_s,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return Devices((), f"{binary} --list-devices did not run: {exc}")
    output = done.stdout + done.stderr
    listed = parse_list_devices(output)
    if done.returncode != 0:
        return Devices(listed, f"{binary} --list-devices exited {done.returncode}: {_last(output)}")
    if not listed:
        return Devices((), f"{binary} --list-devices lists no device{_hint(knobs)}")
    return Devices(listed)


def _last(output: str) -> str:
    lines = [ln for ln in output.splitlines() if ln.strip()]
    return lines[-1].strip() if lines else "(no output)"


def _hint(knobs: LlamaKnobs) -> str:
    if knobs.vulkan_devices is None:
        return (
            " (the vulkan build skips CPU-type devices such as lavapipe unless llama.vulkan_devices names"
            " them; vulkaninfo --summary lists them by index)"
        )
    return ""
