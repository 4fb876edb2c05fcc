"""Drive cmake: check the toolchain is there, configure, compile one target with visible progress.

The environment of the build is trimmed on purpose: CFLAGS/CXXFLAGS/LDFLAGS/CPPFLAGS and MAKEFLAGS from
the caller's shell would silently change the binary, and ``GIT_CEILING_DIRECTORIES`` stops ggml's
cmake from running ``git rev-parse`` against whatever repository encloses the build folder (its
commit would end up in the binary). CC and CXX are honoured: they choose the toolchain, and the
receipt records which compilers were used.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from supervisor.artifacts.lock import Lock, Patch
from supervisor.errors import BuildError, ToolMissing
from supervisor.progress import Progress
from supervisor.subproc import run_streaming

_PERCENT = re.compile(r"^\[\s*(\d{1,3})%\]")
_DROPPED_ENV = ("CFLAGS", "CXXFLAGS", "CPPFLAGS", "LDFLAGS", "MAKEFLAGS", "MFLAGS", "GNUMAKEFLAGS")


@dataclass(frozen=True)
class Toolchain:
    cmake: str
    make: str
    cmake_version: str


def build_env(work: Path, base: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in _DROPPED_ENV}
    env["LC_ALL"] = "C"
    env["GIT_CEILING_DIRECTORIES"] = str(work)
    return env


def find_toolchain(env: Mapping[str, str]) -> Toolchain:
    path = env.get("PATH", "")
    cmake = shutil.which("cmake", path=path)
    if cmake is None:
        raise ToolMissing("cmake not found on PATH: install it (Debian/Ubuntu: apt-get install cmake)")
    make = shutil.which("make", path=path)
    if make is None:
        raise ToolMissing("make not found on PATH: install it (Debian/Ubuntu: apt-get install make)")
    cxx = _compiler(env, "CXX", ("c++", "g++", "clang++"))
    if cxx is None:
        raise ToolMissing(
            "no C++ compiler found ($CXX, c++, g++, clang++): "
            "install one (Debian/Ubuntu: apt-get install g++)"
        )
    cc = _compiler(env, "CC", ("cc", "gcc", "clang"))
    if cc is None:
        raise ToolMissing(
            "no C compiler found ($CC, cc, gcc, clang): install one (Debian/Ubuntu: apt-get install gcc)"
        )
    return Toolchain(cmake=cmake, make=make, cmake_version=first_line([cmake, "--version"], env))


def _compiler(env: Mapping[str, str], var: str, names: tuple[str, ...]) -> str | None:
    path = env.get("PATH", "")
    explicit = env.get(var)
    if explicit:
        return shutil.which(explicit.split()[0], path=path)
    for name in names:
        found = shutil.which(name, path=path)
        if found:
            return found
    return None


def first_line(argv: list[str], env: Mapping[str, str]) -> str:
    try:
        out = subprocess.run(
            argv, capture_output=True, text=True, env=dict(env), timeout=30, check=False, errors="replace"
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({argv[0]}: {exc})"
    lines = (out.stdout or out.stderr).strip().splitlines()
    return lines[0].strip() if lines else "unknown"


def check_requires(lock: Lock, env: Mapping[str, str]) -> None:
    """The programs a variant's build runs (``requires``), before anything is fetched: a host without
    them (a CUDA variant where there is no nvcc) is refused at once with what to install."""
    missing = [tool for tool in lock.requires if shutil.which(tool, path=env.get("PATH", "")) is None]
    if missing:
        packages = f" (Debian packages: {' '.join(lock.packages)})" if lock.packages else ""
        raise ToolMissing(
            f"build variant {lock.variant!r} needs {', '.join(missing)} on PATH, and this host has none: "
            f"install it{packages}, or build another variant ({', '.join(lock.variants)})"
        )


def apply_patch(patch: Patch, source_dir: Path, env: Mapping[str, str], log_path: Path) -> None:
    """Apply one of the lock's patches with ``patch -p1``, exactly: no fuzz, no reversed or already
    applied hunks, so a source that moved under the patch fails here instead of building something
    else. The diff is written beside the source tree (never inside it, where cmake would see it)."""
    tool = shutil.which("patch", path=env.get("PATH", ""))
    if tool is None:
        raise ToolMissing("patch not found on PATH: install it (Debian/Ubuntu: apt-get install patch)")
    diff = source_dir.parent / f"llamagate-{patch.sha256[:16]}.patch"
    diff.write_text(patch.text, encoding="utf-8")
    argv = [tool, "-p1", "--forward", "--batch", "--fuzz=0", "-d", str(source_dir), "-i", str(diff)]
    result = run_streaming(argv, env=env, log_path=log_path)
    if result.returncode != 0:
        raise BuildError(_failure(f"patch {patch.name!r}", result.returncode, result.tail, log_path))


def expand_args(args: tuple[str, ...], source_dir: Path, build_dir: Path) -> list[str]:
    return [a.replace("{source_dir}", str(source_dir)).replace("{build_dir}", str(build_dir)) for a in args]


TARGET_OPTIONS_FILE = "llamagate-target-options.cmake"


def target_options_script(options: tuple[tuple[str, tuple[str, ...]], ...]) -> str:
    """CMake code that appends the lock's ``build.target_options`` to each named target's compile options.

    Passed as ``CMAKE_PROJECT_INCLUDE``, it runs after each ``project()`` call (llama.cpp's, then
    ggml's: hence the guard) and defers its work to the end of the top-level folder, when every target
    exists. A target's own options come after ``CMAKE_<LANG>_FLAGS_<CONFIG>`` on the compiler's command
    line, so ``-O1`` there wins over Release's ``-O3`` for that target only. A name the source does not
    define stops the configure step: a lock that silently optimised nothing would be a lie.
    The lock allows no whitespace, quote, bracket, ``;``, ``$`` or backslash in an option, so each one
    is a single quoted CMake argument."""
    lines = [
        "# Generated by llamagate from llama-build.lock's build.target_options; do not edit.",
        "include_guard(GLOBAL)",
        "function(_llamagate_target_options)",
    ]
    for target, flags in options:
        quoted = " ".join(f'"{flag}"' for flag in flags)
        lines += [
            f'  if(NOT TARGET "{target}")',
            f'    message(FATAL_ERROR "llama-build.lock: build.target_options names {target}, '
            'which this llama.cpp source does not define")',
            "  endif()",
            f'  target_compile_options("{target}" PRIVATE {quoted})',
        ]
    lines += [
        "endfunction()",
        'cmake_language(DEFER DIRECTORY "${CMAKE_SOURCE_DIR}" CALL _llamagate_target_options)',
        "",
    ]
    return "\n".join(lines)


def configure(
    tools: Toolchain,
    source_dir: Path,
    build_dir: Path,
    args: list[str],
    env: Mapping[str, str],
    log_path: Path,
) -> None:
    argv = [tools.cmake, "-S", str(source_dir), "-B", str(build_dir), "-G", "Unix Makefiles", *args]
    result = run_streaming(argv, env=env, log_path=log_path)
    if result.returncode != 0:
        raise BuildError(_failure("cmake configure", result.returncode, result.tail, log_path))


def compile_target(
    tools: Toolchain,
    build_dir: Path,
    target: str,
    jobs: int,
    env: Mapping[str, str],
    log_path: Path,
    progress: Progress,
) -> None:
    def on_line(line: str) -> None:
        m = _PERCENT.match(line)
        if m:
            progress.update("compile", int(m.group(1)) / 100, line[m.end() :].strip()[:80])

    argv = [tools.cmake, "--build", str(build_dir), "--target", target, "-j", str(jobs)]
    result = run_streaming(argv, env=env, log_path=log_path, on_line=on_line)
    if result.returncode != 0:
        raise BuildError(
            _failure(f"cmake --build --target {target}", result.returncode, result.tail, log_path)
        )
    progress.done("compile", target)


def compilers_used(build_dir: Path, env: Mapping[str, str]) -> tuple[str, ...]:
    """First ``--version`` line of the C and C++ compilers cmake chose (read from its cache)."""
    found: list[str] = []
    try:
        cache = (build_dir / "CMakeCache.txt").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ("unknown",)
    for var in ("CMAKE_C_COMPILER", "CMAKE_CXX_COMPILER"):
        m = re.search(rf"^{var}:[A-Z]+=(.+)$", cache, re.MULTILINE)
        if m:
            found.append(f"{Path(m.group(1)).name}: {first_line([m.group(1), '--version'], env)}")
    return tuple(found) or ("unknown",)


def _failure(what: str, code: int, tail: tuple[str, ...], log_path: Path) -> str:
    shown = "\n    ".join(tail[-25:])
    return f"{what} failed (exit {code}); full log: {log_path}\n  last lines:\n    {shown}"


def default_jobs() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)
