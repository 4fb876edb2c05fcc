"""``prepare(fetch=False)``, what a SIGHUP reload uses: verify what is there, never build or download."""

from __future__ import annotations

import hashlib
import os
from dataclasses import replace
from pathlib import Path

import pytest

import supervisor.daemon.prepare as prepare_mod
from supervisor.artifacts.demo_model import DEFAULT_DEMO, demo_model_path
from supervisor.config.schema import Config
from supervisor.errors import DigestMismatch, Misconfigured, StartupError
from supervisor.progress import NullProgress
from tests.unit.test_budget import write_gguf

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def no_fetching(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("fetch=False must not build or download")

    monkeypatch.setattr(prepare_mod, "ensure_binary", forbidden)
    monkeypatch.setattr(prepare_mod, "ensure_demo_model", forbidden)


def test_a_binary_not_built_yet_is_refused_not_built(tmp_path: Path) -> None:
    cfg = Config()
    cfg = replace(cfg, llama=replace(cfg.llama, lock=REPO / "llama-build.lock"))
    with pytest.raises(StartupError, match="llamagate build --lock"):
        prepare_mod.prepare(cfg, progress=NullProgress(), cache=tmp_path, fetch=False)


def test_a_demo_model_not_fetched_yet_is_refused_not_downloaded(tmp_path: Path) -> None:
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\necho 'version: 0 (build 1, commit 0c1e570)'\n")
    binary.chmod(0o755)
    cfg = Config()
    cfg = replace(cfg, llama=replace(cfg.llama, binary=binary))
    with pytest.raises(StartupError, match="llamagate model fetch"):
        prepare_mod.prepare(cfg, progress=NullProgress(), cache=tmp_path / "cache", fetch=False)


# --- the model's sha256, checked before anything is launched (serve and SIGHUP alike) ----------------


def fake_binary(tmp_path: Path) -> Path:
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\necho 'version: 0 (build 1, commit 0c1e570)'\n")
    binary.chmod(0o755)
    return binary


def config_with_model(tmp_path: Path, model: Path, sha256: str) -> Config:
    cfg = Config()
    llama = replace(
        cfg.llama, binary=fake_binary(tmp_path), model=replace(cfg.llama.model, path=model, sha256=sha256)
    )
    # The tiny model fits any host: no refusal from the memory budget in the way of what is tested.
    return replace(cfg, llama=llama, supervision=replace(cfg.supervision, memory_headroom_mib=0))


@pytest.mark.parametrize("fetch", [True, False], ids=["serve", "reload"])
def test_a_model_whose_sha256_differs_is_refused_naming_both_digests(tmp_path: Path, fetch: bool) -> None:
    model = write_gguf(tmp_path / "m.gguf")
    actual = hashlib.sha256(model.read_bytes()).hexdigest()
    wrong = "0" * 64
    # A configured model's mismatch is a configuration mistake (exit 2) named by its config path.
    with pytest.raises(Misconfigured) as info:
        prepare_mod.prepare(
            config_with_model(tmp_path, model, wrong),
            progress=NullProgress(),
            cache=tmp_path / "c",
            fetch=fetch,
        )
    assert (
        str(info.value)
        == f"llama.model.sha256: model {model}: sha256 mismatch: expected {wrong}, found {actual}"
    )


@pytest.mark.parametrize("fetch", [True, False], ids=["serve", "reload"])
def test_a_model_whose_sha256_matches_is_served_with_it(tmp_path: Path, fetch: bool) -> None:
    model = write_gguf(tmp_path / "m.gguf")
    actual = hashlib.sha256(model.read_bytes()).hexdigest()
    cfg = config_with_model(tmp_path, model, actual)
    prepared = prepare_mod.prepare(cfg, progress=NullProgress(), cache=tmp_path / "c", fetch=fetch)
    assert (prepared.model.path, prepared.model.sha256) == (model, actual)
    assert prepared.spec.model == model


def test_a_model_changed_after_its_hash_was_cached_is_refused(tmp_path: Path) -> None:
    # The hash cache is keyed by path, size and mtime: a rewritten file is hashed again, not trusted.
    model = write_gguf(tmp_path / "m.gguf")
    actual = hashlib.sha256(model.read_bytes()).hexdigest()
    cfg = config_with_model(tmp_path, model, actual)
    cache = tmp_path / "c"
    prepare_mod.prepare(cfg, progress=NullProgress(), cache=cache, fetch=False)
    stat = model.stat()
    data = bytearray(model.read_bytes())
    data[-1] ^= 0xFF  # same size, one byte different
    model.write_bytes(bytes(data))
    os.utime(model, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    with pytest.raises(Misconfigured, match=r"llama\.model\.sha256: .* sha256 mismatch"):
        prepare_mod.prepare(cfg, progress=NullProgress(), cache=cache, fetch=False)


def test_a_cached_demo_model_that_is_not_the_pinned_one_is_refused(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    demo = demo_model_path(cache)
    demo.parent.mkdir(parents=True)
    write_gguf(demo)  # a GGUF, but not the demo model's bytes
    cfg = Config()
    cfg = replace(cfg, llama=replace(cfg.llama, binary=fake_binary(tmp_path)))
    with pytest.raises(DigestMismatch, match=f"expected {DEFAULT_DEMO.sha256}"):
        prepare_mod.prepare(cfg, progress=NullProgress(), cache=cache, fetch=False)
