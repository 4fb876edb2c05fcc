"""``llamagate verify`` against installs made by the fake toolchain (the real one: integration)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from supervisor.artifacts.build import ensure_binary
from supervisor.cli import main
from supervisor.progress import NullProgress
from tests.fakes.toolchain import FakeProject, fake_project


@pytest.fixture
def built(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeProject:
    proj = fake_project(tmp_path, monkeypatch)
    ensure_binary(proj.lock, cache=proj.cache, progress=NullProgress())
    return proj


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _binary(cache: Path) -> Path:
    return next((cache / "llama-server").glob("*/llama-server"))


def _gguf(path: Path) -> tuple[Path, str]:
    path.write_bytes(b"GGUF\x03\x00\x00\x00fake model")
    return path, hashlib.sha256(path.read_bytes()).hexdigest()


def test_verify_without_serving_passes_and_prints_identity(
    built: FakeProject, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = _run(
        capsys, "verify", "--lock", str(built.lock), "--cache", str(built.cache), "--no-serve"
    )
    assert code == 0, out
    assert f"llama-server: {_binary(built.cache)}" in out
    assert "llama.cpp commit: 0c1e57098bba43ac29e6e3b677cdceebdd22334f" in out
    assert "ok    binary" in out and "ok    version" in out
    assert out.rstrip().endswith("verify: ok")


def test_tampered_binary_in_a_copy_of_the_cache_fails_with_exit_1(
    built: FakeProject, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    copy = built.root / "cache-copy"
    shutil.copytree(built.cache, copy)
    target = _binary(copy)
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x20  # one byte
    target.write_bytes(bytes(data))
    tampered = hashlib.sha256(bytes(data)).hexdigest()
    monkeypatch.setenv("LLAMAGATE_CACHE_DIR", str(copy))  # the cache chosen through the environment
    code, out, err = _run(capsys, "verify", "--lock", str(built.lock), "--no-serve")
    assert code == 1
    assert "FAIL  binary" in out and f"found {tampered}" in out
    assert "verify: FAILED (binary)" in err
    # The original is untouched and still verifies.
    code, _, _ = _run(capsys, "verify", "--lock", str(built.lock), "--cache", str(built.cache), "--no-serve")
    assert code == 0


def test_json_output_names_the_failed_check_with_expected_and_found(
    built: FakeProject, capsys: pytest.CaptureFixture[str]
) -> None:
    target = _binary(built.cache)
    expected = hashlib.sha256(target.read_bytes()).hexdigest()
    target.write_bytes(target.read_bytes() + b"\n")
    code, out, _ = _run(capsys, "verify", "--lock", str(built.lock), "--no-serve", "--json")
    assert code == 1
    report = json.loads(out)
    assert report["ok"] is False
    failed = [c for c in report["checks"] if not c["ok"]]
    assert [c["name"] for c in failed] == ["binary"]
    assert failed[0]["expected"] == expected and failed[0]["found"] != expected
    assert report["binary"] == str(target)


def test_verify_before_any_build_says_to_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    proj = fake_project(tmp_path, monkeypatch)
    code, out, _ = _run(capsys, "verify", "--lock", str(proj.lock), "--no-serve")
    assert code == 1 and "run 'llamagate build --variant cpu'" in out


def test_version_mismatch_fails_showing_expected_and_found(
    built: FakeProject, capsys: pytest.CaptureFixture[str]
) -> None:
    target = _binary(built.cache)
    target.write_text("#!/bin/sh\necho 'version: 9.9.9 (build 2, commit abcdef0)' >&2\n")
    receipt_path = target.parent / "receipt.json"
    receipt = json.loads(receipt_path.read_text())
    receipt["binary_sha256"] = hashlib.sha256(target.read_bytes()).hexdigest()  # a consistent forgery
    receipt_path.write_text(json.dumps(receipt))
    code, out, _ = _run(capsys, "verify", "--lock", str(built.lock), "--no-serve")
    assert code == 1
    assert "FAIL  version" in out
    assert "expected version: 0.5.0-dev (build 1, commit 0c1e570), found version: 9.9.9" in out


def test_receipt_of_another_lock_fails(built: FakeProject, capsys: pytest.CaptureFixture[str]) -> None:
    receipt_path = _binary(built.cache).parent / "receipt.json"
    receipt = json.loads(receipt_path.read_text())
    receipt["lock_digest"] = "0" * 64
    receipt_path.write_text(json.dumps(receipt))
    code, out, _ = _run(capsys, "verify", "--lock", str(built.lock), "--no-serve")
    assert code == 1 and "FAIL  receipt" in out


def test_model_with_wrong_sha256_fails(built: FakeProject, capsys: pytest.CaptureFixture[str]) -> None:
    model, right = _gguf(built.root / "m.gguf")
    wrong = "1" * 64
    code, out, _ = _run(
        capsys,
        "verify",
        "--lock",
        str(built.lock),
        "--no-serve",
        "--model",
        str(model),
        "--model-sha256",
        wrong,
    )
    assert code == 1
    assert "FAIL  model" in out and wrong in out and right in out


def test_non_gguf_model_is_refused(built: FakeProject, capsys: pytest.CaptureFixture[str]) -> None:
    model = built.root / "weights.safetensors"
    model.write_bytes(b"\x08\x00\x00\x00{}")
    sha = hashlib.sha256(model.read_bytes()).hexdigest()
    code, out, _ = _run(
        capsys,
        "verify",
        "--lock",
        str(built.lock),
        "--no-serve",
        "--model",
        str(model),
        "--model-sha256",
        sha,
    )
    assert code == 1 and "not a GGUF model file" in out


def test_a_binary_that_dies_on_start_fails_fast_with_its_log(
    built: FakeProject, capsys: pytest.CaptureFixture[str]
) -> None:
    model, sha = _gguf(built.root / "m.gguf")
    code, out, _ = _run(
        capsys, "verify", "--lock", str(built.lock), "--model", str(model), "--model-sha256", sha
    )
    assert code == 1
    assert "FAIL  serve" in out
    assert "exited during startup (exited with code 1)" in out
    assert "failed to load model (fake)" in out  # the child's own last log line


@pytest.mark.parametrize(
    "argv",
    [
        ["verify", "--model", "x.gguf"],
        ["verify", "--model-sha256", "0" * 64],
        ["verify", "--model", "x.gguf", "--model-sha256", "xyz"],
        ["verify", "--bogus"],
    ],
)
def test_usage_errors_exit_2(built: FakeProject, capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    code, _, _ = _run(capsys, *argv, "--lock", str(built.lock), "--no-serve")
    assert code == 2


def test_bad_lock_exits_2_naming_the_field(built: FakeProject, capsys: pytest.CaptureFixture[str]) -> None:
    bad = built.root / "bad.lock"
    bad.write_text(built.lock.read_text().replace('kind = "file"', 'kind = "ftp"'))
    code, _, err = _run(capsys, "verify", "--lock", str(bad), "--no-serve")
    assert code == 2 and "source[0].kind: unknown kind 'ftp'" in err


def test_build_command_reports_a_cache_hit_and_the_identity(
    built: FakeProject, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = _run(capsys, "build", "--lock", str(built.lock), "--cache", str(built.cache))
    assert code == 0
    assert f"llama-server: {_binary(built.cache)} (cache hit" in out
    assert "binary sha256:" in out and "llama.cpp commit: 0c1e570" in out
    code, out, _ = _run(capsys, "build", "--lock", str(built.lock), "--json")
    assert code == 0 and json.loads(out)["cache_hit"] is True


def test_print_digest(built: FakeProject, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "build", "--lock", str(built.lock), "--print-digest")
    assert code == 0 and _binary(built.cache).parent.name == out.strip()[:16]
