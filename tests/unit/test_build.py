"""Fetch -> unpack -> cmake -> install -> receipt, with a fake toolchain (no 5-minute compiles)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from supervisor.artifacts import build as build_mod
from supervisor.artifacts.build import ensure_binary, find_installed, install_dir
from supervisor.artifacts.lock import load_lock
from supervisor.artifacts.receipt import read_receipt
from supervisor.errors import BuildError, DigestMismatch, FetchError, ToolMissing
from supervisor.progress import NullProgress
from tests.fakes.toolchain import VERSION_LINE, FakeProject, fake_project, write_lock


class Recorder:
    def __init__(self) -> None:
        self.updates: list[tuple[str, float | None, str]] = []

    def update(self, stage: str, fraction: float | None, detail: str = "") -> None:
        self.updates.append((stage, fraction, detail))

    def done(self, stage: str, detail: str = "") -> None:
        self.updates.append((stage, 1.0, "done " + detail))


@pytest.fixture
def proj(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeProject:
    return fake_project(tmp_path, monkeypatch)


def _leftovers(cache: Path) -> list[str]:
    return sorted(p.name for p in (cache / "llama-server").glob(".build-*"))


def test_build_installs_binary_and_receipt(proj: FakeProject) -> None:
    rec = Recorder()
    got = ensure_binary(proj.lock, cache=proj.cache, progress=rec)
    lock = load_lock(proj.lock)
    assert not got.cache_hit
    assert got.path == install_dir(lock, proj.cache) / "llama-server"
    assert got.path.parent.name == lock.digest[:16]
    r = read_receipt(got.path.parent / "receipt.json")
    assert r == got.receipt
    assert r.lock_digest == lock.digest
    assert r.llama_cpp_commit == lock.commit
    assert r.source_kind == "file" and r.source_sha256 == proj.sha256
    assert r.cmake_args == lock.cmake_args
    assert r.compilers == ("cc: fake-cc (Fake) 1.0", "c++: fake-cc (Fake) 1.0")
    assert r.cmake_version == "cmake version 3.99.0-fake"
    assert r.version_output.splitlines()[0] == VERSION_LINE
    assert r.binary_size == got.path.stat().st_size
    assert r.reference_match is None
    assert (got.path.parent / "build.log").is_file()
    assert _leftovers(proj.cache) == []
    # Compile progress came from cmake's "[ NN%]" lines.
    compile_fractions = [f for s, f, _ in rec.updates if s == "compile"]
    assert compile_fractions[:3] == [0.05, 0.40, 0.80]


def test_placeholders_are_expanded_to_the_real_folders(
    proj: FakeProject, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Fail the compile so the build log (which records the fake cmake's arguments) is kept.
    monkeypatch.setenv("FAKE_CMAKE_FAIL", "build")
    with pytest.raises(BuildError):
        ensure_binary(proj.lock, cache=proj.cache, progress=NullProgress())
    log = next((proj.cache / "llama-server").glob("*.build.log")).read_text()
    args = json.loads(log.split("-- fake cmake args: ", 1)[1].splitlines()[0])
    flags = next(a for a in args if a.startswith("-DCMAKE_C_FLAGS="))
    source_dir = flags.split("-ffile-prefix-map=", 1)[1].split("=", 1)[0]
    assert source_dir.endswith("/src/llama.cpp-fake") and Path(source_dir).is_absolute()
    assert "{source_dir}" not in log


def test_second_build_is_a_cache_hit_without_running_cmake(
    proj: FakeProject, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs = proj.root / "runs"
    monkeypatch.setenv("FAKE_CMAKE_RUNS", str(runs))
    first = ensure_binary(proj.lock, cache=proj.cache, progress=NullProgress())
    second = ensure_binary(proj.lock, cache=proj.cache, progress=NullProgress())
    assert second.cache_hit and second.path == first.path and second.receipt == first.receipt
    assert len(runs.read_text().splitlines()) == 1
    found = find_installed(proj.lock, cache=proj.cache)
    assert found is not None and found.path == first.path


def test_find_installed_is_none_before_a_build(proj: FakeProject) -> None:
    assert find_installed(proj.lock, cache=proj.cache) is None


def test_cache_root_comes_from_the_environment(proj: FakeProject) -> None:
    got = ensure_binary(proj.lock, progress=NullProgress())  # LLAMAGATE_CACHE_DIR set by fake_project
    assert got.path.is_relative_to(proj.cache)


def test_source_sha256_mismatch_installs_nothing(proj: FakeProject) -> None:
    wrong = "ef" * 32
    lock = write_lock(proj.root / "bad.lock", proj.tarball, wrong)
    with pytest.raises(FetchError) as info:
        ensure_binary(lock, cache=proj.cache, progress=NullProgress())
    assert wrong in str(info.value) and proj.sha256 in str(info.value)
    assert find_installed(lock, cache=proj.cache) is None
    assert not install_dir(load_lock(lock), proj.cache).exists()
    assert list((proj.cache / "sources").iterdir()) == []
    assert _leftovers(proj.cache) == []


@pytest.mark.parametrize(
    ("tools", "message"),
    [
        (("make", "cc", "c++"), "cmake not found on PATH: install it (Debian/Ubuntu: apt-get install cmake)"),
        (("cmake", "cc", "c++"), "make not found on PATH"),
        (("cmake", "make", "cc"), "no C++ compiler found"),
        (("cmake", "make", "c++"), "no C compiler found"),
    ],
)
def test_missing_tool_is_one_clear_line(
    proj: FakeProject, monkeypatch: pytest.MonkeyPatch, tools: tuple[str, ...], message: str
) -> None:
    from tests.fakes.toolchain import install_fake_toolchain, path_with

    partial = install_fake_toolchain(proj.root / "partial-bin", tools)
    monkeypatch.setenv("PATH", path_with(partial))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(ToolMissing) as info:
        ensure_binary(proj.lock, cache=proj.cache, progress=NullProgress())
    assert message in str(info.value)
    assert "\n" not in str(info.value)
    assert info.value.exit_code == 1
    assert _leftovers(proj.cache) == []


def test_failed_compile_raises_with_the_log_tail_and_installs_nothing(
    proj: FakeProject, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_CMAKE_FAIL", "build")
    with pytest.raises(BuildError) as info:
        ensure_binary(proj.lock, cache=proj.cache, progress=NullProgress())
    message = str(info.value)
    assert "the fake compiler was told to fail" in message
    kept = proj.cache / "llama-server" / f"{load_lock(proj.lock).digest[:16]}.build.log"
    assert str(kept) in message and "told to fail" in kept.read_text()
    assert find_installed(proj.lock, cache=proj.cache) is None
    assert _leftovers(proj.cache) == []


def test_failed_configure_is_a_build_error(proj: FakeProject, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_CMAKE_FAIL", "configure")
    with pytest.raises(BuildError, match="cmake configure failed"):
        ensure_binary(proj.lock, cache=proj.cache, progress=NullProgress())


def test_binary_reporting_another_version_is_refused(
    proj: FakeProject, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_VERSION_LINE", "version: 0.5.0-dev (build 7, commit deadbee)")
    with pytest.raises(BuildError, match="wrong version") as info:
        ensure_binary(proj.lock, cache=proj.cache, progress=NullProgress())
    assert VERSION_LINE in str(info.value) and "deadbee" in str(info.value)
    assert find_installed(proj.lock, cache=proj.cache) is None


def test_wrong_subdir_is_a_build_error(proj: FakeProject) -> None:
    lock = write_lock(proj.root / "l2.lock", proj.tarball, proj.sha256, subdir="elsewhere")
    with pytest.raises(BuildError, match=r"no CMakeLists\.txt under 'elsewhere'"):
        ensure_binary(lock, cache=proj.cache, progress=NullProgress())


def test_interrupted_build_leaves_no_half_install(proj: FakeProject) -> None:
    class Interrupt(Recorder):
        def update(self, stage: str, fraction: float | None, detail: str = "") -> None:
            if stage == "compile" and fraction is not None and fraction >= 0.4:
                raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        ensure_binary(proj.lock, cache=proj.cache, progress=Interrupt())
    assert find_installed(proj.lock, cache=proj.cache) is None
    assert not install_dir(load_lock(proj.lock), proj.cache).exists()
    assert _leftovers(proj.cache) == []
    # ... and the next build succeeds.
    assert ensure_binary(proj.lock, cache=proj.cache, progress=NullProgress()).path.is_file()


def test_leftover_of_a_killed_build_is_removed_by_the_next_build(proj: FakeProject) -> None:
    key = load_lock(proj.lock).digest[:16]
    dead = proj.cache / "llama-server" / f".build-{key}-deadbeef"
    (dead / "build").mkdir(parents=True)
    other_dead = proj.cache / "llama-server" / ".build-0123456789abcdef-cafe"
    other_dead.mkdir()
    ensure_binary(proj.lock, cache=proj.cache, progress=NullProgress())
    assert _leftovers(proj.cache) == []


def test_tampered_install_is_reported_not_served_and_not_rebuilt(proj: FakeProject) -> None:
    got = ensure_binary(proj.lock, cache=proj.cache, progress=NullProgress())
    data = bytearray(got.path.read_bytes())
    data[-2] ^= 0x01
    got.path.write_bytes(bytes(data))
    with pytest.raises(DigestMismatch) as info:
        ensure_binary(proj.lock, cache=proj.cache, progress=NullProgress())
    assert got.receipt.binary_sha256 in str(info.value)
    with pytest.raises(DigestMismatch):
        find_installed(proj.lock, cache=proj.cache)


def test_reference_mismatch_is_recorded_as_a_warning(
    proj: FakeProject, caplog: pytest.LogCaptureFixture
) -> None:
    text = proj.lock.read_text() + f'\n[reference]\nbinary_sha256 = "{"0" * 64}"\ntoolchain = "gcc 12.2.0"\n'
    proj.lock.write_text(text)
    got = ensure_binary(proj.lock, cache=proj.cache, progress=NullProgress())
    assert got.receipt.reference_match is False
    assert any("reference digest" in r.getMessage() for r in caplog.records)


def test_receipt_json_is_complete(proj: FakeProject) -> None:
    got = ensure_binary(proj.lock, cache=proj.cache, progress=NullProgress())
    raw = json.loads((got.path.parent / "receipt.json").read_text())
    for key in (
        "lock_digest",
        "llama_cpp_commit",
        "source_kind",
        "source",
        "source_sha256",
        "cmake_args",
        "compilers",
        "cmake_version",
        "binary_sha256",
        "version_output",
        "built_at",
        "build_seconds",
        "llamagate_version",
    ):
        assert raw[key] not in (None, "", []), key
    assert raw["built_at"].endswith("+00:00")


def test_build_env_drops_flags_that_would_change_the_binary(tmp_path: Path) -> None:
    env = build_mod.cmake.build_env(
        tmp_path, {"PATH": "/x", "CFLAGS": "-O0", "MAKEFLAGS": "-j9", "CXX": "g++"}
    )
    assert env == {"PATH": "/x", "CXX": "g++", "LC_ALL": "C", "GIT_CEILING_DIRECTORIES": str(tmp_path)}
