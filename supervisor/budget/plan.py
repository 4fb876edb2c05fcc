"""The memory budget of the capacity model, checked against the memory available (the host's, or the
room left under a cgroup limit: see memlimit) minus a configured headroom before anything is launched:

  weights         the model file (mapped)
  KV state        per slot, from the GGUF header (kvmath)
  runtime         compute buffers, vocabulary, threads, HTTP server, the binary's own pages
  prompt cache    llama-server's cache of earlier prompts' states (--cache-ram, set from the config)
  checkpoints     context checkpoints of sliding-window models (--ctx-checkpoints x slots, kvmath)

The last two are set explicitly because llama-server's defaults are an 8 GiB prompt cache and 32
checkpoints per slot: seen with the demo model (2 x 4096), RSS grew by ~21 MiB for every distinct
~780-token prompt without a cache limit and stayed flat at 483 MiB with ``--cache-ram 64``.

Runtime allowance: RUNTIME_BASE_BYTES + RUNTIME_WEIGHTS_FRACTION x weights. Where the numbers come
from: the demo model (gemma-3-270m Q4_K_M, a 241 MiB file) served by the pinned build with 2 slots x
4096 measured RSS 374 MiB on the 2-core dev machine after a completion (smaps_rollup: 246 MiB
file-backed = model + binary, 127 MiB anonymous), i.e. 79 MiB beyond the weights and the 54 MiB of KV;
at 2 x 32768 it measured 538 MiB against 241 + 222 MiB, 75 MiB beyond. 128 MiB + 5 % of the weights
(140 MiB here) leaves a margin over that and grows with wider models, whose compute buffers grow
with the hidden size. An integration test checks the real child's RSS stays under the budget.

With ``gpu_layers`` > 0 on a GPU build (``Offload``), the budget has a second side, the device's:
  weights         the offloaded layers' share of the file: llama.cpp offloads the repeating layers
                  first and the output layer last (-ngl above the layer count), the token embeddings
                  never; estimated as the file times offloaded / (layers + 1)
  KV state        the offloaded layers' share of the KV cache (their cells live with their layers)
  compute         DEVICE_COMPUTE_BYTES + 5 % of the device's weights (the device's compute buffer)
The host keeps the rest. The device's free memory comes from ``llama-server --list-devices``
(``budget.devices``); where it could not be read, the budget says so, checks the host side only, and
budgets the host for everything (a llama-server that finds no device keeps the layers there). A software
device (Mesa's lavapipe) has no memory of its own: its side is added to the host's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from supervisor.budget import memlimit
from supervisor.budget.devices import Device
from supervisor.budget.gguf_info import ModelShape
from supervisor.budget.kvmath import N_UBATCH, bytes_per_element, checkpoint_bytes, kv_bytes

__all__ = [
    "MIB",
    "N_UBATCH",
    "Budget",
    "DeviceSide",
    "Offload",
    "bytes_per_element",
    "checkpoint_bytes",
    "kv_bytes",
    "plan_budget",
]

MIB = 1024 * 1024
RUNTIME_BASE_BYTES = 128 * MIB
RUNTIME_WEIGHTS_FRACTION = 0.05
DEVICE_COMPUTE_BYTES = 64 * MIB
# Where /proc and /sys are read from (tests point it at a fake tree).
CGROUP_ROOT = Path("/")


def runtime_bytes(weights: int) -> int:
    return RUNTIME_BASE_BYTES + int(RUNTIME_WEIGHTS_FRACTION * weights)


def available_bytes() -> int:
    # "available" (MemAvailable) counts reclaimable page cache, which is what a new process can get
    # without swapping; "free" would refuse on any machine that has been up for a while. Inside a
    # cgroup limit (systemd MemoryMax, a container) the room left under it, when smaller.
    return memlimit.available(CGROUP_ROOT).bytes


@dataclass(frozen=True)
class Offload:
    """Layers offloaded to a device, and what is known of the device (``budget.devices``)."""

    gpu_layers: int
    device: Device | None  # None: not known (see note)
    note: str | None = None  # why the device or its memory could not be read


@dataclass(frozen=True)
class DeviceSide:
    """The device's share of the model and what its driver reports it has free."""

    layers: int  # offloaded, of layers + 1 (the output layer)
    of_layers: int
    weights_bytes: int
    kv_bytes: int
    compute_bytes: int
    device: Device | None
    note: str | None

    @property
    def required_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.compute_bytes

    @property
    def free_bytes(self) -> int | None:
        """What the device has free, when it has memory of its own and reports it."""
        return None if self.device is None or self.device.on_host else self.device.free_bytes

    @property
    def fits(self) -> bool:
        free = self.free_bytes
        return free is None or self.required_bytes <= free

    def as_dict(self) -> dict[str, object]:
        return {
            "layers": f"{self.layers}/{self.of_layers}",
            "weights_bytes": self.weights_bytes,
            "kv_bytes": self.kv_bytes,
            "compute_bytes": self.compute_bytes,
            "required_bytes": self.required_bytes,
            "device": None if self.device is None else self.device.as_dict(),
            "free_bytes": self.free_bytes,
            "fits": self.fits,
            "note": self.note,
        }

    def lines(self) -> list[str]:
        def mib(n: int) -> str:
            return f"{n / MIB:,.0f} MiB"

        d = self.device
        head = f"device {d.name}: {d.description}" if d is not None else "device (not known)"
        out = [
            head,
            f"  weights ({self.layers}/{self.of_layers} layers)".ljust(27) + f"{mib(self.weights_bytes):>12}",
            f"  KV state (their layers)  {mib(self.kv_bytes):>12}",
            f"  compute buffers          {mib(self.compute_bytes):>12}",
            f"  required on the device   {mib(self.required_bytes):>12}",
        ]
        if d is not None and d.on_host:
            out.append(
                f"  memory                   host RAM ({d.description}): counted on the host side above"
            )
        elif d is not None:
            out.append(
                f"  free on the device       {mib(d.free_bytes):>12}  ({mib(d.total_bytes)} total, reported)"
            )
        if self.note:
            out.append(f"  not read: {self.note}; not checked, and the host is budgeted for everything")
        return out


