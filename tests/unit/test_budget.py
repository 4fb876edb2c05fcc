"""Memory budget: KV bytes from the GGUF header, the three numbers, and what to change."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import gguf
import pytest

from supervisor.budget import (
    MIB,
    Budget,
    bytes_per_element,
    checkpoint_bytes,
    kv_bytes,
    plan_budget,
    runtime_bytes,
)
from supervisor.errors import NotAGguf
from supervisor.gguf_info import ModelShape, read_shape


def write_gguf(path: Path, arch: str = "llama", **kv: object) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(int(kv.get("layers", 4)))  # type: ignore[call-overload]
    w.add_head_count(8)
    w.add_head_count_kv(kv.get("kv", 2))  # type: ignore[arg-type]
    w.add_embedding_length(512)
    w.add_context_length(2048)
    if "key_length" in kv:
        w.add_key_length(int(kv["key_length"]))  # type: ignore[call-overload]
        w.add_value_length(int(kv["key_length"]))  # type: ignore[call-overload]
    if "window" in kv:
        w.add_sliding_window(int(kv["window"]))  # type: ignore[call-overload]
    # A vocabulary big enough that reading it element by element would show.
    w.add_token_list([f"tok{i}" for i in range(50_000)])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    return path


def full_shape(layers: int = 4, kv: int = 2, head: int = 64) -> ModelShape:
    return ModelShape("llama", layers, 8, (kv,) * layers, head, head, 2048, None, None)


def test_bytes_per_element() -> None:
    assert bytes_per_element("f16") == 2
    assert bytes_per_element("f32") == 4
    assert bytes_per_element("q8_0") == 34 / 32
    assert bytes_per_element("q4_0") == 18 / 32


def test_kv_bytes_is_the_textbook_formula_without_sliding_window() -> None:
    shape = full_shape(layers=32, kv=8, head=128)
    got = kv_bytes(shape, ctx_per_slot=4096, slots=4, type_k="f16", type_v="f16")
    assert got == 2 * 32 * 8 * 128 * 2 * 4096 * 4
    q8 = kv_bytes(shape, ctx_per_slot=4096, slots=4, type_k="q8_0", type_v="q8_0")
    assert q8 == int(got * 34 / 32 / 2)


def test_sliding_window_layers_hold_window_plus_ubatch_cells() -> None:
    # gemma-3-270m: 18 layers, 1 KV head of 256, window 512, every 6th layer global.
    swa = tuple(il % 6 < 5 for il in range(18))
    shape = ModelShape("gemma3", 18, 4, (1,) * 18, 256, 256, 32768, 512, swa)
    per_cell = 256 * 2 * 2  # K and V, f16
    got = kv_bytes(shape, ctx_per_slot=4096, slots=2, type_k="f16", type_v="f16")
    # 3 global layers x 4096 cells, 15 sliding layers x pad256(512 + 512) = 1024 cells; 2 slots each.
    assert got == (3 * 4096 + 15 * 1024) * 2 * per_cell
    # A context smaller than the window: the sliding layers cannot hold more than the context.
    small = kv_bytes(shape, ctx_per_slot=512, slots=1, type_k="f16", type_v="f16")
    assert small == 18 * 512 * per_cell


def test_read_shape_from_a_gguf_header(tmp_path: Path) -> None:
    shape = read_shape(write_gguf(tmp_path / "m.gguf", kv=[2, 2, 4, 4]))
    assert shape.architecture == "llama"
    assert shape.layers == 4
    assert shape.kv_heads == (2, 2, 4, 4)
    assert (shape.key_length, shape.value_length) == (64, 64)  # default: embedding / heads
    assert shape.sliding_window is None and shape.swa_layers is None


def test_read_shape_explicit_head_size_and_gemma3_window(tmp_path: Path) -> None:
    shape = read_shape(
        write_gguf(tmp_path / "g.gguf", arch="gemma3", layers=12, kv=1, key_length=256, window=512)
    )
    assert (shape.key_length, shape.sliding_window) == (256, 512)
    assert shape.swa_layers == tuple(il % 6 < 5 for il in range(12))


def test_unknown_architecture_with_a_window_counts_every_layer_in_full(tmp_path: Path) -> None:
    shape = read_shape(write_gguf(tmp_path / "x.gguf", arch="mystery", window=512))
    assert shape.swa_layers is None
    assert kv_bytes(shape, ctx_per_slot=4096, slots=1, type_k="f16", type_v="f16") == 4 * 2 * 64 * 4 * 4096


def test_not_a_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + os.urandom(64))
    with pytest.raises(NotAGguf):
        read_shape(bad)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(NotAGguf):
        read_shape(empty)
    good = write_gguf(tmp_path / "t.gguf")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(good.read_bytes()[:200])
    with pytest.raises(NotAGguf, match="truncated"):
        read_shape(truncated)


def test_budget_numbers_and_fit() -> None:
    shape = full_shape()
    b = plan_budget(
        shape,
        weights=500 * MIB,
        slots=2,
        ctx_per_slot=4096,
        type_k="f16",
        type_v="f16",
        headroom_bytes=1024 * MIB,
        available=8192 * MIB,
    )
    assert b.fits
    assert b.kv_bytes == kv_bytes(shape, ctx_per_slot=4096, slots=2, type_k="f16", type_v="f16")
    assert b.runtime_bytes == runtime_bytes(500 * MIB)
    assert b.required_bytes == b.weights_bytes + b.kv_bytes + b.runtime_bytes
    assert b.usable_bytes == 7168 * MIB


def test_refusal_names_the_three_numbers_and_what_to_change() -> None:
    shape = full_shape(layers=32, kv=8, head=128)  # 128 KiB per token per slot at f16
    weights = 4000 * MIB
    b = plan_budget(
        shape,
        weights=weights,
        slots=8,
        ctx_per_slot=32768,
        type_k="f16",
        type_v="f16",
        headroom_bytes=1024 * MIB,
        available=16384 * MIB,
    )
    assert not b.fits
    text = b.refusal()
    for number in (b.required_bytes, b.weights_bytes, b.kv_bytes, b.runtime_bytes, b.usable_bytes):
        assert f"{number / MIB:,.0f} MiB" in text
    assert f"llama.ctx_per_slot <= {b.max_ctx_per_slot} (now 32768)" in text
    assert f"llama.slots <= {b.max_slots} (now 8)" in text

    def need(slots: int, ctx: int) -> int:
        return (
            weights
            + runtime_bytes(weights)
            + kv_bytes(shape, ctx_per_slot=ctx, slots=slots, type_k="f16", type_v="f16")
        )

    # The advice is the largest setting that fits, not a guess.
    assert need(8, b.max_ctx_per_slot) <= b.usable_bytes < need(8, b.max_ctx_per_slot + 256)
    assert need(b.max_slots, 32768) <= b.usable_bytes < need(b.max_slots + 1, 32768)


def test_nothing_fits_when_the_weights_alone_do_not() -> None:
    b = plan_budget(
        full_shape(),
        weights=10_000 * MIB,
        slots=1,
        ctx_per_slot=256,
        type_k="f16",
        type_v="f16",
        headroom_bytes=0,
        available=1024 * MIB,
    )
    assert not b.fits and b.max_ctx_per_slot == 0 and b.max_slots == 0
    assert "smaller model" in b.refusal()


GEMMA = ModelShape("gemma3", 18, 4, (1,) * 18, 256, 256, 32768, 512, tuple(il % 6 < 5 for il in range(18)))


def gemma_budget(**over: Any) -> Budget:
    """The demo model's shape, 2 slots x 4096, f16, plenty of memory unless ``over`` says otherwise."""
    args: dict[str, Any] = dict(
        weights=241 * MIB,
        slots=2,
        ctx_per_slot=4096,
        type_k="f16",
        type_v="f16",
        headroom_bytes=0,
        available=64 * 1024 * MIB,
    )
    return plan_budget(GEMMA, **{**args, **over})


