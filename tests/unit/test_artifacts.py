from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from supervisor.artifacts import files as artifacts
from supervisor.artifacts.files import check_gguf, sha256_file, verify_model
from supervisor.errors import CheckFailed, DigestMismatch, NotAGguf, UsageError


def _gguf(path: Path, body: bytes = b"\x03\x00\x00\x00rest") -> Path:
    path.write_bytes(b"GGUF" + body)
    return path


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def count_hashes(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    calls: list[Path] = []
    real = artifacts.sha256_fresh

    def counting(path: Path, **kw: object) -> str:
        calls.append(path)
        return real(path)

    monkeypatch.setattr(artifacts, "sha256_fresh", counting)
    return calls


def test_sha256_file_is_remembered_until_the_file_changes(tmp_path: Path, count_hashes: list[Path]) -> None:
    cache = tmp_path / "cache"
    f = _gguf(tmp_path / "m.gguf")
    assert sha256_file(f, cache=cache) == _sha(f)
    assert sha256_file(f, cache=cache) == _sha(f)
    assert len(count_hashes) == 1  # second call: a stat, no hash
    entry = json.loads((cache / "hashes.json").read_text())[str(f.resolve())]
    assert entry["size"] == f.stat().st_size and entry["inode"] == f.stat().st_ino

    f.write_bytes(b"GGUFchanged!")  # new content, new mtime
    assert sha256_file(f, cache=cache) == _sha(f)
    assert len(count_hashes) == 2


def test_a_replaced_file_with_the_same_size_and_mtime_is_rehashed(
    tmp_path: Path, count_hashes: list[Path]
) -> None:
    cache = tmp_path / "cache"
    f = _gguf(tmp_path / "m.gguf", b"aaaa")
    sha256_file(f, cache=cache)
    st = f.stat()
    other = _gguf(tmp_path / "other", b"bbbb")
    os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
    other.replace(f)  # same size and mtime, new inode
    assert sha256_file(f, cache=cache) == _sha(f)
    assert len(count_hashes) == 2


def test_an_unwritable_hash_cache_does_not_break_hashing(tmp_path: Path) -> None:
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache folder should be")
    f = _gguf(tmp_path / "m.gguf")
    assert sha256_file(f, cache=blocker) == _sha(f)


def test_check_gguf_refuses_other_files_clearly(tmp_path: Path) -> None:
    check_gguf(_gguf(tmp_path / "ok.gguf"))
    (tmp_path / "x.bin").write_bytes(b"PK\x03\x04zip")
    with pytest.raises(NotAGguf, match=r"not a GGUF model file: .*x.bin \(starts with b'PK"):
        check_gguf(tmp_path / "x.bin")
    (tmp_path / "empty").write_bytes(b"")
    with pytest.raises(NotAGguf):
        check_gguf(tmp_path / "empty")
    with pytest.raises(CheckFailed, match="model file not found"):
        check_gguf(tmp_path / "missing.gguf")
    with pytest.raises(CheckFailed, match="is a directory"):
        check_gguf(tmp_path)


def test_verify_model_names_both_digests_on_mismatch(tmp_path: Path) -> None:
    f = _gguf(tmp_path / "m.gguf")
    right = _sha(f)
    assert verify_model(f, right.upper(), cache=tmp_path / "c") == right
    wrong = "0" * 64
    with pytest.raises(DigestMismatch) as info:
        verify_model(f, wrong, cache=tmp_path / "c")
    assert wrong in str(info.value) and right in str(info.value)


def test_verify_model_checks_the_magic_before_hashing(tmp_path: Path) -> None:
    f = tmp_path / "not.gguf"
    f.write_bytes(b"{}")
    with pytest.raises(NotAGguf):
        verify_model(f, _sha(f), cache=tmp_path / "c")


def test_verify_model_refuses_a_malformed_expected_digest(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="64 hex"):
        verify_model(_gguf(tmp_path / "m.gguf"), "abc", cache=tmp_path / "c")
