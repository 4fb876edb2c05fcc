"""Bytes of sequence state llama-server holds per slot, from the GGUF header (the budget's arithmetic).

KV cache, as llama.cpp at the pinned commit allocates it (src/llama-kv-cache*.cpp), with ``-np``
explicit so each slot is its own stream (``kv_unified = false``):
  per layer: cells x slots x kv_heads x (key_length x bytes(type_k) + value_length x bytes(type_v))
  cells = ctx_per_slot for full-attention layers; for sliding-window layers
  pad256(min(ctx_per_slot, window + n_ubatch)) (llama_kv_cache_iswa), or ctx_per_slot with
  ``--swa-full``. Which layers slide comes from the GGUF or a verified per-architecture default (see
  gguf_info); when unknown, every layer is counted with the full context, which can only overestimate.

Context checkpoints (tools/server/server-context.cpp ``create_checkpoint``): for a model with
sliding-window layers (and no ``--swa-full``) the server copies the part of a slot's state that cannot
be rolled back, the sliding layers' cells, up to ``--ctx-checkpoints`` times per slot, to resume a
conversation whose prefix has left the window. One checkpoint is at most those layers' cells of one
slot. Measured with gemma-3-270m (2 x 4096, no prompt cache): a conversation growing ~330 tokens a turn
added ~15 MiB of RSS a turn with 32 checkpoints and nothing with 0; 15 layers x 1024 cells x 1 KiB is
15 MiB.
"""

from __future__ import annotations

from supervisor.budget.gguf_info import ModelShape, gguf_constants

# llama-server's default micro-batch (-ub); the SWA cache keeps this many cells beyond the window.
N_UBATCH = 512


def bytes_per_element(cache_type: str) -> float:
    quant = gguf_constants.GGMLQuantizationType[cache_type.upper()]
    block, size = gguf_constants.GGML_QUANT_SIZES[quant]
    return float(size) / float(block)


def _pad256(n: int) -> int:
    return (n + 255) // 256 * 256


def _per_cell(shape: ModelShape, type_k: str, type_v: str) -> float:
    """Bytes of one cell of one KV head: its key and its value."""
    return shape.key_length * bytes_per_element(type_k) + shape.value_length * bytes_per_element(type_v)


def _swa_cells(shape: ModelShape, ctx_per_slot: int, n_ubatch: int) -> int | None:
    if not shape.sliding_window:
        return None
    return _pad256(min(ctx_per_slot, shape.sliding_window + n_ubatch))


def kv_bytes(
    shape: ModelShape,
    *,
    ctx_per_slot: int,
    slots: int,
    type_k: str,
    type_v: str,
    swa_full: bool = False,
    n_ubatch: int = N_UBATCH,
) -> int:
    per_cell = _per_cell(shape, type_k, type_v)
    swa = None if swa_full else _swa_cells(shape, ctx_per_slot, n_ubatch)
    total = 0.0
    for il in range(shape.layers):
        cells = ctx_per_slot
        if swa is not None and shape.swa_layers is not None and shape.swa_layers[il]:
            cells = swa
        total += cells * slots * shape.kv_heads[il] * per_cell
    return int(total)


def checkpoint_bytes(
    shape: ModelShape, *, ctx_per_slot: int, type_k: str, type_v: str, n_ubatch: int = N_UBATCH
) -> int:
    """Largest context checkpoint of one slot; 0 for a model without sliding-window layers. When the
    file does not say which layers slide, every layer is counted (an overestimate)."""
    swa = _swa_cells(shape, ctx_per_slot, n_ubatch)
    if swa is None:
        return 0
    per_cell = _per_cell(shape, type_k, type_v)
    sliding = shape.swa_layers or (True,) * shape.layers
    return int(sum(swa * shape.kv_heads[il] * per_cell for il in range(shape.layers) if sliding[il]))