@dataclass(frozen=True)
class Budget:
    weights_bytes: int
    kv_bytes: int
    runtime_bytes: int
    available_bytes: int
    headroom_bytes: int
    slots: int
    ctx_per_slot: int
    # Largest settings that would fit, to say what to change (0 = nothing fits).
    max_ctx_per_slot: int
    max_slots: int
    available_source: str = "host"  # or "cgroup /x.slice/y.service memory.max"
    prompt_cache_bytes: int = 0
    checkpoint_bytes: int = 0
    ctx_checkpoints: int = 0  # per slot
    # One sequence's saved state (KV cells and checkpoints) at 1,024 tokens and at a full slot: what a
    # conversation costs in the prompt cache, which keeps the states the slots give up.
    state_1k_bytes: int = 0
    state_full_bytes: int = 0
    # With layers offloaded: the device's side. weights_bytes and kv_bytes above are then the host's.
    device: DeviceSide | None = None

    @property
    def device_on_host_bytes(self) -> int:
        """The device side when its memory is host RAM (lavapipe), else 0."""
        d = self.device
        return d.required_bytes if d is not None and d.device is not None and d.device.on_host else 0

    @property
    def required_bytes(self) -> int:
        """Host memory."""
        return (
            self.weights_bytes
            + self.kv_bytes
            + self.runtime_bytes
            + self.prompt_cache_bytes
            + self.checkpoint_bytes
            + self.device_on_host_bytes
        )

    @property
    def usable_bytes(self) -> int:
        return max(0, self.available_bytes - self.headroom_bytes)

    @property
    def fits(self) -> bool:
        return self.required_bytes <= self.usable_bytes and (self.device is None or self.device.fits)

    def as_dict(self) -> dict[str, object]:
        return {
            "weights_bytes": self.weights_bytes,
            "kv_bytes": self.kv_bytes,
            "runtime_bytes": self.runtime_bytes,
            "prompt_cache_bytes": self.prompt_cache_bytes,
            "checkpoint_bytes": self.checkpoint_bytes,
            "required_bytes": self.required_bytes,
            "available_bytes": self.available_bytes,
            "headroom_bytes": self.headroom_bytes,
            "usable_bytes": self.usable_bytes,
            "fits": self.fits,
            "max_ctx_per_slot": self.max_ctx_per_slot,
            "max_slots": self.max_slots,
            "device": None if self.device is None else self.device.as_dict(),
        }

    def lines(self) -> list[str]:
        def mib(n: int) -> str:
            return f"{n / MIB:,.0f} MiB"

        on_device = self.device is not None
        split = on_device and self.device is not None and self.device.device is not None  # a known device
        weights = "weights (host's share)" if split else "weights (model file)"
        kv = "KV state (host's share)" if split else f"KV state ({self.slots} x {self.ctx_per_slot} tokens)"
        device_on_host = (
            [f"device memory (host RAM)   {mib(self.device_on_host_bytes):>12}"]
            if self.device_on_host_bytes
            else []
        )
        return [
            *(["host:"] if on_device else []),
            f"{weights:<27}{mib(self.weights_bytes):>12}",
            f"{kv:<27}{mib(self.kv_bytes):>12}",
            f"runtime allowance          {mib(self.runtime_bytes):>12}",
            f"prompt cache               {mib(self.prompt_cache_bytes):>12}",
            f"checkpoints ({self.slots} x {self.ctx_checkpoints})".ljust(27)
            + f"{mib(self.checkpoint_bytes):>12}",
            *device_on_host,
            f"required                   {mib(self.required_bytes):>12}",
            f"available minus headroom   {mib(self.usable_bytes):>12}"
            f"  ({mib(self.available_bytes)} available{self._where()} - {mib(self.headroom_bytes)} headroom)",
            *self._warm(),
            *(self.device.lines() if self.device is not None else []),
        ]

    def _warm(self) -> list[str]:
        """How many conversations the host keeps warm: one per slot, and what the prompt cache holds."""
        if not (self.prompt_cache_bytes and self.state_1k_bytes and self.state_full_bytes):
            return [f"conversations kept warm    {self.slots:>12}  (one per slot; no prompt cache)"]
        short = self.prompt_cache_bytes // self.state_1k_bytes
        full = self.prompt_cache_bytes // self.state_full_bytes
        return [
            f"conversations kept warm    {self.slots + short:>12,}  of 1,024 tokens "
            f"({self.slots} in the slots + {short:,} in the prompt cache at "
            f"{self.state_1k_bytes / MIB:,.1f} MiB each); {self.slots + full:,} of {self.ctx_per_slot:,}"
        ]

    def _where(self) -> str:
        return "" if self.available_source == "host" else f" under the {self.available_source} limit"

    def refusal(self) -> str:
        def mib(n: int) -> str:
            return f"{n / MIB:,.0f} MiB"

        advice = []
        if self.max_ctx_per_slot:
            advice.append(f"llama.ctx_per_slot <= {self.max_ctx_per_slot} (now {self.ctx_per_slot})")
        if self.max_slots:
            advice.append(f"llama.slots <= {self.max_slots} (now {self.slots})")
        if self.prompt_cache_bytes:
            advice.append(f"a smaller llama.prompt_cache_mib (now {self.prompt_cache_bytes // MIB})")
        if self.checkpoint_bytes:
            advice.append(f"fewer llama.ctx_checkpoints (now {self.ctx_checkpoints})")
        advice.append("a lower supervision.memory_headroom_mib, or a smaller model")
        d = self.device
        if d is not None and not d.fits and d.device is not None:
            return (
                f"memory budget does not fit on {d.device.name} ({d.device.description}): needs "
                f"{mib(d.required_bytes)} (weights {mib(d.weights_bytes)} + KV {mib(d.kv_bytes)} + compute "
                f"{mib(d.compute_bytes)}) for {d.layers}/{d.of_layers} layers, but it reports "
                f"{mib(d.device.free_bytes)} free. Change: fewer llama.gpu_layers, or " + "; or ".join(advice)
            )
        return (
            f"memory budget does not fit: needs {mib(self.required_bytes)} (weights {mib(self.weights_bytes)}"
            f" + KV {mib(self.kv_bytes)} + runtime {mib(self.runtime_bytes)} + prompt cache "
            f"{mib(self.prompt_cache_bytes)} + checkpoints {mib(self.checkpoint_bytes)}), but only "
            f"{mib(self.usable_bytes)} is usable ({mib(self.available_bytes)} available{self._where()} - "
            f"{mib(self.headroom_bytes)} headroom). Change: " + "; or ".join(advice)
        )


