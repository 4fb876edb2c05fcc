"""A fake build toolchain (cmake, make, cc, c++) for fast tests of fetch/unpack/build/install.

The fake ``cmake`` configures by writing a CMakeCache.txt and "builds" by printing Makefile-style
``[ NN%]`` lines and writing ``bin/<target>``: a tiny shell script that prints a version line. It is
steered by environment variables:

  FAKE_CMAKE_FAIL=configure|build   fail that step with a recognisable message
  FAKE_CMAKE_RUNS=<file>            append one line per build step (to count builds)
  FAKE_CMAKE_GATE=<file>            the build step waits (up to 60 s) until this file exists
  FAKE_CMAKE_STARTED=<file>         written (with its pid) when the build step starts
  FAKE_VERSION_LINE=<text>          what the built binary prints (default: the locked one)

A ``llama-quantize`` target gets a fake quantizer instead (``_QUANTIZE``: it really writes its output).
"""

from __future__ import annotations

import hashlib
import stat
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

import pytest

VERSION_LINE = "version: 0.5.0-dev (build 1, commit 0c1e570)"
COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"

# The fake llama-quantize: like the real one it prints the build's version line first on every run,
# refuses a quantized source without --allow-requantize and an unknown type, and writes OUT. The
# "quantized" file is the GGUF magic, the type and the source's sha256, so tests can tell what it was
# made from. FAKE_QUANTIZE_STARTED=<file> gets its pid when it starts; FAKE_QUANTIZE_GATE=<file> makes it
# wait (up to 60 s) for that file after writing the first bytes of OUT, as a real run is killed midway;
# FAKE_QUANTIZE_FAIL=1 makes it fail after writing part of OUT.
_QUANTIZE = r"""
import hashlib, os, sys, time
from pathlib import Path

print("@LINE@", file=sys.stderr, flush=True)
print("built with fake 1.0", file=sys.stderr, flush=True)
args = sys.argv[1:]
flags = [a for a in args if a.startswith("--")]
rest = [a for a in args if not a.startswith("--")]
if "--dry-run" in flags or len(rest) < 3:
    print("main: failed to quantize model (fake dry run)", file=sys.stderr)
    sys.exit(1)
src, out, qtype = Path(rest[0]), Path(rest[1]), rest[2]
if qtype not in ("Q4_K_M", "Q5_K_M", "Q8_0", "F16", "Q6_K", "Q4_0", "BF16"):
    print(f"main: invalid ftype '{qtype}'", file=sys.stderr)
    sys.exit(1)
if os.environ.get("FAKE_QUANTIZE_STARTED"):
    Path(os.environ["FAKE_QUANTIZE_STARTED"]).write_text(str(os.getpid()))
data = src.read_bytes()
if os.environ.get("FAKE_QUANTIZE_FAIL"):
    out.write_bytes(b"GGUF half")
    print("main: failed to quantize model from 'x' (fake)", file=sys.stderr)
    sys.exit(1)
# tiny_gguf names a float source "tiny F16" (or F32, BF16): those convert without the flag.
floating = any(f"tiny {t}".encode() in data for t in ("F16", "F32", "BF16"))
if "--allow-requantize" not in flags and not floating:
    print("main: failed to quantize: requantizing from type q4_K is disabled", file=sys.stderr)
    sys.exit(1)
with out.open("wb") as fh:
    fh.write(b"GGUF")
    fh.flush()
    for i in (1, 2):
        print(f"[{i:4d}/   2]  blk.{i}.weight - converting to {qtype.lower()}", file=sys.stderr, flush=True)
    gate = os.environ.get("FAKE_QUANTIZE_GATE")
    if gate:
        deadline = time.monotonic() + 60
        while not Path(gate).exists() and time.monotonic() < deadline:
            time.sleep(0.02)
    fh.write(f" fake {qtype} of {hashlib.sha256(data).hexdigest()}\n".encode())
print("main: quantize time =    12.00 ms")
"""

