"""Memory budget: KV bytes from the GGUF header, the three numbers, and what to change."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import gguf
import pytest

from supervisor.budget.gguf_info import ModelShape, read_shape
from supervisor.budget.plan import (
    MIB,
    Budget,
    bytes_per_element,
    checkpoint_bytes,
    kv_bytes,
    plan_budget,
)
from supervisor.errors import NotAGguf


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
    # KV: 2 (K, V) x 4 layers x 2 heads x 64 x 2 bytes = 2048 B a token; x 4096 x 2 slots = 16 MiB.
    assert b.kv_bytes == 16_777_216
    # Runtime: 128 MiB + 5 % of 524,288,000 = 134,217,728 + 26,214,400.
    assert b.runtime_bytes == 160_432_128
    assert b.required_bytes == 524_288_000 + 16_777_216 + 160_432_128 == 701_497_344
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
    # The advice is the largest setting that fits, by hand: usable 15,360 MiB = 16,106,127,360 B, minus
    # weights 4,194,304,000 and runtime 134,217,728 + 209,715,200 leaves 11,567,890,432 B for KV.
    # 8 slots x 128 KiB a token: 11,567,890,432 / 1,048,576 = 11,031.8 tokens a slot -> 43 x 256 = 11008.
    # 32768 tokens x 128 KiB = 4 GiB a slot: 11,567,890,432 / 4,294,967,296 = 2.69 -> 2 slots.
    assert (b.max_ctx_per_slot, b.max_slots) == (11008, 2)
    assert "llama.ctx_per_slot <= 11008 (now 32768)" in text
    assert "llama.slots <= 2 (now 8)" in text


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
    assert b.prompt_cache_bytes == 268_435_456
    # One checkpoint: 15 sliding layers x 1024 cells x 1024 B (K+V, 1 head of 256, f16) = 15 MiB;
    # 2 slots x 8 of them.
    assert b.checkpoint_bytes == 2 * 8 * 15_728_640 == 251_658_240
    # 241 MiB of weights + 54 MiB KV + (128 MiB + int(0.05 x 252,706,816)) + 256 MiB + 240 MiB.
    assert b.required_bytes == 252_706_816 + 56_623_104 + 146_853_068 + 268_435_456 + 251_658_240
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


def test_the_demo_models_budget_by_hand() -> None:
    """The default config (2 slots x 4096, f16, 256 MiB prompt cache, 8 checkpoints) on the demo model,
    whose header says: gemma3, 18 layers, 1 KV head of 256 (K and V), sliding window 512 on every layer
    but each 6th; the file is 253,113,024 bytes."""
    shape = ModelShape("gemma3", 18, 4, (1,) * 18, 256, 256, 32768, 512, tuple(i % 6 < 5 for i in range(18)))
    args: dict[str, Any] = dict(
        weights=253_113_024,
        slots=2,
        ctx_per_slot=4096,
        type_k="f16",
        type_v="f16",
        prompt_cache_bytes=256 * MIB,
        ctx_checkpoints=8,
    )
    b = plan_budget(shape, headroom_bytes=0, available=64 * 1024 * MIB, **args)
    # A cell of one layer: K + V = 2 x 1 head x 256 x 2 bytes = 1024 B.
    # A slot: 3 global layers x 4096 cells + 15 sliding layers x pad256(512 + 512 ubatch) = 1024 cells
    #   = 12,288 + 15,360 = 27,648 cells = 28,311,552 B; two slots: 56,623,104 B (54 MiB).
    assert b.kv_bytes == 56_623_104
    # 128 MiB + int(0.05 x 253,113,024 = 12,655,651.2) = 134,217,728 + 12,655,651.
    assert b.runtime_bytes == 146_873_379
    # One checkpoint holds a slot's sliding layers: 15 x 1024 cells x 1024 B = 15 MiB; 2 slots x 8.
    assert b.checkpoint_bytes == 251_658_240
    assert b.prompt_cache_bytes == 268_435_456
    assert b.required_bytes == 976_703_203  # the sum of the five
    assert b.fits and (b.max_ctx_per_slot, b.max_slots) == (4096, 2)

    # Usable memory that holds exactly 2 slots x 2048: fixed part 253,113,024 + 146,873,379 +
    # 268,435,456 = 668,421,859; a slot at 2048 holds (3 x 2048 + 15 x 1024) x 1024 = 22,020,096 B of KV
    # plus 8 checkpoints of 15 MiB = 125,829,120 B: 147,849,216; two of them 295,698,432.
    usable = 668_421_859 + 295_698_432
    tight = plan_budget(shape, headroom_bytes=0, available=usable, **args)
    assert not tight.fits
    # 2304 would need 2 x 3 x 256 x 1024 B more; 2 slots at 4096 need 2 x 154,140,672 > 295,698,432.
    assert (tight.max_ctx_per_slot, tight.max_slots) == (2048, 1)
    assert "llama.ctx_per_slot <= 2048 (now 4096)" in tight.refusal()
    assert "needs 931 MiB" in tight.refusal()  # 976,703,203 / 1,048,576 = 931.4


def test_the_plan_says_how_many_conversations_stay_warm() -> None:
    # SmolLM2's shape: 30 layers, 3 KV heads of 64, f16: 23,040 B of state per token.
    smol = ModelShape("llama", 30, 9, (3,) * 30, 64, 64, 8192, None, None)
    b = plan_budget(
        smol,
        weights=94 * MIB,
        slots=2,
        ctx_per_slot=4096,
        type_k="f16",
        type_v="f16",
        headroom_bytes=0,
        available=64 * 1024 * MIB,
        prompt_cache_bytes=256 * MIB,
    )
    assert b.state_1k_bytes == 1024 * 23_040 and b.state_full_bytes == 4096 * 23_040
    line = b.lines()[-1]
    # 256 MiB / 22.5 MiB = 11 in the cache, 2 in the slots; 256 MiB / 90 MiB = 2 at a full slot.
    assert line.split()[:4] == ["conversations", "kept", "warm", "13"]
    assert "2 in the slots + 11 in the prompt cache at 22.5 MiB each" in line and "4 of 4,096" in line
    without = dataclasses.replace(b, prompt_cache_bytes=0)
    assert "one per slot; no prompt cache" in without.lines()[-1]
