"""Everything that happens before the first launch: find and verify the binary and the model, read
the model's shape, check the memory budget, and write down the identity of what will be served.

Nothing here starts a process that serves; a failure raises with what is wrong and what to change.
Hashes go through the hash cache (``artifacts.sha256_file``) so a daemon restart costs a ``stat``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path

import psutil

from supervisor.artifacts.build import ensure_binary, find_installed, version_output
from supervisor.artifacts.demo_model import DEFAULT_DEMO, demo_for_digest, demo_model_path, ensure_demo_model
from supervisor.artifacts.files import check_gguf, sha256_file, verify_model
from supervisor.artifacts.lock import DEFAULT_VARIANT
from supervisor.artifacts.receipt import RECEIPT_NAME, Receipt, read_receipt
from supervisor.budget.devices import Devices, list_devices
from supervisor.budget.gguf_info import ModelShape, read_shape
from supervisor.budget.plan import MIB, Budget, Offload, plan_budget
from supervisor.budget.window import WHY_NO_ROOM, WindowChoice, choose, slides
from supervisor.config.schema import Config
from supervisor.daemon.identity import host_identity, served_identity
from supervisor.daemon.state_disk import OFF, DiskPlan, make_folder, plan_disk
from supervisor.errors import BuildError, CheckFailed, DigestMismatch, Misconfigured, StartupError
from supervisor.launch.flags import LaunchSpec, budget_flags
from supervisor.launch.knobs import KNOBS, NameOrPath
from supervisor.paths import default_lock_path
from supervisor.progress import Progress

log = logging.getLogger("llamagate.prepare")


@dataclass(frozen=True)
class Binary:
    path: Path
    sha256: str
    build: dict[str, object] | None


@dataclass(frozen=True)
class Model:
    path: Path
    sha256: str
    size: int
    shape: ModelShape


@dataclass(frozen=True)
class Prepared:
    spec: LaunchSpec  # port 0: the driver picks a free one per boot
    binary: Binary
    model: Model
    budget: Budget
    identity: dict[str, object]
    # The conversations' states on disk: its folder and budget (in ``spec.slot_states``), or why none.
    disk: DiskPlan = OFF
    # A sliding-window model's cache: --swa-full or not, and what it costs (budget/window.py).
    window: WindowChoice | None = None


def _build_facts(receipt: Receipt) -> dict[str, object]:
    return {
        "commit": receipt.llama_cpp_commit,
        "version": receipt.version_output.strip(),
        "cmake_args": list(receipt.cmake_args),
        "compilers": list(receipt.compilers),
        "source": receipt.source,
        "source_sha256": receipt.source_sha256,
        "lock_digest": receipt.lock_digest,
        "built_at": receipt.built_at,
        "reference_match": receipt.reference_match,
        "variant": receipt.variant,
        "patches": list(receipt.patches),
    }


def _version_of(binary: Path) -> str:
    """``--version`` of a binary we did not build (no receipt): the commit is in its output."""
    try:
        return version_output(binary)[:500] or "unknown"
    except BuildError as exc:
        return f"unknown ({exc})"


def resolve_binary(
    cfg: Config, *, progress: Progress, cache: Path | None = None, fetch: bool = True
) -> Binary:
    """``fetch=False``: use only what is installed (a SIGHUP must not start a 5-minute build)."""
    explicit = cfg.llama.binary
    if explicit is None:
        lock = cfg.llama.lock or default_lock_path()
        variant = cfg.llama.variant
        if fetch:
            installed = ensure_binary(lock, cache=cache, progress=progress, variant=variant)
        else:
            found = find_installed(lock, cache=cache, variant=variant)
            if found is None:
                raise StartupError(
                    f"no llama-server built for {lock} (variant {variant}) yet: run "
                    f"'llamagate build --lock {lock} --variant {variant}'"
                )
            installed = found
        return Binary(installed.path, installed.receipt.binary_sha256, _build_facts(installed.receipt))
    if not explicit.is_file():
        raise Misconfigured(f"llama.binary: not a file: {explicit}")
    if not os.access(explicit, os.X_OK):
        raise Misconfigured(f"llama.binary: not executable: {explicit}")
    digest = sha256_file(explicit, cache=cache)
    expected = cfg.llama.binary_sha256
    if expected is not None and digest != expected:
        raise Misconfigured(f"llama.binary_sha256: {DigestMismatch(str(explicit), expected, digest)}")
    # A binary from llamagate's cache named explicitly still has its receipt beside it.
    receipt_path = explicit.parent / RECEIPT_NAME
    if receipt_path.is_file():
        try:
            receipt = read_receipt(receipt_path)
        except CheckFailed:
            receipt = None
        if receipt is not None and receipt.binary_sha256 == digest:
            return Binary(explicit, digest, _build_facts(receipt))
    return Binary(
        explicit, digest, {"source": "external binary (no receipt)", "version": _version_of(explicit)}
    )


def resolve_model(cfg: Config, *, progress: Progress, cache: Path | None = None, fetch: bool = True) -> Model:
    """``fetch=False``: the demo model must already be in the cache (a SIGHUP must not download)."""
    m = cfg.llama.model
    if m.path is None:
        if fetch:
            path = ensure_demo_model(cache=cache, progress=progress)
        else:
            path = demo_model_path(cache)
            if not path.is_file():
                raise StartupError(
                    f"the demo model is not in the cache ({path}): run 'llamagate model fetch'"
                )
            verify_model(path, DEFAULT_DEMO.sha256, cache=cache)
        digest = DEFAULT_DEMO.sha256
        check_gguf(path)
        return Model(path=path, sha256=digest, size=path.stat().st_size, shape=read_shape(path))
    assert m.sha256 is not None  # config validation requires it with a path
    try:
        verify_model(m.path, m.sha256, cache=cache)
        shape = read_shape(m.path)
    except DigestMismatch as exc:
        raise Misconfigured(f"llama.model.sha256: {exc}") from None
    except CheckFailed as exc:  # missing, a directory, unreadable, not a GGUF
        raise Misconfigured(f"llama.model.path: {exc}") from None
    return Model(path=m.path, sha256=m.sha256, size=m.path.stat().st_size, shape=shape)


def default_threads() -> int:
    """Physical cores we may run on: hyperthreads add little to decode and contend for the FPU."""
    physical = psutil.cpu_count(logical=False) or 1
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = physical
    return max(1, min(physical, usable))


def offloads(cfg: Config) -> bool:
    """Layers go to a device: a GPU build (not the cpu variant, or a named binary) and gpu_layers > 0."""
    llama = cfg.llama
    gpu_build = llama.variant != DEFAULT_VARIANT or llama.binary is not None
    return gpu_build and llama.gpu_layers > 0 and llama.device != "none"


def devices_for(cfg: Config, binary: Path | None) -> Devices | None:
    """What the child's build will see (``--list-devices``, in the child's environment) when it
    offloads; None when it does not. ``binary`` None: not built yet, so nothing could be read."""
    if not offloads(cfg):
        return None
    if binary is None:
        return Devices(
            (), "the binary is not built yet (llamagate build --variant " + cfg.llama.variant + ")"
        )
    return list_devices(binary, cfg.llama)


def budget_for(
    cfg: Config,
    model: Model,
    *,
    available: int | None = None,
    extra_available: int = 0,
    devices: Devices | None = None,
    swa_full: bool | None = None,
) -> Budget:
    """``devices``: from ``devices_for``; with layers offloaded and None, the device is not known.
    ``swa_full``: the full-size cache of a sliding-window model (``plan_window``); None: as extra_args
    says."""
    llama = cfg.llama
    given, n_ubatch = budget_flags(llama.extra_args)
    swa_full = given if swa_full is None else swa_full
    offload = None
    if offloads(cfg):
        known = devices or Devices((), "the devices were not listed")
        device = known.chosen(llama.device)
        note = known.note
        if device is None and note is None:
            listed = ", ".join(d.name for d in known.listed)
            note = f"llama.device {llama.device!r} is not a listed device ({listed})"
        offload = Offload(llama.gpu_layers, device, note)
    return plan_budget(
        model.shape,
        weights=model.size,
        slots=llama.slots,
        ctx_per_slot=llama.ctx_per_slot,
        type_k=llama.cache_type_k,
        type_v=llama.cache_type_v,
        headroom_bytes=cfg.supervision.memory_headroom_mib * MIB,
        available=available,
        extra_available=extra_available,
        prompt_cache_bytes=llama.prompt_cache_mib * MIB,
        ctx_checkpoints=llama.ctx_checkpoints,
        swa_full=swa_full,
        n_ubatch=n_ubatch,
        offload=offload,
    )


@dataclass(frozen=True)
class Window:
    """The budget, the disk plan and the sliding-window choice, decided together (``plan_window``)."""

    budget: Budget
    disk: DiskPlan
    choice: WindowChoice


def plan_window(
    cfg: Config,
    model: Model,
    alias: str,
    binary_sha256: str,
    *,
    available: int | None = None,
    extra_available: int = 0,
    devices: Devices | None = None,
) -> Window:
    """The disk tier and the memory budget with what makes a sliding-window model's restores work:
    --swa-full when the tier is on (budget/window.py says why). When the full cache does not fit and
    the windowed one does, the tier is off for this model instead. Creates nothing."""
    given, _ = budget_flags(cfg.llama.extra_args)
    adds = slides(model.shape) and not given  # the identity of a folder whose child gets --swa-full
    disk = plan_disk(cfg, alias, binary_sha256, model.sha256, swa_full=adds)
    full, added, why = choose(model.shape, tier_on=disk.states is not None, given=given)

    def budget(swa_full: bool) -> Budget:
        return budget_for(
            cfg,
            model,
            available=available,
            extra_available=extra_available,
            devices=devices,
            swa_full=swa_full,
        )

    chosen = budget(full)
    windowed = budget(False) if slides(model.shape) else chosen
    if added and not chosen.fits and windowed.fits:
        off = f"off: {alias} slides and --swa-full, which its restores need, does not fit the memory budget"
        log.warning("conversation states on disk are off: %s", off)
        full, added, why, chosen = False, False, WHY_NO_ROOM, windowed
        disk = DiskPlan(None, off)
    choice = WindowChoice(
        slides=slides(model.shape),
        full=full,
        added=added,
        why=why,
        kv_bytes=chosen.kv_bytes,
        checkpoint_bytes=chosen.checkpoint_bytes,
        windowed_kv_bytes=windowed.kv_bytes,
        windowed_checkpoint_bytes=windowed.checkpoint_bytes,
    )
    return Window(chosen, disk, choice)


def launch_spec(cfg: Config, binary: Binary, model: Model) -> LaunchSpec:
    """Every knob as the llama: section sets it, with the two that default to the host resolved and
    the demo model's template chosen."""
    llama = cfg.llama
    threads = llama.threads or default_threads()
    resolved = replace(
        llama,
        threads=threads,
        threads_batch=llama.threads_batch or threads,
        chat_template=chat_template_for(cfg),
    )
    return LaunchSpec(binary.path, model.path, llama.model.alias, 0, resolved)


