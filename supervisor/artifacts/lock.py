"""``llama-build.lock``: which llama.cpp source, how to build it, and what the result must say it is.

The lock is TOML, read with ``tomllib``, validated in one pass: every problem is reported by its field
path (``source[0].sha256: must be 64 lowercase hex characters``), unknown keys included, so a typo never
silently falls back to a default. See docs/build.md for the format and how to pin another commit.

The lock's digest keys the binary cache. It is the sha256 of a canonical JSON rendering of everything
that goes INTO a build (format, commit, version line, sources, cmake arguments, per-target options,
target), so comments and layout do not trigger a rebuild. The ``[reference]`` table is left out on
purpose: it records an outcome (the binary digest seen on a reference toolchain), and filling it in
after a build must not invalidate the binary it describes.

Build variants: the tables above describe the default build (``cpu``). Each ``[variant.NAME]`` adds
cmake arguments, source patches (pinned by sha256, applied after the source's own sha256 check), the
programs the build needs on PATH and the Debian packages that bring them, and its own reference digest.
A variant's digest is the default build's inputs plus its own table, so each variant has its own cache
entry; the default build's digest leaves every ``[variant.*]`` table out, so declaring a variant never
rebuilds the CPU binary.
"""

from __future__ import annotations

import hashlib
import json
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from supervisor.errors import LockError

LOCK_FORMAT = 1
SourceKind = Literal["pypi-sdist", "url", "file"]
SOURCE_KINDS: tuple[SourceKind, ...] = ("pypi-sdist", "url", "file")
# Placeholders the builder substitutes in cmake arguments (absolute, resolved paths of this build), so
# ``-ffile-prefix-map`` can strip the temporary folder names from the binary.
PLACEHOLDERS = ("{source_dir}", "{build_dir}")

_SHA256 = re.compile(r"[0-9a-f]{64}")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_TARGET = re.compile(r"[A-Za-z0-9_.+-]+")
_PLACEHOLDER = re.compile(r"\{[^{}]*\}")
_UNSAFE_OPTION = re.compile(r"[\s\]\[;$\\\"]")

DEFAULT_VARIANT = "cpu"
_TOP_KEYS = {"format", "llama_cpp", "build", "source", "reference", "variant"}
_VARIANT_KEYS = {
    "description",
    "cmake_args",
    "patch",
    "requires",
    "packages",
    "runtime_packages",
    "reference",
}
# What a variant's table says that is no input of its build: left out of its digest.
_NOT_INPUTS = ("reference", "description", "runtime_packages")
_PATCH_KEYS = {"name", "sha256", "text"}
_NAME = re.compile(r"[a-z][a-z0-9_-]{0,31}")
_PACKAGE = re.compile(r"[a-z0-9][a-z0-9+.-]*")
_LLAMA_KEYS = {"commit", "version_line"}
_BUILD_KEYS = {"target", "cmake_args", "target_options"}
_REFERENCE_KEYS = {"binary_sha256", "toolchain"}
_SOURCE_KEYS: dict[str, set[str]] = {
    "pypi-sdist": {"kind", "package", "version", "sha256", "subdir"},
    "url": {"kind", "url", "sha256", "subdir"},
    "file": {"kind", "path", "sha256", "subdir"},
}


@dataclass(frozen=True)
class Source:
    """One place the pinned source tarball can come from; all of a lock's sources hold the same tree."""

    kind: SourceKind
    sha256: str
    subdir: str  # folder inside the tarball that holds llama.cpp's top-level CMakeLists.txt
    package: str | None = None  # pypi-sdist
    version: str | None = None  # pypi-sdist
    url: str | None = None  # url
    path: Path | None = None  # file (resolved against the lock's folder)

    def describe(self) -> str:
        if self.kind == "pypi-sdist":
            return f"pypi-sdist {self.package}=={self.version}"
        if self.kind == "url":
            return f"url {self.url}"
        return f"file {self.path}"


