"""The lock's ``build.target_options`` through a real cmake: the generated file reaches the named target
only, after the build type's flags, and a name the source does not define stops the configure step."""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

from supervisor.artifacts import cmake

# Two projects, as in llama.cpp (the top one and ggml's): the file is included after each project().
PROJECT = """
cmake_minimum_required(VERSION 3.19)
project(top CXX)
add_library(glue STATIC glue.cpp)
add_subdirectory(kernels)
"""
KERNELS = """
project(kernels CXX)
add_library(kernels STATIC kernels.cpp)
"""


def _configure(
    tmp_path: Path, options: tuple[tuple[str, tuple[str, ...]], ...]
) -> subprocess.CompletedProcess[str]:
    src = tmp_path / "src"
    (src / "kernels").mkdir(parents=True)
    (src / "CMakeLists.txt").write_text(PROJECT)
    (src / "kernels" / "CMakeLists.txt").write_text(KERNELS)
    (src / "glue.cpp").write_text("int glue() { return 1; }\n")
    (src / "kernels" / "kernels.cpp").write_text("int kernels() { return 2; }\n")
    script = tmp_path / cmake.TARGET_OPTIONS_FILE
    script.write_text(cmake.target_options_script(options))
    env = cmake.build_env(tmp_path)
    tools = cmake.find_toolchain(env)
    argv = [tools.cmake, "-S", str(src), "-B", str(tmp_path / "build"), "-G", "Unix Makefiles"]
    argv += [
        "-DCMAKE_BUILD_TYPE=Release",
        "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON",
        f"-DCMAKE_PROJECT_INCLUDE={script}",
    ]
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120, check=False)


def _flags(tmp_path: Path, source: str) -> list[str]:
    commands = json.loads((tmp_path / "build" / "compile_commands.json").read_text())
    (entry,) = [c for c in commands if c["file"].endswith(source)]
    return [a for a in shlex.split(entry["command"]) if a.startswith("-O")]


def test_the_named_target_alone_is_compiled_with_its_options_last(tmp_path: Path) -> None:
    done = _configure(tmp_path, (("glue", ("-O2",)),))
    assert done.returncode == 0, done.stderr
    assert _flags(tmp_path, "glue.cpp") == ["-O3", "-O2"]  # the last -O wins
    assert _flags(tmp_path, "kernels.cpp") == ["-O3"]


def test_a_target_the_source_does_not_define_stops_the_configure_step(tmp_path: Path) -> None:
    done = _configure(tmp_path, (("glue", ("-O2",)), ("mtmd", ("-O2",))))
    assert done.returncode != 0
    said = " ".join(done.stderr.split())  # cmake wraps its messages
    assert "build.target_options names mtmd, which this llama.cpp source does not define" in said
