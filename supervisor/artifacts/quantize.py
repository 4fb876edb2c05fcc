"""``derive``: a GGUF of another quantization type, made from a GGUF by the lock's own llama-quantize.

The tool is built from the same lock, sources and cmake arguments as llama-server and cached beside it
(``artifacts.tools``; the first use builds it, minutes; later uses are a cache hit). The result goes to
``<cache>/models/<name>`` unless ``out`` says otherwise, ``<name>`` being the source's name with its
type replaced (``gemma-3-270m-q4_k_m.gguf`` -> ``gemma-3-270m-q8_0.gguf``), with a record beside it
(``<name>.derived.json``): its sha256 and size, the source's path, sha256 and type, and the
llama-quantize binary that made it. A second call with the same source, type and binary finds the
file by its record and re-hashes nothing (the hash cache, ``files.sha256_file``).

Interruptions: llama-quantize writes into ``.<name>.partial-*`` beside the target, which is renamed
into place only once the file is complete, hashed and its record written; llama-quantize is tied to
this process (it dies with it, even on SIGKILL), and a partial file left by a killed run is removed by
the next run for the same name, under that name's flock (a dead process holds none).

Quality: llama-quantize can only re-encode the weights its source holds. From an already quantized
source (``--allow-requantize``, passed only then) a "higher" type carries the source's quality, not its
own: such files differ in kernels, size and memory bandwidth, so compare them for speed and memory,
never for quality (``quality_note``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from supervisor.artifacts.build import InstalledBinary, ensure_binary
from supervisor.artifacts.cmake import default_jobs
from supervisor.artifacts.files import check_gguf, sha256_file, sha256_fresh
from supervisor.artifacts.tools import QUANTIZE
from supervisor.budget.gguf_info import gguf_constants, read_metadata
from supervisor.child.spawn import popen_tied
from supervisor.errors import BuildError, UsageError
from supervisor.paths import cache_root, new_file_mode
from supervisor.progress import Progress
from supervisor.subproc import run_streaming

RECORD_SUFFIX = ".derived.json"
RECORD_FORMAT = 1
# The type names llama-quantize accepts at the pinned commit (tools/quantize/quantize.cpp,
# QUANT_OPTIONS), aliases and COPY left out. IQ types need an importance matrix, which this command
# does not make: llama-quantize refuses them without one, with its own message.
TYPES = (
    "Q1_0", "Q2_0", "Q4_0", "Q4_1", "MXFP4_MOE", "Q5_0", "Q5_1", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M",
    "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0", "Q2_K", "Q2_K_S", "IQ3_XXS", "IQ3_S", "IQ3_M", "IQ3_XS",
    "Q3_K_S", "Q3_K_M", "Q3_K_L", "IQ4_NL", "IQ4_XS", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K",
    "Q8_0", "F16", "BF16", "F32",
)  # fmt: skip
# Source types whose tensors llama-quantize converts without --allow-requantize.
_FLOAT_TYPES = ("F32", "F16", "BF16")
_PROGRESS = re.compile(r"^\[\s*(\d+)/\s*(\d+)\]")
_TYPE_SUFFIX = re.compile(r"[-._](" + "|".join(sorted(TYPES, key=len, reverse=True)) + r")$", re.IGNORECASE)


@dataclass(frozen=True)
class Derived:
    path: Path
    sha256: str
    size: int
    type: str
    source: Path
    source_sha256: str
    source_type: str | None
    requantized: bool
    tool: InstalledBinary
    seconds: float  # llama-quantize's run; 0 for a cache hit
    cache_hit: bool

    @property
    def quality_note(self) -> str | None:
        return quality_note(self.source_type, self.type) if self.requantized else None


def quality_note(source_type: str | None, qtype: str) -> str:
    src = source_type or "an already quantized"
    return (
        f"derived from a {src} file with --allow-requantize: this {qtype} file carries {src}'s quality, "
        f"not {qtype}'s (llama-quantize can only re-encode the weights the source kept). It differs "
        "only in kernels, size and memory bandwidth: compare it for speed and memory, not for quality."
    )


def normalise_type(text: str) -> str:
    qtype = text.strip().upper()
    if qtype not in TYPES:
        raise UsageError(f"--type {text!r}: not a llama-quantize type (one of: {', '.join(TYPES)})")
    return qtype


def file_type(path: Path) -> str | None:
    """The quantization type a GGUF says it is (``general.file_type``), as llama-quantize names it."""
    raw = read_metadata(path).get("general.file_type")
    if not isinstance(raw, int):
        return None
    try:
        name: str = gguf_constants.LlamaFileType(raw).name
    except ValueError:
        return None
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")


def derived_name(source: Path, qtype: str) -> str:
    stem = _TYPE_SUFFIX.sub("", source.stem)
    return f"{stem}-{qtype.lower()}.gguf"


def models_dir(cache: Path | None = None) -> Path:
    return (cache if cache is not None else cache_root()) / "models"


def derive(
    source: Path,
    qtype: str,
    *,
    lock_path: Path,
    progress: Progress,
    out: Path | None = None,
    cache: Path | None = None,
    threads: int | None = None,
) -> Derived:
    """``source`` re-encoded as ``qtype``; found by its record when it was made before."""
    qtype = normalise_type(qtype)
    source = source.expanduser().resolve()
    check_gguf(source)
    root = cache if cache is not None else cache_root()
    source_type = file_type(source)
    if source_type == qtype:
        raise UsageError(f"{source} is already {qtype}: nothing to derive (use the file itself)")
    target = (
        out.expanduser() if out is not None else models_dir(root) / derived_name(source, qtype)
    ).resolve()
    if target == source:
        raise UsageError(f"--out {target}: the output would replace its own source")
    source_sha = sha256_file(source, cache=root)
    tool = ensure_binary(lock_path, cache=cache, progress=progress, target=QUANTIZE)
    requantize = source_type not in _FLOAT_TYPES
    target.parent.mkdir(parents=True, exist_ok=True)
    with _name_lock(target):
        hit = _recorded(target, source_sha, qtype, tool, root)
        if hit is not None:
            return _from_record(hit, target, source, tool)
        if target.exists() and not _record_path(target).exists():
            raise UsageError(
                f"{target} exists and was not made by `llamagate model quantize` (no {RECORD_SUFFIX} "
                "beside it): remove it or choose another --out"
            )
        for leftover in target.parent.glob(f".{target.name}.partial-*"):
            leftover.unlink(missing_ok=True)  # a killed run's: we hold this name's lock
        fd, partial_name = tempfile.mkstemp(prefix=f".{target.name}.partial-", dir=target.parent)
        os.close(fd)
        partial = Path(partial_name)
        try:
            argv, seconds = _run(source, partial, qtype, requantize, tool, threads, progress)
            derived = Derived(
                path=target,
                sha256=sha256_fresh(partial),
                size=partial.stat().st_size,
                type=qtype,
                source=source,
                source_sha256=source_sha,
                source_type=source_type,
                requantized=requantize,
                tool=tool,
                seconds=seconds,
                cache_hit=False,
            )
            argv[argv.index(str(partial))] = str(target)
            # The record first: a file under the final name always has one (a record without its file
            # is only a miss).
            _write_json(_record_path(target), _record(derived, argv))
            partial.chmod(new_file_mode())
            partial.replace(target)
        finally:
            partial.unlink(missing_ok=True)
        sha256_file(target, cache=root)  # seed the hash cache: a later start costs a stat, not a re-hash
    progress.done("quantize", str(target))
    return derived


def _run(
    source: Path,
    partial: Path,
    qtype: str,
    requantize: bool,
    tool: InstalledBinary,
    threads: int | None,
    progress: Progress,
) -> tuple[list[str], float]:
    flags = ["--allow-requantize"] if requantize else []
    argv = [str(tool.path), *flags, str(source), str(partial), qtype, str(threads or default_jobs())]

    def on_line(line: str) -> None:
        m = _PROGRESS.match(line)
        if m and int(m.group(2)):
            progress.update("quantize", int(m.group(1)) / int(m.group(2)), f"{source.name} -> {qtype}")

    started = time.monotonic()
    progress.update("quantize", 0.0, f"{source.name} -> {qtype}")
    # No LLAMA_ARG_* (or other LLAMA_*) from our shell can change what it does.
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_")}
    result = run_streaming(argv, env=env, on_line=on_line, popen=popen_tied)
    if result.returncode != 0:
        shown = "\n    ".join(result.tail[-15:])
        raise BuildError(f"llama-quantize failed (exit {result.returncode}):\n    {shown}")
    check_gguf(partial)
    return argv, round(time.monotonic() - started, 2)


def _record_path(target: Path) -> Path:
    return target.with_name(target.name + RECORD_SUFFIX)


def _record(d: Derived, argv: list[str]) -> dict[str, Any]:
    r = d.tool.receipt
    return {
        "format": RECORD_FORMAT,
        "path": str(d.path),
        "sha256": d.sha256,
        "size": d.size,
        "type": d.type,
        "source": {"path": str(d.source), "sha256": d.source_sha256, "type": d.source_type},
        "requantized": d.requantized,
        "quality_note": d.quality_note,
        "llama_quantize": {
            "path": str(d.tool.path),
            "binary_sha256": r.binary_sha256,
            "lock_digest": r.lock_digest,
            "version": r.version_output.splitlines()[0] if r.version_output else None,
            "argv": argv,
            "seconds": d.seconds,
        },
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def read_record(target: Path) -> dict[str, Any] | None:
    try:
        raw = json.loads(_record_path(target).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) and raw.get("format") == RECORD_FORMAT else None


def _recorded(
    target: Path, source_sha: str, qtype: str, tool: InstalledBinary, root: Path
) -> dict[str, Any] | None:
    """The record of ``target`` when it says the file is this derivation and the file still hashes to
    it; None means it must be made (again)."""
    record = read_record(target)
    if record is None or not target.is_file():
        return None
    made_by = record.get("llama_quantize") or {}
    same = (
        record.get("type") == qtype
        and (record.get("source") or {}).get("sha256") == source_sha
        and made_by.get("binary_sha256") == tool.receipt.binary_sha256
    )
    if not same or sha256_file(target, cache=root) != record.get("sha256"):
        return None
    return record


def _from_record(record: dict[str, Any], target: Path, source: Path, tool: InstalledBinary) -> Derived:
    src = record["source"]
    return Derived(
        path=target,
        sha256=str(record["sha256"]),
        size=target.stat().st_size,
        type=str(record["type"]),
        source=source,
        source_sha256=str(src["sha256"]),
        source_type=src.get("type"),
        requantized=bool(record.get("requantized")),
        tool=tool,
        seconds=0.0,
        cache_hit=True,
    )


@contextlib.contextmanager
def _name_lock(target: Path) -> Iterator[None]:
    """One deriver per output name at a time (two runs for the same file wait, then the second hits)."""
    with (target.parent / f".{target.name}.lock").open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, new_file_mode())
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=2, sort_keys=True)
            fh.write("\n")
        Path(tmp).replace(path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