def chat_template_for(cfg: Config) -> NameOrPath | None:
    """The configured template; unset, a demo model whose GGUF has none (Gemma 3: llama-server would fall
    back to ChatML and answer with ``<|im_end|>`` debris) gets its own family's format. A demo model is
    recognised by its pinned digest, wherever a config puts the file; no path is the default demo model."""
    llama = cfg.llama
    if llama.chat_template is not None:
        return llama.chat_template
    demo = DEFAULT_DEMO if llama.model.path is None else demo_for_digest(llama.model.sha256)
    return NameOrPath(demo.chat_template) if demo is not None and demo.chat_template else None


def identity_for(
    spec: LaunchSpec, binary: Binary, model: Model, devices: Devices | None = None
) -> dict[str, object]:
    """``devices``: what the build listed (``devices_for``); the identity's ``device`` record."""
    record = served_identity(
        binary=binary.path,
        binary_sha256=binary.sha256,
        build=binary.build,
        model=model.path,
        model_size=model.size,
        model_sha256=model.sha256,
        alias=spec.alias,
        serving=serving_record(spec),
        host=host_identity(),
    )
    record["device"] = device_record(spec, devices)
    serving = record["serving"]
    if spec.swa_full and isinstance(serving, dict):  # llamagate added it (budget/window.py)
        serving["swa_full"] = True
    return record


