from __future__ import annotations

import hashlib
import tomllib
from pathlib import Path

import pytest

from supervisor.artifacts.lock import load_lock, lock_digest, parse_lock
from supervisor.errors import LockError

REPO = Path(__file__).resolve().parents[2]
SHA = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"

GOOD = f"""
format = 1

[llama_cpp]
commit = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"
version_line = "version: 0.5.0-dev (build 1, commit 0c1e570)"

[build]
target = "llama-server"
cmake_args = ["-DGGML_NATIVE=OFF", "-DCMAKE_C_FLAGS=-ffile-prefix-map={{source_dir}}=x"]

[[source]]
kind = "pypi-sdist"
package = "llama-cpp-python"
version = "0.3.36"
sha256 = "{SHA}"
subdir = "llama_cpp_python-0.3.36/vendor/llama.cpp"

[[source]]
kind = "url"
url = "https://mirror.example.org/x.tar.gz"
sha256 = "{SHA}"
subdir = "x/vendor/llama.cpp"

[[source]]
kind = "file"
path = "mirror/x.tar.gz"
sha256 = "{SHA}"
subdir = "x/vendor/llama.cpp"
"""


def test_shipped_lock_is_valid_and_the_package_symlink_points_to_it() -> None:
    lock = load_lock(REPO / "llama-build.lock")
    assert lock.commit == "0c1e57098bba43ac29e6e3b677cdceebdd22334f"
    assert lock.sources[0].kind == "pypi-sdist"
    assert lock.sources[0].sha256 == SHA
    assert "-DGGML_NATIVE=OFF" in lock.cmake_args
    assert lock.target == "llama-server"
    packaged = REPO / "supervisor" / "data" / "llama-build.lock"
    assert packaged.is_symlink()
    assert load_lock(packaged).digest == lock.digest


def test_good_lock_parses_all_three_source_kinds(tmp_path: Path) -> None:
    lock = parse_lock(GOOD, tmp_path / "llama-build.lock")
    assert [s.kind for s in lock.sources] == ["pypi-sdist", "url", "file"]
    assert lock.sources[2].path == tmp_path / "mirror/x.tar.gz"  # relative to the lock's folder
    assert lock.version_line.endswith("commit 0c1e570)")
    assert len(lock.digest) == 64


def test_digest_ignores_comments_and_layout_but_not_content(tmp_path: Path) -> None:
    base = parse_lock(GOOD, tmp_path / "l").digest
    assert parse_lock("# a comment\n" + GOOD.replace("format = 1", "format=1"), tmp_path / "l").digest == base
    changed = GOOD.replace("-DGGML_NATIVE=OFF", "-DGGML_NATIVE=ON")
    assert parse_lock(changed, tmp_path / "l").digest != base


def test_reference_table_does_not_change_the_digest(tmp_path: Path) -> None:
    with_ref = GOOD + f'\n[reference]\nbinary_sha256 = "{SHA}"\ntoolchain = "gcc 12.2.0"\n'
    lock = parse_lock(with_ref, tmp_path / "l")
    assert lock.reference is not None and lock.reference.binary_sha256 == SHA
    assert lock.digest == parse_lock(GOOD, tmp_path / "l").digest


def _with_options(table: str) -> str:
    head, sources = GOOD.split("[[source]]", 1)
    return f"{head}[build.target_options]\n{table}\n\n[[source]]{sources}"


def test_target_options_are_parsed_in_order_and_change_the_digest(tmp_path: Path) -> None:
    lock = parse_lock(_with_options('mtmd = ["-O2"]\nllama-common = ["-O2", "-fno-plt"]'), tmp_path / "l")
    assert lock.target_options == (("mtmd", ("-O2",)), ("llama-common", ("-O2", "-fno-plt")))
    assert parse_lock(GOOD, tmp_path / "l").target_options == ()
    assert lock.digest != parse_lock(GOOD, tmp_path / "l").digest
    shipped = load_lock(REPO / "llama-build.lock")
    # The kernels and libllama keep Release's -O3 (docs/build.md, "Compile time").
    assert not {"ggml", "ggml-base", "ggml-cpu", "llama"} & {t for t, _ in shipped.target_options}


