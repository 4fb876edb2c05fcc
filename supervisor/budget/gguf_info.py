"""The few GGUF header facts the memory budget needs, read straight from the key/value section.

Why not ``gguf.GGUFReader``: it builds a numpy view for every array element while opening a file, and
the demo model's 262,144-entry vocabulary made it take 17.8 s (measured on the 2-core dev machine) just
to open the header. Here the key/value section is walked once with ``struct`` and string arrays are
skipped by their lengths (about 0.1 s for the same file). The value-type numbers and key names come
from the ``gguf`` package itself, so nothing about the format is retyped here.
"""

from __future__ import annotations

import importlib.util
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from supervisor.errors import NotAGguf


def _load_gguf_constants() -> ModuleType:
    """``gguf.constants`` without ``import gguf``: the package's ``__init__`` imports numpy and every
    reader and writer (0.18 s of the daemon's start, measured with ``python -X importtime``) for the
    three enums the budget needs; ``constants.py`` itself imports only the standard library."""
    spec = importlib.util.find_spec("gguf")
    if spec is not None and spec.submodule_search_locations:
        path = Path(next(iter(spec.submodule_search_locations))) / "constants.py"
        const_spec = importlib.util.spec_from_file_location("_llamagate_gguf_constants", path)
        if const_spec is not None and const_spec.loader is not None:
            module = importlib.util.module_from_spec(const_spec)
            const_spec.loader.exec_module(module)
            return module
    import gguf.constants  # the layout changed: take the slow path

    return gguf.constants


gguf_constants = _load_gguf_constants()
GGUF_MAGIC: int = gguf_constants.GGUF_MAGIC
GGUFValueType: Any = gguf_constants.GGUFValueType
Keys: Any = gguf_constants.Keys

_SCALARS: dict[int, str] = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}


@dataclass(frozen=True)
class ModelShape:
    architecture: str
    layers: int
    head_count: int
    # One entry per layer: some architectures vary the KV head count by layer.
    kv_heads: tuple[int, ...]
    key_length: int
    value_length: int
    n_ctx_train: int | None
    # Sliding-window attention: window size in tokens, and which layers use it (None: unknown).
    sliding_window: int | None
    swa_layers: tuple[bool, ...] | None
    # Tokens in the vocabulary (the length of tokenizer.ggml.tokens): the proxy refuses token ids beyond.
    n_vocab: int | None = None


class _Reader:
    def __init__(self, buf: mmap.mmap, where: Path) -> None:
        self.buf = buf
        self.pos = 0
        self.where = where
        self.skipped_count = 0  # the length of the last array skipped (the vocabulary's size)

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise NotAGguf(f"{self.where}: GGUF header is truncated")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int, keep: bool) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == GGUFValueType.ARRAY:
            itype = self.unpack("<I")
            count = self.unpack("<Q")
            if not keep:
                self.skip_array(itype, count)
                self.skipped_count = count
                return None
            return [self.value(itype, True) for _ in range(count)]
        raise NotAGguf(f"{self.where}: unknown GGUF value type {vtype}")

    def skip_array(self, itype: int, count: int) -> None:
        if itype in _SCALARS:
            self.pos += struct.calcsize(_SCALARS[itype]) * count
        elif itype == GGUFValueType.STRING:
            for _ in range(count):
                (n,) = struct.unpack_from("<Q", self.buf, self.pos)
                self.pos += 8 + n
        else:
            for _ in range(count):
                self.value(itype, False)


# The vocabulary's tokens, and the entry ``read_metadata`` adds for their count when it skips them.
VOCAB_KEY = "tokenizer.ggml.tokens"
VOCAB_SIZE = "tokenizer.ggml.tokens#count"


def read_metadata(path: Path, skip_arrays_under: tuple[str, ...] = ("tokenizer.",)) -> dict[str, Any]:
    """Key/value metadata. Arrays under ``skip_arrays_under`` (the vocabulary) are skipped, not read:
    their value is None."""
    with path.open("rb") as fh:
        try:
            buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # empty file
            raise NotAGguf(f"{path}: empty file, not a GGUF model") from None
    with buf:
        r = _Reader(buf, path)
        if r.unpack("<I") != GGUF_MAGIC:
            raise NotAGguf(f"{path}: not a GGUF model (bad magic)")
        version = r.unpack("<I")
        if version < 2:
            raise NotAGguf(f"{path}: GGUF version {version} is too old")
        r.unpack("<Q")  # tensor count
        kv_count = r.unpack("<Q")
        out: dict[str, Any] = {}
        for _ in range(kv_count):
            key = r.string()
            vtype = r.unpack("<I")
            out[key] = r.value(vtype, keep=not key.startswith(skip_arrays_under))
            if key == VOCAB_KEY and out[key] is None:
                out[VOCAB_SIZE] = r.skipped_count
        return out


