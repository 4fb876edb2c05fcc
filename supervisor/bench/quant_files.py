"""The files ``bench experiment models --quantize`` compares: one source GGUF and the types derived from it
(``artifacts.quantize``, cached in the model cache, so a second run re-derives nothing)."""

from __future__ import annotations

from pathlib import Path

from supervisor.artifacts.files import sha256_file
from supervisor.artifacts.quantize import derive, file_type, normalise_type
from supervisor.errors import UsageError
from supervisor.progress import Progress


def parse_types(text: str) -> list[str]:
    types = [normalise_type(t) for t in text.split(",") if t.strip()]
    if not types:
        raise UsageError("--quantize: name at least one type, e.g. Q4_K_M,Q5_K_M,Q8_0,F16")
    if len(set(types)) != len(types):
        raise UsageError(f"--quantize {text}: a type is named twice")
    return types


def prepare(types: list[str], source: Path, *, lock_path: Path, progress: Progress) -> list[tuple[Path, str]]:
    """(path, sha256) per type, in order: the source itself for its own type, else a derived file."""
    own = file_type(source)
    files = []
    for qtype in types:
        if qtype == own:
            files.append((source, sha256_file(source)))
        else:
            derived = derive(source, qtype, lock_path=lock_path, progress=progress)
            files.append((derived.path, derived.sha256))
    return files