@dataclass(frozen=True)
class Reference:
    """The binary digest seen on one named toolchain. Another toolchain differing is a warning only."""

    binary_sha256: str
    toolchain: str


@dataclass(frozen=True)
class Patch:
    """A change to the unpacked source, as a unified diff (``patch -p1``) kept in the lock itself, so the
    lock stays one self-contained file wherever it is copied (the package, a container, ``--lock``)."""

    name: str
    sha256: str  # of ``text`` (UTF-8): a lock edited by accident fails to load instead of building
    text: str


@dataclass(frozen=True)
class Variant:
    """What a ``[variant.NAME]`` table adds to the default build."""

    name: str
    description: str
    cmake_args: tuple[str, ...]  # appended to build.cmake_args
    patches: tuple[Patch, ...]
    requires: tuple[str, ...]  # programs the build runs, checked on PATH before anything is fetched
    packages: tuple[str, ...]  # the Debian packages that bring them (and the headers and libraries)
    runtime_packages: tuple[str, ...]  # what the binary needs to run (a container's runtime stage)
    reference: Reference | None


@dataclass(frozen=True)
class Lock:
    path: Path
    format: int
    commit: str
    version_line: str
    sources: tuple[Source, ...]
    cmake_args: tuple[str, ...]
    target: str
    reference: Reference | None
    digest: str
    # cmake target -> compile options appended after the build type's (``build.target_options``):
    # applied by a generated CMake file (``artifacts.cmake.target_options_script``).
    target_options: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # The build this Lock describes: ``cpu`` (the tables above) or a ``[variant.NAME]`` merged in.
    variant: str = DEFAULT_VARIANT
    patches: tuple[Patch, ...] = ()
    requires: tuple[str, ...] = ()
    packages: tuple[str, ...] = ()
    runtime_packages: tuple[str, ...] = ()
    variants: tuple[str, ...] = (DEFAULT_VARIANT,)  # every build the lock declares, the default first


