"""``prepare(fetch=False)``, what a SIGHUP reload uses: verify what is there, never build or download."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

import supervisor.prepare as prepare_mod
from supervisor.config_schema import Config
from supervisor.errors import StartupError
from supervisor.progress import NullProgress

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