BAD = [
    (_with_options('mtmd = "-O2"'), "build.target_options.mtmd: must be a non-empty list"),
    (_with_options("mtmd = []"), "build.target_options.mtmd: must be a non-empty list"),
    (_with_options('"a b" = ["-O2"]'), "build.target_options.a b: must be a plain cmake target name"),
    (_with_options('mtmd = ["O2"]'), "build.target_options.mtmd: each option must be one compiler flag"),
    (_with_options('mtmd = ["-O2 -g"]'), "build.target_options.mtmd: each option must be one compiler flag"),
    (_with_options('mtmd = ["-D${X}"]'), "build.target_options.mtmd: each option must be one compiler flag"),
    (_with_options('mtmd = ["-O2\\")"]'), "build.target_options.mtmd: each option must be one compiler flag"),
    (
        _with_options('mtmd = ["-O2"]').replace(
            "cmake_args = [", 'cmake_args = ["-DCMAKE_PROJECT_INCLUDE=/x",'
        ),
        "build.cmake_args: CMAKE_PROJECT_INCLUDE is llamagate's",
    ),
    (GOOD.replace("format = 1", ""), "format: missing"),
    (GOOD.replace("format = 1", "format = 2"), "format: 2 is not supported"),
    (GOOD.replace('commit = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"', ""), "llama_cpp.commit: missing"),
    (GOOD.replace("0c1e57098bba43ac29e6e3b677cdceebdd22334f", "0c1e570"), "llama_cpp.commit: must be a full"),
    (GOOD.replace("commit 0c1e570)", "commit deadbee)"), "llama_cpp.version_line: does not mention"),
    (GOOD.replace('target = "llama-server"', ""), "build.target: missing"),
    (GOOD.replace('target = "llama-server"', 'target = "a b"'), "build.target: must be a plain"),
    (GOOD.replace('cmake_args = ["-DGGML_NATIVE=OFF",', "cmake_args = [1,"), "build.cmake_args[0]: must be"),
    (GOOD.replace("{source_dir}", "{src}"), "build.cmake_args[1]: unknown placeholder {src}"),
    (GOOD.replace('"-DGGML_NATIVE=OFF"', '"-S/tmp"'), "build.cmake_args[0]: source and build folders"),
    (GOOD.replace(f'sha256 = "{SHA}"', 'sha256 = "abc"', 1), "source[0].sha256: must be 64 lowercase hex"),
    (GOOD.replace(f'sha256 = "{SHA}"', f'sha256 = "{SHA.upper()}"', 1), "source[0].sha256: must be 64"),
    (GOOD.replace('kind = "url"', 'kind = "git"'), "source[1].kind: unknown kind 'git'"),
    (GOOD.replace('kind = "url"', ""), "source[1].kind: missing"),
    (GOOD.replace('url = "https://', 'url = "ftp://'), "source[1].url: must be an http(s) URL"),
    (GOOD.replace('path = "mirror/x.tar.gz"', ""), "source[2].path: missing"),
    (
        GOOD.replace('subdir = "x/vendor/llama.cpp"', 'subdir = "../x"', 1),
        "source[1].subdir: must be a relative",
    ),
    (GOOD.replace('version = "0.3.36"', 'version = ">=0.3"'), "source[0].version: must be one exact version"),
    (GOOD.replace('kind = "file"', 'kind = "file"\nmirror = "x"'), "source[2].mirror: unknown key"),
    (GOOD.replace("[build]", "[build]\njobs = 4"), "build.jobs: unknown key"),
    (GOOD + "\nextra = 1\n", "extra: unknown key"),
    (GOOD.split("[[source]]")[0], "source: missing"),
    (GOOD + '\n[reference]\nbinary_sha256 = "x"\ntoolchain = "gcc"\n', "reference.binary_sha256: must be 64"),
    ("format = 1\n[llama_cpp\n", "not valid TOML"),
]