def device_record(spec: LaunchSpec, devices: Devices | None) -> dict[str, object]:
    """Where the layers go: the variant, the offload asked for, and what the build listed (when it
    offloads). The layers really offloaded are in the child's log: ``/readyz`` shows them per model."""
    knobs = spec.llama
    chosen = devices.chosen(knobs.device) if devices is not None else None
    return {
        "variant": knobs.variant,
        "gpu_layers": knobs.gpu_layers,
        "device": chosen.as_dict() if chosen is not None else None,
        "listed": [d.as_dict() for d in devices.listed] if devices is not None else [],
        "note": devices.note if devices is not None else None,
    }


def serving_record(spec: LaunchSpec) -> dict[str, object]:
    """The identity's ``serving`` part: every knob marked as identity, as plain JSON values."""
    record: dict[str, object] = {}
    for k in KNOBS:
        if k.identity:
            value = getattr(spec.llama, k.name)
            record[k.name] = list(value) if isinstance(value, tuple) else value
    return record


def prepare(
    cfg: Config,
    *,
    progress: Progress,
    cache: Path | None = None,
    extra_available: int = 0,
    fetch: bool = True,
) -> Prepared:
    """Verify, budget and describe; raises ``StartupError`` when the budget does not fit.
    ``extra_available``: memory that will be freed before the launch (a child about to be replaced).
    ``fetch=False``: never build the binary or download the demo model, only verify them (SIGHUP)."""
    binary = resolve_binary(cfg, progress=progress, cache=cache, fetch=fetch)
    model = resolve_model(cfg, progress=progress, cache=cache, fetch=fetch)
    devices = devices_for(cfg, binary.path)
    window = plan_window(
        cfg, model, cfg.llama.model.alias, binary.sha256, extra_available=extra_available, devices=devices
    )
    budget, disk = window.budget, window.disk
    if not budget.fits:
        why = budget.refusal()
        if window.choice.added:  # neither cache fits: say where the full one comes from
            why += (
                "; the KV state counts --swa-full, added because the disk tier is on for this sliding-window"
                " model (llama.state_disk_mib: 0 turns both off)"
            )
        raise Misconfigured(why)
    shape = model.shape
    if shape.n_ctx_train is not None and cfg.llama.ctx_per_slot > shape.n_ctx_train:
        log.warning(
            "ctx_per_slot exceeds the model's training context; quality degrades past it",
            extra={"fields": {"ctx_per_slot": cfg.llama.ctx_per_slot, "n_ctx_train": shape.n_ctx_train}},
        )
    if Path("/etc/llama.cpp/config.ini").exists():
        log.warning("/etc/llama.cpp/config.ini exists: llama-server reads it (argv still wins)")
    spec = launch_spec(cfg, binary, model)
    if disk.states is not None:
        try:
            make_folder(disk.states)
        except (OSError, ValueError) as exc:  # the tier is an optimisation: serve without it
            log.warning("conversation states on disk are off: the folder cannot be made: %s", exc)
            disk = DiskPlan(None, f"off: {disk.states.directory} cannot be made ({exc})")
    # --swa-full as budgeted even when the folder could not be made: the budget checked that cache (the
    # windowed one's checkpoints may need more), and the RAM prompt cache works with either.
    spec = replace(spec, slot_states=disk.states, swa_full=window.choice.added)
    identity = identity_for(spec, binary, model, devices)
    return Prepared(spec, binary, model, budget, identity, disk, window.choice)