# Which layers use the sliding window when the file does not say (llama.cpp hard-codes it per
# architecture). Verified in the pinned source: src/models/gemma3.cpp calls load_swa_pattern(ml, 6),
# i.e. every 6th layer is global and the other five slide. Architectures not listed here are
# treated as if every layer kept the full context: an overestimate, never an underestimate.
_SWA_PATTERN_DEFAULTS = {"gemma3": 6}


def _swa_layers(meta: dict[str, Any], arch: str, layers: int) -> tuple[bool, ...] | None:
    raw = meta.get(Keys.Attention.SLIDING_WINDOW_PATTERN.format(arch=arch))
    if isinstance(raw, list):
        return tuple(bool(x) for x in raw[:layers]) if len(raw) >= layers else None
    pattern = raw if isinstance(raw, int) else _SWA_PATTERN_DEFAULTS.get(arch)
    if not pattern or pattern < 1:
        return None
    # llama_hparams::set_swa_pattern(n, dense_first=false): layer il slides iff il % n < n - 1.
    return tuple(il % pattern < pattern - 1 for il in range(layers))


def read_shape(path: Path) -> ModelShape:
    """Layers, KV heads and head sizes of a GGUF model, as llama.cpp would read them."""
    meta = read_metadata(path)
    arch = meta.get(Keys.General.ARCHITECTURE)
    if not isinstance(arch, str):
        raise NotAGguf(f"{path}: no {Keys.General.ARCHITECTURE} in the GGUF header")

    def get(key: str) -> Any:
        return meta.get(key.format(arch=arch))

    layers = get(Keys.LLM.BLOCK_COUNT)
    heads = get(Keys.Attention.HEAD_COUNT)
    embd = get(Keys.LLM.EMBEDDING_LENGTH)
    if not isinstance(layers, int) or layers < 1:
        raise NotAGguf(f"{path}: {arch}.block_count missing from the GGUF header")
    if isinstance(heads, list):
        heads = max(heads)
    if not isinstance(heads, int) or heads < 1:
        raise NotAGguf(f"{path}: {arch}.attention.head_count missing from the GGUF header")
    kv = get(Keys.Attention.HEAD_COUNT_KV)
    kv_heads = tuple(int(x) for x in kv) if isinstance(kv, list) else (int(kv or heads),) * layers
    if len(kv_heads) != layers:
        kv_heads = (max(kv_heads),) * layers
    # llama.cpp's defaults when the keys are absent: n_embd / n_head.
    default_head = embd // heads if isinstance(embd, int) else 0
    key_len = get(Keys.Attention.KEY_LENGTH) or default_head
    value_len = get(Keys.Attention.VALUE_LENGTH) or default_head
    if key_len <= 0 or value_len <= 0:
        raise NotAGguf(f"{path}: cannot tell the attention head size from the GGUF header")
    window = get(Keys.Attention.SLIDING_WINDOW)
    window = window if isinstance(window, int) and window > 0 else None
    ctx_train = get(Keys.LLM.CONTEXT_LENGTH)
    return ModelShape(
        architecture=arch,
        layers=layers,
        head_count=heads,
        kv_heads=kv_heads,
        key_length=int(key_len),
        value_length=int(value_len),
        n_ctx_train=ctx_train if isinstance(ctx_train, int) else None,
        sliding_window=window,
        swa_layers=_swa_layers(meta, arch, layers) if window else None,
        n_vocab=_vocab_size(meta),
    )


def _vocab_size(meta: dict[str, Any]) -> int | None:
    tokens = meta.get(VOCAB_KEY)
    count = len(tokens) if isinstance(tokens, list) else meta.get(VOCAB_SIZE)
    return count if isinstance(count, int) and count > 0 else None
