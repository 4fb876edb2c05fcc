"""Where a model's conversations' states go on disk (the proxy's disk tier, ``proxy.conversations.tier``),
whether they go there at all, and this daemon's hold on its folders.

One private folder per served model and identity, ``STATE_DIR/ALIAS-IDENTITY16``
(``proxy.conversations.root.StateRoot.folder``), passed to the child as ``--slot-save-path``. The identity
is a digest of what a saved sequence state depends on: the binary and the model by sha256 (the file format
and the KV cells' meaning) and the knobs marked ``kv_state`` (``launch/knobs.py``): the context per slot
(a restore must fit the slot), the KV cache types (the cells' layout) and ``extra_args`` (anything there
may change the cache: ``-fa``, ``--swa-full``...), and ``--swa-full`` when llamagate adds it (a
sliding-window model's full-size cache: ``budget/window.py``).
Threads, slot count, the RAM cache and the chat template change nothing a saved state means: a reload
that changes only them keeps every conversation's state. A child of another identity gets another
folder, so its states never meet the old ones.

The folder's life (made, held, released, swept, lost, made again) is ``proxy.conversations.root``'s; this
module only decides and asks: ``Folders`` holds each folder this daemon serves for the daemon's life and
ensures it before every spawn of a child (``before_spawn``): a folder removed under the daemon is made
again (its states lost are counted and logged, and the tier forgets them); one that cannot be made starts
the child with the tier off, so a missing folder never fails a start. At start the daemon sweeps the
alias's folders of other identities that nobody holds and nobody used within a day (``sweep``); a
reload's ``drop`` releases the old identity's folder and sweeps the same way.

The budget, ``llama.state_disk_mib``: 0 = off; a number = that many MiB; null = 4096 MiB when the
file system has room for it (its free space plus what the folder already holds), else off: the tier
is on by default only where the budget fits, and ``llamagate plan`` says which.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import shutil
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy.conversations.disk import StateDirError
from proxy.conversations.root import Hold, StateRoot, make_private
from proxy.source import SlotStates
from supervisor.budget.plan import MIB
from supervisor.config.schema import Config
from supervisor.launch.flags import LaunchSpec
from supervisor.launch.knobs import KNOBS, LlamaKnobs
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
        _, used = StateRoot.held(states)
        return {"budget_bytes": states.budget_bytes, "used_bytes": used, "folder": states.directory}


OFF = DiskPlan(None, "off")


def root_for(cfg: Config) -> Path:
    return cfg.llama.state_dir or state_root() / "conversations"


def state_identity(binary_sha256: str, model_sha256: str, llama: LlamaKnobs, swa_full: bool = False) -> str:
    """The digest of what a saved sequence state depends on: the binary and the model, every knob
    marked ``kv_state`` (``launch/knobs.py``), and ``--swa-full`` when llamagate adds it."""
    record: dict[str, object] = {"binary": binary_sha256, "model": model_sha256}
    for k in KNOBS:
        if k.row.kv_state:
            value = getattr(llama, k.name)
            record[k.name] = list(value) if isinstance(value, tuple) else value
    if swa_full:  # only then, so the identities of models without a sliding window stay as they were
        record["swa_full"] = True
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def plan_disk(
    cfg: Config, alias: str, binary_sha256: str, model_sha256: str, *, swa_full: bool = False
) -> DiskPlan:
    """The folder and budget of the model ``alias`` served by ``cfg`` (its llama: section), or why none;
    creates nothing. ``swa_full``: llamagate adds --swa-full to the child (part of the identity)."""
    llama = cfg.llama
    mib = llama.state_disk_mib
    if mib == 0:
        return DiskPlan(None, "off (llama.state_disk_mib: 0)")
    identity = state_identity(binary_sha256, model_sha256, llama, swa_full)
    folder = StateRoot(root_for(cfg)).folder(alias, identity)
    budget = (mib or DEFAULT_MIB) * MIB
    rate = llama.state_write_mib_s
    states = SlotStates(str(folder), identity, budget, None if rate is None else rate * MIB)
    room = _free_bytes(folder) + StateRoot.held(states)[1]
    if mib is None and room < budget:
        return DiskPlan(
            None,
            f"off: {root_for(cfg)} has {room // MIB:,} MiB of room, the default budget is {DEFAULT_MIB:,} MiB"
            " (set llama.state_disk_mib)",
        )
    why = f"{budget // MIB:,} MiB in {folder}"
    if room < budget:
        why += f" (only {room // MIB:,} MiB of room there now)"
    if rate is not None:
        why += f", writes at most {rate:,} MiB/s"
    return DiskPlan(states, why)


def make_folder(states: SlotStates) -> None:
    """The model's folder, private, not held yet (a reload's dry run needs it before any child runs)."""
    make_private(Path(states.directory))


def sweep(states: SlotStates, alias: str) -> list[Path]:
    """At start: remove ``alias``'s folders of other identities than ``states``' that nobody holds and
    nobody used within the grace period (``proxy.conversations.root.StateRoot.sweep``)."""
    folder = Path(states.directory)
    return StateRoot(folder.parent).sweep(alias, folder)


# A model's name -> how many states its tier forgot (``ProxyWiring.states_lost``).
Forget = Callable[[str], int]
# How often a held folder is marked as used (``Hold.touch``): a daemon killed after a quiet day (no save,
# no child start) leaves its folder last used at most an hour before, well inside the day's grace.
TOUCH_S = 3600.0


class Folders:
    """The folders this daemon serves, each held from its first child's spawn until a reload or removal
    lets it go (``drop``) or the daemon ends; and the states it lost to a folder removed under it."""

    def __init__(self, forget: Forget | None = None) -> None:
        self.forget = forget
        self.lost: Counter[str] = Counter()  # states lost, by model
        self._holds: dict[str, Hold] = {}  # by folder
        self._seen: dict[str, int] = {}  # by folder: the states it held at its last check
        # ``_ensure`` runs in threads: two supervisors of one model (a reload side by side) may spawn at once.
        self._lock = threading.Lock()
        self._touched = -TOUCH_S  # on the caller's clock (``tick``)

    def held(self, states: SlotStates) -> bool:
        hold = self._holds.get(states.directory)
        return hold is not None and hold.held

    async def before_spawn(self, model: str, spec: LaunchSpec) -> LaunchSpec:
        """``spec`` with its folder made and held; without it (the tier off for this child, with a
        warning) when it cannot be made. Never raises: a missing folder never fails a start."""
        self.lost.setdefault(model, 0)  # exported from the start, so that ``increase()`` sees the first
        states = spec.slot_states
        if states is None:
            return spec
        try:
            lost = await asyncio.to_thread(self._ensure, states)
        except (OSError, StateDirError) as exc:
            log.warning(
                "the conversation states folder cannot be made: this child starts with the disk tier off",
                extra={"fields": {"model": model, "folder": states.directory, "error": str(exc)}},
            )
            return replace(spec, slot_states=None)
        if lost is not None:
            forgot = self.forget(model) if self.forget is not None else 0
            count = max(lost, forgot)
            self.lost[model] += count
            log.warning(
                "the conversation states folder was removed under the daemon: made again, its states lost",
                extra={"fields": {"model": model, "folder": states.directory, "states_lost": count}},
            )
        return spec

    def _ensure(self, states: SlotStates) -> int | None:
        """Hold ``states``' folder; None, or how many states it held at the last check when it was found
        removed (it is made again)."""
        key = states.directory
        with self._lock:
            hold = self._holds.get(key)
            lost = None
            if hold is not None and hold.intact():
                hold.touch()
            else:
                if hold is not None:
                    hold.release()
                    lost = self._seen.get(key, 0)
                self._holds[key] = Hold.take(Path(key))
            self._seen[key] = StateRoot.held(states)[0]
            return lost

    def drop(self, old: SlotStates | None, kept: SlotStates | None) -> None:
        """``old``'s identity is no longer served here (a reload changed it, turned the tier off or removed
        the model): let its folder go; the alias's folders nobody holds or used within the grace period
        are removed (``StateRoot.sweep``), ``kept`` never."""
        if old is None or (kept is not None and kept.directory == old.directory):
            return
        with self._lock:
            hold = self._holds.pop(old.directory, None)
            self._seen.pop(old.directory, None)
        if hold is not None:
            hold.release()
        root = StateRoot(Path(old.directory).parent)
        root.sweep(root.alias_of(Path(old.directory)), Path(kept.directory) if kept is not None else None)

    def tick(self, now: float) -> float:
        """Every ``TOUCH_S`` (a ``ModelSet`` tick hook, on its clock): every held folder marked as used;
        the seconds until the next time."""
        if now - self._touched >= TOUCH_S:
            with self._lock:
                for hold in self._holds.values():
                    hold.touch()
            self._touched = now
        return self._touched + TOUCH_S - now

    def close(self) -> None:
        """The daemon ends: every folder let go (its grace period starts)."""
        with self._lock:
            for hold in self._holds.values():
                hold.release()
            self._holds.clear()

    def collector(self) -> Collector:
        return _LostCollector(self)


class _LostCollector(Collector):
    def __init__(self, folders: Folders) -> None:
        self._folders = folders

    def collect(self) -> Iterator[Metric]:
        lost = CounterMetricFamily(
            "llamagate_conversation_states_lost",
            "Conversation states lost to a states folder removed under the daemon (it was made again)",
            labels=["model"],
        )
        for model, n in sorted(self._folders.lost.items()):
            lost.add_metric([model], n)
        yield lost


def _free_bytes(folder: Path) -> int:
    for path in (folder, *folder.parents):
        if path.exists():
            return shutil.disk_usage(path).free
    return 0
