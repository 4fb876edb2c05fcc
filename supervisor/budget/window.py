"""Sliding-window models and the disk tier: whether the child keeps every layer's full context
(``--swa-full``), and why.

A sliding-window layer (Gemma 3: five of every six) keeps only its window's KV cells (plus a
micro-batch); to resume a prompt whose start has left the window, llama-server copies those cells
into *context checkpoints* (``--ctx-checkpoints``) and finds one covering the new prompt before it
reuses the slot (tools/server/server-context.cpp, "search for a context checkpoint"). A slot save
(``SERVER_TASK_TYPE_SLOT_SAVE``: ``llama_state_seq_save_file``) writes the cells and the tokens only:
the checkpoints stay in ``slot.prompt.checkpoints``, and a restore starts with ``slot->prompt.clear()``,
which drops them. The pinned server has no way to save or load them with a state, so after a restore it
finds no checkpoint and processes the whole prompt again ("forcing full prompt re-processing due to
lack of cache data"): measured with the Gemma 3 demo, 0 % of the reusable maximum (docs/benchmarks.md).

With ``--swa-full`` the sliding layers keep the full context like the others: the saved state is the
whole history, llama-server sets ``n_swa = 0`` and needs (and makes) no checkpoints, and a restore is
reused (99.5 % in the same run). So when the disk tier is on and the model slides, llamagate adds
``--swa-full``; the memory budget counts the full cache and no checkpoints. For the demo model
(2 slots x 4096) that is 144 MiB of KV instead of 54 MiB + 240 MiB of checkpoints (8 per slot): less.
For a model whose window is small against its context the full cache costs more; when it does not fit
where the windowed one does, the tier is off for that model instead (a tier that can restore nothing
would only write), and ``llamagate plan`` says so.
"""

from __future__ import annotations

from dataclasses import dataclass

from supervisor.budget.gguf_info import ModelShape

MIB = 1024 * 1024


def slides(shape: ModelShape) -> bool:
    """The model has sliding-window layers (llama-server makes checkpoints for it without --swa-full).
    A window with no known layer pattern counts as sliding: llama.cpp knows the pattern even when the
    file does not say it (gguf_info)."""
    return bool(shape.sliding_window) and (shape.swa_layers is None or any(shape.swa_layers))


@dataclass(frozen=True)
class WindowChoice:
    """What the child does with a sliding-window model's cache: ``full`` (the KV cache is full-size,
    --swa-full given in extra_args or ``added`` by llamagate) and why; the bytes are the budget's KV
    and checkpoints with the choice and without it (0 when the model does not slide)."""

    slides: bool
    full: bool
    added: bool
    why: str
    kv_bytes: int = 0
    checkpoint_bytes: int = 0
    windowed_kv_bytes: int = 0
    windowed_checkpoint_bytes: int = 0

    @property
    def extra_bytes(self) -> int:
        """What the full cache costs beyond the windowed one and its checkpoints (negative: saves)."""
        return self.kv_bytes + self.checkpoint_bytes - self.windowed_kv_bytes - self.windowed_checkpoint_bytes

    def line(self) -> str:
        if not self.slides:
            return "sliding window: none (every layer keeps the full context)"
        if not self.full:
            return f"sliding window: windowed KV cache ({self.why})"
        how = "--swa-full added" if self.added else "--swa-full (in llama.extra_args)"
        sign = "+" if self.extra_bytes >= 0 else "-"
        return (
            f"sliding window: {how} ({self.why}): KV {self.kv_bytes / MIB:,.0f} MiB and no checkpoints,"
            f" against {self.windowed_kv_bytes / MIB:,.0f} MiB + {self.windowed_checkpoint_bytes / MIB:,.0f}"
            f" MiB of checkpoints windowed: {sign}{abs(self.extra_bytes) / MIB:,.0f} MiB"
        )

    def record(self) -> dict[str, object]:
        return {
            "slides": self.slides,
            "swa_full": self.full,
            "added": self.added,
            "why": self.why,
            "kv_bytes": self.kv_bytes,
            "checkpoint_bytes": self.checkpoint_bytes,
            "windowed_kv_bytes": self.windowed_kv_bytes,
            "windowed_checkpoint_bytes": self.windowed_checkpoint_bytes,
            "extra_bytes": self.extra_bytes,
        }


WHY_TIER = "restores from the disk tier need it: a saved state has no context checkpoints"
WHY_OFF = "the disk tier is off: the RAM prompt cache keeps the checkpoints"
WHY_NO_ROOM = "--swa-full does not fit the memory budget: the disk tier is off for this model"


def choose(shape: ModelShape, *, tier_on: bool, given: bool) -> tuple[bool, bool, str]:
    """(full, added, why): --swa-full when the tier is on and the model slides, unless ``given``
    already in extra_args (then it is not added twice)."""
    if not slides(shape):
        return given, False, "the model has no sliding-window layers"
    if given:
        return True, False, "given in llama.extra_args"
    if tier_on:
        return True, True, WHY_TIER
    return False, False, WHY_OFF