_CMAKE = r"""
import os, sys, time, json
from pathlib import Path

args = sys.argv[1:]
if args == ["--version"]:
    print("cmake version 3.99.0-fake")
    sys.exit(0)
if args and args[0] == "--build":
    build = Path(args[1])
    target = args[args.index("--target") + 1]
    if os.environ.get("FAKE_CMAKE_STARTED"):
        Path(os.environ["FAKE_CMAKE_STARTED"]).write_text(str(os.getpid()))
    gate = os.environ.get("FAKE_CMAKE_GATE")
    if gate:
        deadline = time.monotonic() + 60
        while not Path(gate).exists():
            if time.monotonic() > deadline:
                print("fake cmake: gate never opened", flush=True)
                sys.exit(3)
            time.sleep(0.02)
    if os.environ.get("FAKE_CMAKE_RUNS"):
        with open(os.environ["FAKE_CMAKE_RUNS"], "a") as fh:
            fh.write(f"{os.getpid()}\n")
    for pct in (5, 40, 80):
        print(f"[{pct:3d}%] Building CXX object fake/step{pct}.cpp.o", flush=True)
    if os.environ.get("FAKE_CMAKE_FAIL") == "build":
        print("fake.cpp:1:1: error: the fake compiler was told to fail", flush=True)
        sys.exit(2)
    out = build / "bin" / target
    out.parent.mkdir(parents=True, exist_ok=True)
    line = os.environ.get("FAKE_VERSION_LINE", "@VERSION_LINE@")
    if target == "llama-quantize":
        out.write_text(f"#!{sys.executable}\n" + QUANTIZE.replace("@LINE@", line))
    else:
        # --version answers like llama-server; anything else fails like a model that does not load.
        out.write_text(
            "#!/bin/sh\n"
            'if [ "$1" = "--version" ]; then\n'
            f"  echo '{line}' >&2\n  echo 'built with fake 1.0' >&2\n  exit 0\nfi\n"
            "echo 'main: loading model' >&2\necho 'main: failed to load model (fake)' >&2\nexit 1\n"
        )
    out.chmod(0o755)
    print(f"[100%] Built target {target}", flush=True)
    sys.exit(0)
src = Path(args[args.index("-S") + 1])
build = Path(args[args.index("-B") + 1])
if not (src / "CMakeLists.txt").is_file():
    print(f"CMake Error: no CMakeLists.txt in {src}", flush=True)
    sys.exit(1)
if os.environ.get("FAKE_CMAKE_FAIL") == "configure":
    print("CMake Error: the fake cmake was told to fail", flush=True)
    sys.exit(1)
build.mkdir(parents=True, exist_ok=True)
bindir = Path(sys.argv[0]).parent
(build / "CMakeCache.txt").write_text(
    f"CMAKE_C_COMPILER:FILEPATH={bindir / 'cc'}\nCMAKE_CXX_COMPILER:FILEPATH={bindir / 'c++'}\n"
)
print("-- fake cmake args: " + json.dumps(args), flush=True)
print("-- fake source: " + (src / "CMakeLists.txt").read_text().splitlines()[0], flush=True)
print("-- Configuring done", flush=True)
"""

_CC = "#!/bin/sh\necho 'fake-cc (Fake) 1.0'\n"
_MAKE = "#!/bin/sh\necho 'GNU Make 0.0-fake'\n"


def _write(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def install_fake_toolchain(bin_dir: Path, tools: tuple[str, ...] = ("cmake", "make", "cc", "c++")) -> Path:
    bin_dir.mkdir(parents=True, exist_ok=True)
    for tool in tools:
        if tool == "cmake":
            body = _CMAKE.replace("@VERSION_LINE@", VERSION_LINE).replace(
                "QUANTIZE.replace", f"{_QUANTIZE!r}.replace"
            )
            _write(bin_dir / "cmake", f"#!{sys.executable}\n{body}")
        elif tool == "make":
            _write(bin_dir / "make", _MAKE)
        else:
            _write(bin_dir / tool, _CC)
    return bin_dir


def make_source_tarball(path: Path, top: str = "llama.cpp-fake") -> Path:
    """A tiny tarball laid out like a llama.cpp source tree (``<top>/CMakeLists.txt``)."""
    src = path.parent / f"{path.name}.src"
    (src / top).mkdir(parents=True, exist_ok=True)
    (src / top / "CMakeLists.txt").write_text("project(fake)\n")
    (src / top / "README.md").write_text("fake llama.cpp tree\n")
    with tarfile.open(path, "w:gz") as tar:
        tar.add(src / top, arcname=top)
    return path


def write_lock(path: Path, tarball: Path, sha256: str, *, subdir: str = "llama.cpp-fake") -> Path:
    path.write_text(
        f"""format = 1

[llama_cpp]
commit = "{COMMIT}"
version_line = "{VERSION_LINE}"

[build]
target = "llama-server"
cmake_args = ["-DCMAKE_BUILD_TYPE=Release", "-DCMAKE_C_FLAGS=-ffile-prefix-map={{source_dir}}=llama.cpp"]

[[source]]
kind = "file"
path = "{tarball}"
sha256 = "{sha256}"
subdir = "{subdir}"
"""
    )
    return path


def path_with(bin_dir: Path) -> str:
    """PATH holding only the fake tools: the fakes use absolute shebangs, and on a merged-/usr
    system /bin would bring the real cmake and compilers back."""
    return str(bin_dir)


@dataclass(frozen=True)
class FakeProject:
    root: Path
    bin_dir: Path
    tarball: Path
    sha256: str
    lock: Path
    cache: Path


def fake_project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeProject:
    """A lock with a ``file`` source, a fake toolchain first on PATH, a private cache."""
    bin_dir = install_fake_toolchain(tmp_path / "bin")
    tarball = make_source_tarball(tmp_path / "llama.cpp-fake.tar.gz")
    sha = hashlib.sha256(tarball.read_bytes()).hexdigest()
    lock = write_lock(tmp_path / "llama-build.lock", tarball, sha)
    monkeypatch.setenv("PATH", path_with(bin_dir))
    cache = tmp_path / "cache"
    monkeypatch.setenv("LLAMAGATE_CACHE_DIR", str(cache))
    return FakeProject(tmp_path, bin_dir, tarball, sha, lock, cache)


def tiny_gguf(path: Path, file_type: str = "Q4_K_M") -> Path:
    """A GGUF with a header and no tensors that says it is ``file_type`` (general.file_type)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(f"tiny {file_type}")
    writer.add_file_type(gguf.LlamaFileType[f"MOSTLY_{file_type}" if file_type != "F32" else "ALL_F32"].value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