def plan_budget(
    shape: ModelShape,
    *,
    weights: int,
    slots: int,
    ctx_per_slot: int,
    type_k: str,
    type_v: str,
    headroom_bytes: int,
    available: int | None = None,
    available_source: str = "host",
    extra_available: int = 0,
    prompt_cache_bytes: int = 0,
    ctx_checkpoints: int = 0,
    swa_full: bool = False,
    n_ubatch: int = N_UBATCH,
    offload: Offload | None = None,
) -> Budget:
    """``available``: measured here when None. ``extra_available``: memory freed before the launch
    (a child about to be replaced), added to it. ``swa_full``/``n_ubatch``: from llama.extra_args.
    ``offload``: layers on a device (a GPU build with gpu_layers > 0): the budget's second side."""
    if available is None:
        measured = memlimit.available(CGROUP_ROOT)
        available, available_source = measured.bytes, measured.source
    avail = available + extra_available
    usable = max(0, avail - headroom_bytes)
    runtime = runtime_bytes(weights)

    def kv(s: int, c: int) -> int:
        return kv_bytes(
            shape, ctx_per_slot=c, slots=s, type_k=type_k, type_v=type_v, swa_full=swa_full, n_ubatch=n_ubatch
        )

    def checkpoints(s: int, c: int) -> int:
        if swa_full:
            return 0  # llama-server makes none: the full cache can roll back
        one = checkpoint_bytes(shape, ctx_per_slot=c, type_k=type_k, type_v=type_v, n_ubatch=n_ubatch)
        return s * ctx_checkpoints * one

    layers = max(1, shape.layers)
    on = min(offload.gpu_layers, layers + 1) if offload is not None else 0
    weights_on_device = weights * on // (layers + 1)

    def kv_on_device(s: int, c: int) -> int:
        return kv(s, c) * min(on, layers) // layers

    def side(s: int, c: int) -> DeviceSide | None:
        if offload is None or on == 0:
            return None
        compute = DEVICE_COMPUTE_BYTES + int(RUNTIME_WEIGHTS_FRACTION * weights_on_device)
        return DeviceSide(
            on, layers + 1, weights_on_device, kv_on_device(s, c), compute, offload.device, offload.note
        )

    # What leaves the host: the device's share, once the device is known. Unknown (not listed, the binary
    # not built yet), the host is budgeted for everything: llama-server finding no device keeps the
    # layers on the host, and a budget that guessed otherwise would let the host run out.
    known = offload is not None and offload.device is not None
    moved_weights = weights_on_device if known else 0

    def moved_kv(s: int, c: int) -> int:
        return kv_on_device(s, c) if known else 0

    def need(s: int, c: int) -> int:
        host = weights - moved_weights + runtime + prompt_cache_bytes + kv(s, c) - moved_kv(s, c)
        return host + checkpoints(s, c)

    def fits(s: int, c: int) -> bool:
        d = side(s, c)
        on_host = d.required_bytes if d is not None and d.device is not None and d.device.on_host else 0
        return need(s, c) + on_host <= usable and (d is None or d.fits)

    # The need grows monotonically in both settings, so the largest fitting value is found by bisection.
    def largest(lo: int, hi: int, fits: Callable[[int], bool]) -> int:
        best = 0
        while lo <= hi:
            mid = (lo + hi) // 2
            if fits(mid):
                best, lo = mid, mid + 1
            else:
                hi = mid - 1
        return best

    max_ctx = 256 * largest(1, max(1, ctx_per_slot // 256), lambda k: fits(slots, 256 * k))
    max_slots = largest(1, slots, lambda s: fits(s, ctx_per_slot))
    return Budget(
        weights_bytes=weights - moved_weights,
        kv_bytes=kv(slots, ctx_per_slot) - moved_kv(slots, ctx_per_slot),
        runtime_bytes=runtime,
        available_bytes=avail,
        headroom_bytes=headroom_bytes,
        slots=slots,
        ctx_per_slot=ctx_per_slot,
        max_ctx_per_slot=max_ctx,
        max_slots=max_slots,
        available_source=available_source,
        prompt_cache_bytes=prompt_cache_bytes,
        checkpoint_bytes=checkpoints(slots, ctx_per_slot),
        ctx_checkpoints=ctx_checkpoints,
        state_1k_bytes=kv(1, min(1024, ctx_per_slot)) + checkpoints(1, min(1024, ctx_per_slot)),
        state_full_bytes=kv(1, ctx_per_slot) + checkpoints(1, ctx_per_slot),
        device=side(slots, ctx_per_slot),
    )