@pytest.mark.parametrize(("text", "message"), BAD, ids=[m for _, m in BAD])
def test_bad_lock_is_refused_naming_the_field(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(LockError) as info:
        parse_lock(text, tmp_path / "llama-build.lock")
    assert message in str(info.value)
    assert "llama-build.lock" in str(info.value)


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    text = GOOD.replace("format = 1", "format = 9").replace('kind = "url"', 'kind = "git"')
    with pytest.raises(LockError) as info:
        parse_lock(text, tmp_path / "l")
    assert "format: 9" in str(info.value) and "source[1].kind" in str(info.value)


def test_missing_lock_file_is_a_lock_error(tmp_path: Path) -> None:
    with pytest.raises(LockError, match="lock file not found"):
        load_lock(tmp_path / "nope.lock")


PATCH = "--- a/x.c\n+++ b/x.c\n@@ -1 +1 @@\n-a\n+b\n"


def _variant(patch: str = PATCH, sha: str | None = None, extra: str = "") -> str:
    sha = sha or hashlib.sha256(patch.encode()).hexdigest()
    return (
        f'\n[variant.gpu]\ndescription = "d"\ncmake_args = ["-DGGML_VULKAN=ON"]\n{extra}'
        f"\n[[variant.gpu.patch]]\nname = \"p\"\nsha256 = \"{sha}\"\ntext = '''\n{patch}'''\n"
    )


def test_a_variant_adds_its_args_and_patches_and_has_its_own_digest(tmp_path: Path) -> None:
    text = GOOD + _variant()
    cpu = parse_lock(text, tmp_path / "l")
    gpu = parse_lock(text, tmp_path / "l", "gpu")
    assert cpu.variants == gpu.variants == ("cpu", "gpu")
    assert cpu.digest == parse_lock(GOOD, tmp_path / "l").digest  # the tables leave the default's digest
    assert cpu.variant == "cpu" and cpu.patches == () and "-DGGML_VULKAN=ON" not in cpu.cmake_args
    assert gpu.variant == "gpu" and gpu.cmake_args == (*cpu.cmake_args, "-DGGML_VULKAN=ON")
    assert [p.text for p in gpu.patches] == [PATCH] and gpu.digest != cpu.digest
    # The patch and the variant's args are build inputs; its description and reference are not.
    other = PATCH.replace("+b", "+c")
    assert parse_lock(GOOD + _variant(other), tmp_path / "l", "gpu").digest != gpu.digest
    ref = f'[variant.gpu.reference]\nbinary_sha256 = "{SHA}"\ntoolchain = "t"\n'
    runtime = 'runtime_packages = ["libvulkan1"]\n'
    noted = parse_lock(GOOD + _variant(extra=runtime + ref).replace('"d"', '"e"'), tmp_path / "l", "gpu")
    assert noted.digest == gpu.digest and noted.reference is not None and noted.reference.toolchain == "t"
    assert noted.runtime_packages == ("libvulkan1",)


def test_the_shipped_variants_leave_the_cpu_digest_as_it_was() -> None:
    raw = tomllib.loads((REPO / "llama-build.lock").read_text())
    assert set(raw["variant"]) == {"vulkan", "cuda"}
    without = {k: v for k, v in raw.items() if k != "variant"}
    assert load_lock(REPO / "llama-build.lock").digest == lock_digest(without)
    vulkan = load_lock(REPO / "llama-build.lock", "vulkan")
    assert "-DGGML_VULKAN=ON" in vulkan.cmake_args and vulkan.requires == ("glslc",)
    assert [p.name for p in vulkan.patches] == ["ggml-vulkan: build without VK_EXT_layer_settings"]
    assert vulkan.reference is not None  # built twice from empty caches: the same bytes (docs/build.md)
    assert vulkan.reference.binary_sha256 != load_lock(REPO / "llama-build.lock").reference.binary_sha256  # type: ignore[union-attr]
    assert load_lock(REPO / "llama-build.lock", "cuda").requires == ("nvcc",)


BAD_VARIANTS = [
    (_variant(sha="0" * 64), "variant.gpu.patch[0].text: sha256 is"),
    (_variant("diff x\n"), "variant.gpu.patch[0].text: must be a unified diff"),
    (
        _variant().replace("[variant.gpu]", "[variant.cpu]").replace("variant.gpu.", "variant.cpu."),
        "variant.cpu:",
    ),
    (_variant(extra="jobs = 2\n"), "variant.gpu.jobs: unknown key"),
    (_variant(extra='requires = ["a b"]\n'), "variant.gpu.requires: must be a list of names"),
    (_variant(extra='packages = ["Bad"]\n'), "variant.gpu.packages: must be a list of names"),
    (
        _variant().replace('cmake_args = ["-DGGML_VULKAN=ON"]', 'cmake_args = ["-S/x"]'),
        "variant.gpu.cmake_args[0]",
    ),
]


@pytest.mark.parametrize(("text", "message"), BAD_VARIANTS, ids=[m for _, m in BAD_VARIANTS])
def test_bad_variant_is_refused_naming_the_field(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(LockError) as info:
        parse_lock(GOOD + text, tmp_path / "llama-build.lock")
    assert message in str(info.value)


def test_an_undeclared_variant_is_refused_naming_the_declared_ones(tmp_path: Path) -> None:
    with pytest.raises(LockError, match=r"no build variant 'metal' \(this lock declares: cpu, gpu\)"):
        parse_lock(GOOD + _variant(), tmp_path / "l", "metal")
