"""The budget's 'available' inside a cgroup v2 limit (systemd MemoryMax, a container), on a fake /sys."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from supervisor.budget import memlimit
from supervisor.budget import plan as budget_mod
from supervisor.budget.gguf_info import ModelShape
from supervisor.budget.plan import MIB, plan_budget

GIB = 1024 * MIB


def fake_root(tmp_path: Path, own: str = "/", levels: dict[str, tuple[str, int, int]] | None = None) -> Path:
    """``levels``: cgroup path -> (memory.max, memory.current, inactive_file)."""
    root = tmp_path / "root"
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/cgroup").write_text(f"0::{own}\n")
    for path, (limit, current, inactive) in (levels or {}).items():
        folder = root / "sys/fs/cgroup" / path.strip("/")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "memory.max").write_text(f"{limit}\n")
        (folder / "memory.current").write_text(f"{current}\n")
        (folder / "memory.stat").write_text(f"anon 1\nfile 2\ninactive_file {inactive}\nactive_file 3\n")
    return root


def test_container_limit_minus_working_set(tmp_path: Path) -> None:
    # A container: its cgroup namespace makes our path "/", the mount is the container's cgroup.
    root = fake_root(tmp_path, "/", {"/": (str(4 * GIB), 1 * GIB, 256 * MIB)})
    assert memlimit.cgroup_available_bytes(root) == (4 * GIB - (1 * GIB - 256 * MIB), "/")


def test_max_means_no_limit(tmp_path: Path) -> None:
    root = fake_root(tmp_path, "/", {"/": ("max", 1 * GIB, 0)})
    assert memlimit.cgroup_available_bytes(root) is None


def test_no_cgroup_v2_or_no_files(tmp_path: Path) -> None:
    root = tmp_path / "empty"
    root.mkdir()
    assert memlimit.cgroup_available_bytes(root) is None  # no /proc/self/cgroup
    v1 = fake_root(tmp_path / "v1")
    (v1 / "proc/self/cgroup").write_text("12:memory:/user.slice\n1:name=systemd:/user.slice\n")
    assert memlimit.cgroup_available_bytes(v1) is None
    no_files = fake_root(tmp_path / "nofiles", "/system.slice/llamagate.service")
    assert memlimit.cgroup_available_bytes(no_files) is None


def test_the_tightest_ancestor_wins(tmp_path: Path) -> None:
    # systemd: MemoryMax on the service, and a tighter room left in its slice (siblings use memory).
    root = fake_root(
        tmp_path,
        "/system.slice/llamagate.service",
        {
            "/system.slice/llamagate.service": (str(8 * GIB), 1 * GIB, 0),
            "/system.slice": (str(10 * GIB), 7 * GIB, 0),
            "/": ("max", 20 * GIB, 0),
        },
    )
    assert memlimit.cgroup_available_bytes(root) == (3 * GIB, "/system.slice")


def test_a_used_up_limit_is_zero_not_negative(tmp_path: Path) -> None:
    root = fake_root(tmp_path, "/", {"/": (str(1 * GIB), 2 * GIB, 0)})
    assert memlimit.cgroup_available_bytes(root) == (0, "/")


def test_available_takes_the_smaller_of_host_and_cgroup(tmp_path: Path) -> None:
    host = int(psutil.virtual_memory().available)
    tight = fake_root(tmp_path / "a", "/", {"/": (str(512 * MIB), 0, 0)})
    got = memlimit.available(tight)
    assert got.bytes == 512 * MIB and "memory.max" in got.source
    loose = fake_root(tmp_path / "b", "/", {"/": (str(host * 4), 0, 0)})
    assert memlimit.available(loose).source == "host"


def test_the_budget_refuses_inside_a_small_cgroup_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The host has plenty; the service's MemoryMax does not.
    root = fake_root(
        tmp_path,
        "/system.slice/llamagate.service",
        {"/system.slice/llamagate.service": (str(600 * MIB), 0, 0)},
    )
    monkeypatch.setattr(budget_mod, "CGROUP_ROOT", root)
    shape = ModelShape("llama", 4, 8, (2,) * 4, 64, 64, 2048, None, None)
    b = plan_budget(
        shape, weights=500 * MIB, slots=2, ctx_per_slot=4096, type_k="f16", type_v="f16", headroom_bytes=0
    )
    assert b.available_bytes == 600 * MIB
    assert not b.fits
    assert "cgroup /system.slice/llamagate.service memory.max" in b.refusal()
    assert any("cgroup /system.slice/llamagate.service" in line for line in b.lines())
