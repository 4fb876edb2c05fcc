"""Build variants: a ``[variant.NAME]`` table adds cmake arguments and source patches to the default
build, into a cache entry of its own, with a receipt that says which variant and which patches.
The fake toolchain builds; the real ``patch`` program applies the lock's patches."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from supervisor.artifacts.build import ensure_binary, find_installed
from supervisor.artifacts.lock import load_lock
from supervisor.artifacts.receipt import read_receipt, write_receipt
from supervisor.cli import main
from supervisor.errors import BuildError, ToolMissing
from supervisor.progress import NullProgress
from tests.fakes.toolchain import FakeProject, fake_project
from tests.helpers.system import require_tool

# Changes the first line of the fake tree's CMakeLists.txt, which the fake cmake prints when configuring.
PATCH = """--- a/CMakeLists.txt
+++ b/CMakeLists.txt
@@ -1 +1 @@
-project(fake)
+project(fake-patched)
"""


def _variant(patch: str = PATCH, requires: str = "[]") -> str:
    sha = hashlib.sha256(patch.encode()).hexdigest()
    return f"""
[variant.gpu]
description = "a fake GPU build"
cmake_args = ["-DGGML_FAKE_GPU=ON"]
requires = {requires}
packages = ["fake-gpu-dev"]

[[variant.gpu.patch]]
name = "rename the project"
sha256 = "{sha}"
text = '''
{patch}'''
"""


pytestmark = pytest.mark.needs_tool("patch")


@pytest.fixture
def proj(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeProject:
    patch = require_tool("patch")
    project = fake_project(tmp_path, monkeypatch)  # PATH: the fake toolchain only, so bring patch
    (project.bin_dir / "patch").symlink_to(patch)
    return project


def _add(proj: FakeProject, text: str) -> None:
    proj.lock.write_text(proj.lock.read_text() + text)


def test_a_variant_builds_patched_into_its_own_entry_and_the_receipt_says_so(proj: FakeProject) -> None:
    cpu_before = load_lock(proj.lock).digest
    _add(proj, _variant())
    assert load_lock(proj.lock).digest == cpu_before  # declaring a variant never rebuilds the CPU build
    cpu = ensure_binary(proj.lock, cache=proj.cache, progress=NullProgress())
    gpu = ensure_binary(proj.lock, cache=proj.cache, progress=NullProgress(), variant="gpu")
    assert gpu.path.parent != cpu.path.parent and not gpu.cache_hit
    assert gpu.path.parent.name == load_lock(proj.lock, "gpu").digest[:16]
    assert cpu.receipt.variant == "cpu" and cpu.receipt.patches == ()
    receipt = read_receipt(gpu.path.parent / "receipt.json")
    assert receipt.variant == "gpu"
    assert receipt.patches == (f"rename the project (sha256 {hashlib.sha256(PATCH.encode()).hexdigest()})",)
    assert receipt.cmake_args[-1] == "-DGGML_FAKE_GPU=ON"
    log = (gpu.path.parent / "build.log").read_text()
    assert "-- fake source: project(fake-patched)" in log  # configured from the patched tree
    cpu_log = (cpu.path.parent / "build.log").read_text()
    assert "-- fake source: project(fake)" in cpu_log and "GGML_FAKE_GPU" not in cpu_log
    again = find_installed(proj.lock, cache=proj.cache, variant="gpu")
    assert again is not None and again.receipt == receipt


def test_a_patch_that_does_not_apply_exactly_installs_nothing(proj: FakeProject) -> None:
    _add(proj, _variant(PATCH.replace("-project(fake)", "-project(other)")))
    with pytest.raises(BuildError, match="patch 'rename the project' failed"):
        ensure_binary(proj.lock, cache=proj.cache, progress=NullProgress(), variant="gpu")
    assert find_installed(proj.lock, cache=proj.cache, variant="gpu") is None


def test_a_variant_whose_tools_are_missing_is_refused_before_fetching(proj: FakeProject) -> None:
    _add(proj, _variant(requires='["nvcc-fake"]'))
    with pytest.raises(ToolMissing) as info:
        ensure_binary(proj.lock, cache=proj.cache, progress=NullProgress(), variant="gpu")
    message = str(info.value)
    assert "'gpu' needs nvcc-fake on PATH" in message and "fake-gpu-dev" in message
    assert "cpu, gpu" in message  # what else could be built
    assert not (proj.cache / "sources").exists() or not any((proj.cache / "sources").iterdir())


def test_a_receipt_from_before_variants_reads_as_the_cpu_build(proj: FakeProject) -> None:
    got = ensure_binary(proj.lock, cache=proj.cache, progress=NullProgress())
    path = got.path.parent / "receipt.json"
    raw = json.loads(path.read_text())
    del raw["variant"], raw["patches"]
    path.write_text(json.dumps(raw))
    old = read_receipt(path)
    assert old.variant == "cpu" and old.patches == ()
    write_receipt(old, path)
    assert read_receipt(path) == old


def test_build_prints_a_variants_packages_for_ci_and_the_container(
    proj: FakeProject, capsys: pytest.CaptureFixture[str]
) -> None:
    _add(
        proj,
        _variant().replace(
            'packages = ["fake-gpu-dev"]', 'packages = ["fake-gpu-dev"]\nruntime_packages = ["fake-gpu1"]'
        ),
    )
    lock = ["build", "--lock", str(proj.lock)]
    assert main([*lock, "--variant", "gpu", "--print-packages"]) == 0
    assert main([*lock, "--variant", "gpu", "--print-packages", "runtime"]) == 0
    assert main([*lock, "--print-packages"]) == 0  # the cpu build: nothing beyond the toolchain
    assert capsys.readouterr().out == "fake-gpu-dev\nfake-gpu1\n\n"
    assert main([*lock, "--variant", "metal", "--print-packages"]) == 2
