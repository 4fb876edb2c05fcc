"""llama-quantize built from the lock and cached beside llama-server, and ``model quantize`` deriving a type
from a GGUF into the model cache, with the fake toolchain (its llama-quantize really writes a file)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from supervisor.artifacts.build import ensure_binary, find_installed, install_dir
from supervisor.artifacts.lock import load_lock
from supervisor.artifacts.quantize import derive, derived_name, file_type
from supervisor.artifacts.tools import QUANTIZE
from supervisor.bench.quant_files import parse_types, prepare
from supervisor.errors import BuildError, DigestMismatch, UsageError
from supervisor.progress import NullProgress
from tests.fakes.toolchain import VERSION_LINE, FakeProject, fake_project, tiny_gguf

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def proj(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeProject:
    return fake_project(tmp_path, monkeypatch)


@pytest.fixture
def source(tmp_path: Path) -> Path:
    return tiny_gguf(tmp_path / "tiny-q4_k_m.gguf", "Q4_K_M")


def _runs(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_the_tool_is_built_once_beside_llama_server_with_its_own_receipt(
    proj: FakeProject, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs = proj.root / "runs"
    monkeypatch.setenv("FAKE_CMAKE_RUNS", str(runs))
    lock = load_lock(proj.lock)
    tool = ensure_binary(proj.lock, cache=proj.cache, progress=NullProgress(), target=QUANTIZE)
    assert not tool.cache_hit
    assert tool.path == proj.cache / "llama-quantize" / lock.digest[:16] / "llama-quantize"
    assert tool.path.parent == install_dir(lock, proj.cache, QUANTIZE)
    r = tool.receipt
    assert r.target == "llama-quantize" and r.lock_digest == lock.digest and r.cmake_args == lock.cmake_args
    assert r.source_sha256 == proj.sha256
    assert VERSION_LINE in r.version_output.splitlines()
    assert r.reference_match is None  # the lock's reference digest is llama-server's
    assert (tool.path.parent / "build.log").is_file() and (tool.path.parent / "receipt.json").is_file()
    assert not (proj.cache / "llama-server").exists()  # building the tool builds nothing else
    # A cache hit is a lookup: cmake does not run again.
    again = ensure_binary(proj.lock, cache=proj.cache, progress=NullProgress(), target=QUANTIZE)
    assert again.cache_hit and again.path == tool.path and again.receipt == r
    assert _runs(runs) == 1
    found = find_installed(proj.lock, cache=proj.cache, target=QUANTIZE)
    assert found is not None and found.path == tool.path
    # llama-server is its own install, from the same sources, with another receipt.
    server = ensure_binary(proj.lock, cache=proj.cache, progress=NullProgress())
    assert server.path.parent == install_dir(lock, proj.cache) != tool.path.parent
    assert server.receipt.target == "llama-server" and server.receipt.source_sha256 == r.source_sha256
    assert _runs(runs) == 2


def test_the_tool_gets_the_locked_cmake_arguments(proj: FakeProject) -> None:
    tool = ensure_binary(proj.lock, cache=proj.cache, progress=NullProgress(), target=QUANTIZE)
    log = (tool.path.parent / "build.log").read_text()
    args = json.loads(log.split("-- fake cmake args: ", 1)[1].splitlines()[0])
    assert "-DCMAKE_BUILD_TYPE=Release" in args
    flags = next(a for a in args if a.startswith("-DCMAKE_C_FLAGS="))
    assert "{source_dir}" not in flags and "/src/llama.cpp-fake=llama.cpp" in flags


def test_an_unknown_target_is_refused(proj: FakeProject) -> None:
    with pytest.raises(BuildError, match="unknown build target 'llama-nope'"):
        ensure_binary(proj.lock, cache=proj.cache, progress=NullProgress(), target="llama-nope")


def test_a_tool_reporting_another_build_is_not_installed(
    proj: FakeProject, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_VERSION_LINE", "version: 9 (build 9, commit 0c1e570)")
    with pytest.raises(BuildError, match="built llama-quantize reports the wrong version"):
        ensure_binary(proj.lock, cache=proj.cache, progress=NullProgress(), target=QUANTIZE)
    assert find_installed(proj.lock, cache=proj.cache, target=QUANTIZE) is None


def test_a_tampered_tool_is_noticed_not_rebuilt_over(proj: FakeProject) -> None:
    tool = ensure_binary(proj.lock, cache=proj.cache, progress=NullProgress(), target=QUANTIZE)
    tool.path.write_text(tool.path.read_text() + "\n# changed\n")
    with pytest.raises(DigestMismatch):
        ensure_binary(proj.lock, cache=proj.cache, progress=NullProgress(), target=QUANTIZE)


def test_derive_writes_the_file_into_the_model_cache_with_its_record(proj: FakeProject, source: Path) -> None:
    got = derive(source, "q8_0", lock_path=proj.lock, progress=NullProgress(), cache=proj.cache)
    assert got.path == proj.cache / "models" / "tiny-q8_0.gguf"
    source_sha = hashlib.sha256(source.read_bytes()).hexdigest()
    # The fake quantizer writes what it was asked to make, and from which bytes.
    assert got.path.read_text() == f"GGUF fake Q8_0 of {source_sha}\n"
    assert got.sha256 == hashlib.sha256(got.path.read_bytes()).hexdigest()
    assert (got.type, got.source_type, got.source_sha256) == ("Q8_0", "Q4_K_M", source_sha)
    assert got.requantized and not got.cache_hit
    record = json.loads((got.path.parent / "tiny-q8_0.gguf.derived.json").read_text())
    assert record["sha256"] == got.sha256 and record["size"] == got.path.stat().st_size
    assert record["source"] == {"path": str(source), "sha256": source_sha, "type": "Q4_K_M"}
    assert record["llama_quantize"]["binary_sha256"] == got.tool.receipt.binary_sha256
    assert "--allow-requantize" in record["llama_quantize"]["argv"]
    assert str(got.path) in record["llama_quantize"]["argv"]  # the final name, not the partial one
    assert record["quality_note"] == got.quality_note
    assert got.quality_note is not None and "carries Q4_K_M's quality, not Q8_0's" in got.quality_note
    # The hash cache knows it: the daemon verifying it later costs a stat.
    assert str(got.path) in json.loads((proj.cache / "hashes.json").read_text())
    assert sorted(p.name for p in got.path.parent.iterdir()) == [
        ".tiny-q8_0.gguf.lock",
        "tiny-q8_0.gguf",
        "tiny-q8_0.gguf.derived.json",
    ]


def test_a_second_derive_is_a_cache_hit_and_a_changed_source_is_derived_again(
    proj: FakeProject, source: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started = proj.root / "started"
    monkeypatch.setenv("FAKE_QUANTIZE_STARTED", str(started))
    first = derive(source, "Q8_0", lock_path=proj.lock, progress=NullProgress(), cache=proj.cache)
    started.unlink()
    second = derive(source, "Q8_0", lock_path=proj.lock, progress=NullProgress(), cache=proj.cache)
    assert second.cache_hit and not started.exists()
    assert (second.path, second.sha256, second.source_type) == (first.path, first.sha256, "Q4_K_M")
    with source.open("ab") as fh:
        fh.write(b"\0")
    third = derive(source, "Q8_0", lock_path=proj.lock, progress=NullProgress(), cache=proj.cache)
    assert not third.cache_hit and started.exists() and third.sha256 != first.sha256


def test_a_float_source_is_quantized_without_allow_requantize(proj: FakeProject, tmp_path: Path) -> None:
    f16 = tiny_gguf(tmp_path / "tiny-f16.gguf", "F16")
    got = derive(f16, "Q8_0", lock_path=proj.lock, progress=NullProgress(), cache=proj.cache)
    record = json.loads(got.path.with_name(got.path.name + ".derived.json").read_text())
    assert "--allow-requantize" not in record["llama_quantize"]["argv"]
    assert not got.requantized and got.quality_note is None and record["quality_note"] is None


def test_out_puts_the_file_where_asked(proj: FakeProject, source: Path, tmp_path: Path) -> None:
    out = tmp_path / "elsewhere" / "mine.gguf"
    got = derive(source, "F16", lock_path=proj.lock, progress=NullProgress(), cache=proj.cache, out=out)
    assert got.path == out and out.is_file() and (out.parent / "mine.gguf.derived.json").is_file()
    assert not (proj.cache / "models").exists()


@pytest.mark.parametrize(
    ("qtype", "message"),
    [
        ("Q9_X", "--type 'Q9_X': not a llama-quantize type"),
        ("Q4_K_M", "is already Q4_K_M: nothing to derive"),
    ],
)
def test_bad_types_are_refused_before_anything_runs(
    proj: FakeProject, source: Path, qtype: str, message: str
) -> None:
    with pytest.raises(UsageError, match=message):
        derive(source, qtype, lock_path=proj.lock, progress=NullProgress(), cache=proj.cache)
    assert not (proj.cache / "llama-quantize").exists()


def test_a_file_llamagate_did_not_make_is_not_overwritten(
    proj: FakeProject, source: Path, tmp_path: Path
) -> None:
    mine = tmp_path / "mine.gguf"
    mine.write_bytes(b"GGUF precious")
    with pytest.raises(UsageError, match="was not made by `llamagate model quantize`"):
        derive(source, "Q8_0", lock_path=proj.lock, progress=NullProgress(), cache=proj.cache, out=mine)
    assert mine.read_bytes() == b"GGUF precious"


def test_a_failed_run_leaves_no_file_and_a_killed_runs_partial_is_removed(
    proj: FakeProject, source: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    models = proj.cache / "models"
    models.mkdir(parents=True)
    (models / ".tiny-q8_0.gguf.partial-dead").write_bytes(b"GGUF half of a killed run")
    monkeypatch.setenv("FAKE_QUANTIZE_FAIL", "1")
    with pytest.raises(BuildError, match=r"llama-quantize failed \(exit 1\)") as info:
        derive(source, "Q8_0", lock_path=proj.lock, progress=NullProgress(), cache=proj.cache)
    assert "failed to quantize model" in str(info.value)
    assert sorted(p.name for p in models.iterdir()) == [".tiny-q8_0.gguf.lock"]


def test_names_and_types() -> None:
    assert derived_name(Path("gemma-3-270m-q4_k_m.gguf"), "Q8_0") == "gemma-3-270m-q8_0.gguf"
    assert derived_name(Path("gemma-3-270m-Q4_K_M.gguf"), "F16") == "gemma-3-270m-f16.gguf"
    assert derived_name(Path("model.gguf"), "Q5_K_M") == "model-q5_k_m.gguf"


def test_file_type_reads_the_header(tmp_path: Path) -> None:
    assert file_type(tiny_gguf(tmp_path / "a.gguf", "Q5_K_M")) == "Q5_K_M"
    assert file_type(tiny_gguf(tmp_path / "b.gguf", "F32")) == "F32"


def _cli(proj: FakeProject, *args: str, env: dict[str, str]) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "supervisor", "model", "quantize", *args]
    argv += ["--cache", str(proj.cache), "--lock", str(proj.lock)]
    return subprocess.Popen(
        argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def test_the_command_prints_the_file_its_sha256_and_the_quality_note(proj: FakeProject, source: Path) -> None:
    proc = _cli(proj, str(source), "--type", "Q5_K_M", env=dict(os.environ))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    path = proj.cache / "models" / "tiny-q5_k_m.gguf"
    assert f"derived: {path} (made in" in out
    assert f"sha256: {hashlib.sha256(path.read_bytes()).hexdigest()}" in out
    assert "note: derived from a Q4_K_M file with --allow-requantize" in out
    assert "compare it for speed and memory, not for quality" in out
    proc = _cli(proj, str(source), "--type", "Q5_K_M", "--json", env=dict(os.environ))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    body = json.loads(out)
    assert body["cache_hit"] is True and body["path"] == str(path) and body["requantized"] is True


def _wait(pred: Callable[[], object], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_killed_command_leaves_no_llama_quantize_and_no_file(
    proj: FakeProject, source: Path, sig: signal.Signals
) -> None:
    ensure_binary(proj.lock, cache=proj.cache, progress=NullProgress(), target=QUANTIZE)
    started, gate = proj.root / "started", proj.root / "gate"
    env = {**os.environ, "FAKE_QUANTIZE_STARTED": str(started), "FAKE_QUANTIZE_GATE": str(gate)}
    proc = _cli(proj, str(source), "--type", "Q8_0", env=env)
    try:
        _wait(lambda: started.exists() and started.read_text(), "llama-quantize to start")
        pid = int(started.read_text())
        assert psutil.Process(pid).ppid() == proc.pid
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == (130 if sig is signal.SIGTERM else -signal.SIGKILL), err
        _wait(lambda: _gone(pid), "llama-quantize to die with the command")
    finally:
        if proc.poll() is None:
            proc.kill()
    models = proj.cache / "models"
    assert not (models / "tiny-q8_0.gguf").exists() and not (models / "tiny-q8_0.gguf.derived.json").exists()
    partials = sorted(p.name for p in models.glob(".tiny-q8_0.gguf.partial-*"))
    # SIGTERM unwinds and removes the partial file; after SIGKILL the next run does.
    assert len(partials) == (0 if sig is signal.SIGTERM else 1)
    gate.write_text("open")
    got = derive(source, "Q8_0", lock_path=proj.lock, progress=NullProgress(), cache=proj.cache)
    assert got.path.is_file() and list(models.glob(".tiny-q8_0.gguf.partial-*")) == []


def test_the_models_experiment_gets_the_source_for_its_own_type_and_derives_the_rest(
    proj: FakeProject, source: Path
) -> None:
    types = parse_types("q4_k_m, Q8_0,F16")
    files = prepare(types, source, lock_path=proj.lock, progress=NullProgress())
    assert [p for p, _ in files] == [
        source,
        proj.cache / "models" / "tiny-q8_0.gguf",
        proj.cache / "models" / "tiny-f16.gguf",
    ]
    assert all(sha == hashlib.sha256(p.read_bytes()).hexdigest() for p, sha in files)
    with pytest.raises(UsageError, match="named twice"):
        parse_types("Q8_0,q8_0")
