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


def expand_args(args: tuple[str, ...], source_dir: Path, build_dir: Path) -> list[str]:
    return [a.replace("{source_dir}", str(source_dir)).replace("{build_dir}", str(build_dir)) for a in args]


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