def test_context_checkpoints_hold_the_sliding_layers_of_one_slot() -> None:
    # Measured with the pinned build and gemma-3-270m (2 slots x 4096, no prompt cache): a conversation
    # whose prompt grows by ~330 tokens a turn grew RSS by ~15 MiB a turn with 32 checkpoints per slot
    # and not at all with 0. One checkpoint is the slot's sliding-window state: 15 layers x 1024 cells.
    per_cell = 256 * 2 * 2
    assert checkpoint_bytes(GEMMA, ctx_per_slot=4096, type_k="f16", type_v="f16") == 15 * 1024 * per_cell
    # Without sliding-window layers, llama-server makes no checkpoints.
    assert checkpoint_bytes(full_shape(), ctx_per_slot=4096, type_k="f16", type_v="f16") == 0


def test_prompt_cache_and_checkpoints_are_in_the_budget() -> None:
    # llama-server's defaults (an 8 GiB prompt cache, 32 checkpoints per slot) grow its RSS far past the
    # KV cache: the supervisor sets both and the budget counts them.
    b = gemma_budget(prompt_cache_bytes=256 * MIB, ctx_checkpoints=8)
    one = checkpoint_bytes(GEMMA, ctx_per_slot=4096, type_k="f16", type_v="f16")
    assert b.prompt_cache_bytes == 256 * MIB
    assert b.checkpoint_bytes == 2 * 8 * one
    assert b.required_bytes == (
        b.weights_bytes + b.kv_bytes + b.runtime_bytes + b.prompt_cache_bytes + b.checkpoint_bytes
    )
    text = "\n".join(b.lines())
    assert "prompt cache" in text and "checkpoints (2 x 8)" in text
    assert b.as_dict()["prompt_cache_bytes"] == 256 * MIB


def test_refusal_names_the_cache_settings_too() -> None:
    b = gemma_budget(available=600 * MIB, prompt_cache_bytes=256 * MIB, ctx_checkpoints=8)
    assert not b.fits
    text = b.refusal()
    assert f"+ prompt cache {256:,} MiB + checkpoints " in text
    assert "llama.prompt_cache_mib" in text and "llama.ctx_checkpoints" in text


def test_swa_full_keeps_every_layer_in_full_and_makes_no_checkpoints() -> None:
    full = kv_bytes(GEMMA, ctx_per_slot=4096, slots=2, type_k="f16", type_v="f16", swa_full=True)
    assert full == 18 * 4096 * 2 * 256 * 2 * 2
    b = gemma_budget(ctx_checkpoints=8, swa_full=True)
    assert b.kv_bytes == full and b.checkpoint_bytes == 0


def test_a_larger_ubatch_widens_the_sliding_window_cache() -> None:
    # -ub 2048: pad256(512 + 2048) = 2560 cells on each sliding layer.
    got = kv_bytes(GEMMA, ctx_per_slot=4096, slots=1, type_k="f16", type_v="f16", n_ubatch=2048)
    assert got == (3 * 4096 + 15 * 2560) * 256 * 2 * 2
