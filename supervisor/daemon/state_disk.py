"""Where a model's conversations' states go on disk (the proxy's disk tier, ``proxy.conversations.tier``),
and whether they go there at all.

One private folder per served model and identity: ``STATE_DIR/ALIAS-IDENTITY16`` (0700, its parents
too when we make them), passed to the child as ``--slot-save-path``. The identity is a digest of what a
saved sequence state depends on: the binary and the model by sha256 (the file format and the KV cells'
meaning), the context per slot (a restore must fit the slot), the KV cache types (the cells' layout) and
``extra_args`` (anything there may change the cache: ``-fa``, ``--swa-full``...). Threads, slot count,
the RAM cache and the chat template change nothing a saved state means: a reload that changes only
them keeps every conversation's state. A child of another identity gets another folder, so its
states never meet the old ones; the folder of an identity no longer served is removed at start
(``sweep``).

The budget, ``llama.state_disk_mib``: 0 = off; a number = that many MiB; null = 4096 MiB when the
file system has room for it (its free space plus what the folder already holds), else off: the tier
is on by default only where the budget fits, and ``llamagate plan`` says which.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from proxy.conversations.disk import private_folder
from proxy.source import SlotStates
from supervisor.budget.plan import MIB
from supervisor.config.schema import Config
from supervisor.paths import state_root

log = logging.getLogger("llamagate.prepare")

DEFAULT_MIB = 4096


@dataclass(frozen=True)
class DiskPlan:
    """The decision for one model: its folder and budget (``states``, None when off) and why."""

    states: SlotStates | None
    why: str

    def line(self, name: str) -> str:
        return f"conversation states on disk ({name}): {self.why}"

    def record(self) -> dict[str, object]:
        """For the identity (``llamagate status``): the budget, what the folder holds now, where, or why
        off."""
        states = self.states
        if states is None:
            return {"budget_bytes": 0, "why": self.why}
        folder = Path(states.directory)
        return {"budget_bytes": states.budget_bytes, "used_bytes": _held_bytes(folder), "folder": str(folder)}


OFF = DiskPlan(None, "off")


def root_for(cfg: Config) -> Path:
    return cfg.llama.state_dir or state_root() / "conversations"


def state_identity(
    binary_sha256: str, model_sha256: str, ctx_per_slot: int, type_k: str, type_v: str, extra: tuple[str, ...]
) -> str:
    record = {
        "binary": binary_sha256,
        "model": model_sha256,
        "ctx_per_slot": ctx_per_slot,
        "cache_type_k": type_k,
        "cache_type_v": type_v,
        "extra_args": list(extra),
    }
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def plan_disk(cfg: Config, alias: str, binary_sha256: str, model_sha256: str) -> DiskPlan:
    """The folder and budget of the model ``alias`` served by ``cfg`` (its llama: section), or why none;
    creates nothing."""
    llama = cfg.llama
    mib = llama.state_disk_mib
    if mib == 0:
        return DiskPlan(None, "off (llama.state_disk_mib: 0)")
    identity = state_identity(
        binary_sha256,
        model_sha256,
        llama.ctx_per_slot,
        llama.cache_type_k,
        llama.cache_type_v,
        tuple(llama.extra_args),
    )
    folder = root_for(cfg) / f"{alias}-{identity[:16]}"
    budget = (mib or DEFAULT_MIB) * MIB
    room = _free_bytes(folder) + _held_bytes(folder)
    if mib is None and room < budget:
        return DiskPlan(
            None,
            f"off: {root_for(cfg)} has {room // MIB:,} MiB of room, the default budget is {DEFAULT_MIB:,} MiB"
            " (set llama.state_disk_mib)",
        )
    why = f"{budget // MIB:,} MiB in {folder}"
    if room < budget:
        why += f" (only {room // MIB:,} MiB of room there now)"
    rate = llama.state_write_mib_s
    if rate is not None:
        why += f", writes at most {rate:,} MiB/s"
    return DiskPlan(SlotStates(str(folder), identity, budget, None if rate is None else rate * MIB), why)


def make_folder(states: SlotStates) -> None:
    """The model's folder, private (``proxy.conversations.disk.private_folder``)."""
    private_folder(Path(states.directory))


def sweep(root: Path, alias: str, keep: str) -> None:
    """Remove the folders of ``alias`` under ``root`` other than ``keep`` (an identity no longer served:
    its states can never be restored). Only folders named for the model are touched."""
    try:
        paths = list(root.iterdir())
    except FileNotFoundError:
        return
    for path in paths:
        name = path.name
        ours = name.startswith(alias + "-") and len(name) == len(alias) + 17 and name != Path(keep).name
        if ours and path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
            log.info(
                "conversation states of an identity no longer served removed",
                extra={"fields": {"folder": str(path)}},
            )


def drop(old: SlotStates | None, kept: SlotStates | None) -> None:
    """Remove ``old``'s folder unless the model still uses it (``kept``): its identity is no longer
    served (a reload changed it, turned the tier off or removed the model)."""
    if old is None or (kept is not None and kept.directory == old.directory):
        return
    path = Path(old.directory)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
        log.info(
            "conversation states of an identity no longer served removed",
            extra={"fields": {"folder": str(path)}},
        )


def _free_bytes(folder: Path) -> int:
    for path in (folder, *folder.parents):
        if path.exists():
            return shutil.disk_usage(path).free
    return 0


def _held_bytes(folder: Path) -> int:
    try:
        return sum(e.stat().st_size for e in os.scandir(folder) if e.is_file(follow_symlinks=False))
    except FileNotFoundError:
        return 0