def load_lock(path: Path, variant: str = DEFAULT_VARIANT) -> Lock:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise LockError(f"{path}: lock file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise LockError(f"{path}: cannot read lock file: {exc}") from None
    return parse_lock(text, path, variant)


def parse_lock(text: str, path: Path, variant: str = DEFAULT_VARIANT) -> Lock:
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise LockError(f"{path}: not valid TOML: {exc}") from None
    problems: list[str] = []
    lock = _validate(raw, path, problems)
    variants = _variants(raw.get("variant"), problems)
    if problems or lock is None:
        lines = "\n".join(f"  {p}" for p in problems)
        raise LockError(f"{path}: {len(problems)} problem(s):\n{lines}")
    names = (DEFAULT_VARIANT, *(v.name for v in variants))
    if variant == DEFAULT_VARIANT:
        return replace(lock, variants=names)
    chosen = next((v for v in variants if v.name == variant), None)
    if chosen is None:
        raise LockError(f"{path}: no build variant {variant!r} (this lock declares: {', '.join(names)})")
    return replace(
        lock,
        variant=chosen.name,
        cmake_args=lock.cmake_args + chosen.cmake_args,
        patches=chosen.patches,
        requires=chosen.requires,
        packages=chosen.packages,
        runtime_packages=chosen.runtime_packages,
        reference=chosen.reference,
        digest=lock_digest(raw, chosen.name),
        variants=names,
    )


def lock_digest(raw: Mapping[str, Any], variant: str = DEFAULT_VARIANT) -> str:
    """sha256 of the build inputs in canonical JSON (sorted keys, no whitespace, UTF-8).

    The default build's inputs are every table but ``reference`` and ``variant`` (so its digest is the
    one it had before variants existed); a variant's are those plus its own table, less what is no
    input of the build (``_NOT_INPUTS``), under the key ``variant`` with its name."""
    inputs: dict[str, Any] = {k: v for k, v in raw.items() if k not in ("reference", "variant")}
    if variant != DEFAULT_VARIANT:
        table = raw["variant"][variant]
        own = {k: v for k, v in table.items() if k not in _NOT_INPUTS}
        inputs["variant"] = {"name": variant, **own}
    canonical = json.dumps(inputs, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def _validate(raw: dict[str, Any], path: Path, problems: list[str]) -> Lock | None:
    _unknown(raw, _TOP_KEYS, "", problems)
    fmt = raw.get("format")
    if fmt is None:
        problems.append("format: missing (this llamagate reads format = 1)")
    elif not isinstance(fmt, int) or isinstance(fmt, bool):
        problems.append("format: must be an integer")
    elif fmt != LOCK_FORMAT:
        problems.append(f"format: {fmt} is not supported (this llamagate reads format = {LOCK_FORMAT})")

    llama = _table(raw, "llama_cpp", problems)
    commit = version_line = ""
    if llama is not None:
        _unknown(llama, _LLAMA_KEYS, "llama_cpp.", problems)
        commit = _string(llama, "commit", "llama_cpp.commit", problems)
        if commit and not _COMMIT.fullmatch(commit):
            problems.append("llama_cpp.commit: must be a full 40-character lowercase hex git commit")
        version_line = _string(llama, "version_line", "llama_cpp.version_line", problems)
        if commit and version_line and commit[:7] not in version_line:
            problems.append(f"llama_cpp.version_line: does not mention the commit {commit[:7]}")

    build = _table(raw, "build", problems)
    target = ""
    cmake_args: tuple[str, ...] = ()
    target_options: tuple[tuple[str, tuple[str, ...]], ...] = ()
    if build is not None:
        _unknown(build, _BUILD_KEYS, "build.", problems)
        target = _string(build, "target", "build.target", problems)
        if target and not _TARGET.fullmatch(target):
            problems.append("build.target: must be a plain cmake target name")
        cmake_args = _cmake_args(build.get("cmake_args"), problems)
        target_options = _target_options(build.get("target_options"), problems)
        if target_options and any(a.startswith("-DCMAKE_PROJECT_INCLUDE") for a in cmake_args):
            problems.append(
                "build.cmake_args: CMAKE_PROJECT_INCLUDE is llamagate's while build.target_options is set"
            )

    sources = _sources(raw.get("source"), path.parent, problems)
    reference = _reference(raw.get("reference"), problems)
    if problems:
        return None
    return Lock(
        path=path,
        format=LOCK_FORMAT,
        commit=commit,
        version_line=version_line,
        sources=sources,
        cmake_args=cmake_args,
        target=target,
        reference=reference,
        digest=lock_digest(raw),
        target_options=target_options,
    )


def _unknown(table: Mapping[str, Any], known: set[str], prefix: str, problems: list[str]) -> None:
    for key in table:
        if key not in known:
            problems.append(f"{prefix}{key}: unknown key (expected one of: {', '.join(sorted(known))})")


def _table(raw: Mapping[str, Any], key: str, problems: list[str]) -> dict[str, Any] | None:
    value = raw.get(key)
    if value is None:
        problems.append(f"{key}: missing table [{key}]")
        return None
    if not isinstance(value, dict):
        problems.append(f"{key}: must be a table [{key}]")
        return None
    return value


def _string(table: Mapping[str, Any], key: str, where: str, problems: list[str]) -> str:
    value = table.get(key)
    if value is None:
        problems.append(f"{where}: missing")
        return ""
    if not isinstance(value, str) or not value.strip():
        problems.append(f"{where}: must be a non-empty string")
        return ""
    return value


def _sha256(table: Mapping[str, Any], key: str, where: str, problems: list[str]) -> str:
    value = _string(table, key, where, problems)
    if value and not _SHA256.fullmatch(value):
        problems.append(f"{where}: must be 64 lowercase hex characters")
        return ""
    return value


def _cmake_args(value: Any, problems: list[str], prefix: str = "build") -> tuple[str, ...]:
    if value is None:
        problems.append(f"{prefix}.cmake_args: missing")
        return ()
    if not isinstance(value, list):
        problems.append(f"{prefix}.cmake_args: must be a list of strings")
        return ()
    args: list[str] = []
    for i, arg in enumerate(value):
        where = f"{prefix}.cmake_args[{i}]"
        if not isinstance(arg, str) or not arg:
            problems.append(f"{where}: must be a non-empty string")
            continue
        for found in _PLACEHOLDER.findall(arg):
            if found not in PLACEHOLDERS:
                problems.append(f"{where}: unknown placeholder {found} (known: {', '.join(PLACEHOLDERS)})")
        if arg in ("-S", "-B") or arg.startswith(("-S", "-B")):
            problems.append(f"{where}: source and build folders are chosen by llamagate; remove {arg!r}")
        args.append(arg)
    return tuple(args)


def _target_options(value: Any, problems: list[str]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    if value is None:
        return ()
    if not isinstance(value, dict):
        problems.append("build.target_options: must be a table of cmake target = [options]")
        return ()
    out: list[tuple[str, tuple[str, ...]]] = []
    for name, options in value.items():
        where = f"build.target_options.{name}"
        if not _TARGET.fullmatch(name):
            problems.append(f"{where}: must be a plain cmake target name")
            continue
        if not isinstance(options, list) or not options:
            problems.append(f"{where}: must be a non-empty list of compiler options")
            continue
        # Each becomes one quoted CMake argument: nothing that could end it, split it or expand in it.
        bad = [
            o for o in options if not isinstance(o, str) or not o.startswith("-") or _UNSAFE_OPTION.search(o)
        ]
        if bad:
            problems.append(f"{where}: each option must be one compiler flag starting with '-' ({bad[0]!r})")
            continue
        out.append((name, tuple(options)))
    return tuple(out)


def _sources(value: Any, lock_dir: Path, problems: list[str]) -> tuple[Source, ...]:
    if value is None:
        problems.append("source: missing (at least one [[source]] table)")
        return ()
    if not isinstance(value, list) or not value:
        problems.append("source: must be one or more [[source]] tables")
        return ()
    out: list[Source] = []
    for i, item in enumerate(value):
        where = f"source[{i}]"
        if not isinstance(item, dict):
            problems.append(f"{where}: must be a table")
            continue
        kind = item.get("kind")
        if kind not in SOURCE_KINDS:
            shown = "missing" if kind is None else f"unknown kind {kind!r}"
            problems.append(f"{where}.kind: {shown} (expected one of: {', '.join(SOURCE_KINDS)})")
            continue
        before = len(problems)
        _unknown(item, _SOURCE_KEYS[kind], f"{where}.", problems)
        sha256 = _sha256(item, "sha256", f"{where}.sha256", problems)
        subdir = _string(item, "subdir", f"{where}.subdir", problems)
        if subdir and (subdir.startswith("/") or ".." in Path(subdir).parts):
            problems.append(f"{where}.subdir: must be a relative path inside the tarball")
        source = _source_of_kind(kind, item, where, sha256, subdir, lock_dir, problems)
        if len(problems) == before and source is not None:
            out.append(source)
    return tuple(out)


def _source_of_kind(
    kind: SourceKind,
    item: Mapping[str, Any],
    where: str,
    sha256: str,
    subdir: str,
    lock_dir: Path,
    problems: list[str],
) -> Source | None:
    if kind == "pypi-sdist":
        package = _string(item, "package", f"{where}.package", problems)
        version = _string(item, "version", f"{where}.version", problems)
        if version and not re.fullmatch(r"[0-9A-Za-z.+!-]+", version):
            problems.append(f"{where}.version: must be one exact version (no ranges)")
        return Source(kind=kind, sha256=sha256, subdir=subdir, package=package, version=version)
    if kind == "url":
        url = _string(item, "url", f"{where}.url", problems)
        if url and not url.startswith(("https://", "http://")):
            problems.append(f"{where}.url: must be an http(s) URL")
        return Source(kind=kind, sha256=sha256, subdir=subdir, url=url)
    raw_path = _string(item, "path", f"{where}.path", problems)
    resolved = (lock_dir / Path(raw_path).expanduser()) if raw_path else None
    return Source(kind=kind, sha256=sha256, subdir=subdir, path=resolved)


def _reference(value: Any, problems: list[str], where: str = "reference") -> Reference | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        problems.append(f"{where}: must be a table [{where}]")
        return None
    _unknown(value, _REFERENCE_KEYS, f"{where}.", problems)
    sha256 = _sha256(value, "binary_sha256", f"{where}.binary_sha256", problems)
    toolchain = _string(value, "toolchain", f"{where}.toolchain", problems)
    if not sha256 or not toolchain:
        return None
    return Reference(binary_sha256=sha256, toolchain=toolchain)


def _variants(value: Any, problems: list[str]) -> tuple[Variant, ...]:
    if value is None:
        return ()
    if not isinstance(value, dict):
        problems.append("variant: must be tables [variant.NAME]")
        return ()
    out: list[Variant] = []
    for name, table in value.items():
        where = f"variant.{name}"
        if name == DEFAULT_VARIANT or not _NAME.fullmatch(name):
            problems.append(
                f"{where}: a variant's name is lowercase letters, digits, '-', '_' and not "
                f"{DEFAULT_VARIANT!r} (the tables above are that build)"
            )
            continue
        if not isinstance(table, dict):
            problems.append(f"{where}: must be a table [{where}]")
            continue
        before = len(problems)
        _unknown(table, _VARIANT_KEYS, f"{where}.", problems)
        description = _string(table, "description", f"{where}.description", problems)
        args = _cmake_args(table.get("cmake_args"), problems, where)
        requires = _words(table.get("requires", []), f"{where}.requires", _TARGET, problems)
        packages = _words(table.get("packages", []), f"{where}.packages", _PACKAGE, problems)
        runtime = _words(table.get("runtime_packages", []), f"{where}.runtime_packages", _PACKAGE, problems)
        patches = _patches(table.get("patch", []), where, problems)
        reference = _reference(table.get("reference"), problems, f"{where}.reference")
        if len(problems) == before:
            out.append(Variant(name, description, args, patches, requires, packages, runtime, reference))
    return tuple(out)


def _words(value: Any, where: str, shape: re.Pattern[str], problems: list[str]) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and shape.fullmatch(v) for v in value):
        problems.append(f"{where}: must be a list of names")
        return ()
    return tuple(value)


def _patches(value: Any, where: str, problems: list[str]) -> tuple[Patch, ...]:
    if not isinstance(value, list):
        problems.append(f"{where}.patch: must be [[{where}.patch]] tables")
        return ()
    out: list[Patch] = []
    for i, item in enumerate(value):
        at = f"{where}.patch[{i}]"
        if not isinstance(item, dict):
            problems.append(f"{at}: must be a table")
            continue
        before = len(problems)
        _unknown(item, _PATCH_KEYS, f"{at}.", problems)
        name = _string(item, "name", f"{at}.name", problems)
        sha256 = _sha256(item, "sha256", f"{at}.sha256", problems)
        text = _string(item, "text", f"{at}.text", problems)
        if text and not text.startswith("--- a/"):
            problems.append(f"{at}.text: must be a unified diff of the source tree (starting '--- a/')")
        if text and sha256:
            found = hashlib.sha256(text.encode("utf-8")).hexdigest()
            if found != sha256:
                problems.append(f"{at}.text: sha256 is {found}, the lock pins {sha256}")
        if len(problems) == before:
            out.append(Patch(name, sha256, text))
    return tuple(out)
