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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from supervisor.budget import memlimit
from supervisor.budget.gguf_info import ModelShape
from supervisor.budget.kvmath import N_UBATCH, bytes_per_element, checkpoint_bytes, kv_bytes

__all__ = ["MIB", "N_UBATCH", "Budget", "bytes_per_element", "checkpoint_bytes", "kv_bytes", "plan_budget"]

MIB = 1024 * 1024
RUNTIME_BASE_BYTES = 128 * MIB
RUNTIME_WEIGHTS_FRACTION = 0.05
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

    @property
    def required_bytes(self) -> int:
        return (
            self.weights_bytes
            + self.kv_bytes
            + self.runtime_bytes
            + self.prompt_cache_bytes
            + self.checkpoint_bytes
        )

    @property
    def usable_bytes(self) -> int:
        return max(0, self.available_bytes - self.headroom_bytes)

    @property
    def fits(self) -> bool:
        return self.required_bytes <= self.usable_bytes

    def as_dict(self) -> dict[str, int | bool]:
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
        }

    def lines(self) -> list[str]:
        def mib(n: int) -> str:
            return f"{n / MIB:,.0f} MiB"

        return [
            f"weights (model file)       {mib(self.weights_bytes):>12}",
            f"KV state ({self.slots} x {self.ctx_per_slot} tokens)".ljust(27) + f"{mib(self.kv_bytes):>12}",
            f"runtime allowance          {mib(self.runtime_bytes):>12}",
            f"prompt cache               {mib(self.prompt_cache_bytes):>12}",
            f"checkpoints ({self.slots} x {self.ctx_checkpoints})".ljust(27)
            + f"{mib(self.checkpoint_bytes):>12}",
            f"required                   {mib(self.required_bytes):>12}",
            f"available minus headroom   {mib(self.usable_bytes):>12}"
            f"  ({mib(self.available_bytes)} available{self._where()} - {mib(self.headroom_bytes)} headroom)",
            *self._warm(),
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
) -> Budget:
    """``available``: measured here when None. ``extra_available``: memory freed before the launch
    (a child about to be replaced), added to it. ``swa_full``/``n_ubatch``: from llama.extra_args."""
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

    def need(s: int, c: int) -> int:
        return weights + runtime + prompt_cache_bytes + kv(s, c) + checkpoints(s, c)

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

    max_ctx = 256 * largest(1, max(1, ctx_per_slot // 256), lambda k: need(slots, 256 * k) <= usable)
    max_slots = largest(1, slots, lambda s: need(s, ctx_per_slot) <= usable)
    return Budget(
        weights_bytes=weights,
        kv_bytes=kv(slots, ctx_per_slot),
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
    )
