"""What ``serve`` and ``plan`` would refuse on this host, checked without starting, building or
downloading anything: ``llamagate config check`` runs it, so its "ok" means the daemon will start.

The checks are prepare's own (``resolve_binary``/``resolve_model`` with ``fetch=False``, the memory
budget), so the two cannot drift. What ``serve`` would build or fetch by itself (the binary from the
lock, the demo model) is not a problem, only a note.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from supervisor.config.schema import Config
from supervisor.daemon.prepare import Model, budget_for, devices_for, resolve_binary, resolve_model
from supervisor.errors import LlamagateError, StartupError
from supervisor.progress import NullProgress


@dataclass
class HostCheck:
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    checked: list[str] = field(default_factory=list)


def check_host(cfg: Config, *, cache: Path | None = None) -> HostCheck:
    out = HostCheck()
    progress = NullProgress()
    binary = None
    try:
        binary = resolve_binary(cfg, progress=progress, cache=cache, fetch=False).path
        out.checked.append("binary")
    except StartupError as exc:  # not built yet: serve builds it (minutes), or `llamagate build` now
        out.notes.append(f"llama-server will be built at the first start: {exc}")
    except LlamagateError as exc:
        out.problems.append(str(exc))
    model: Model | None = None
    try:
        model = resolve_model(cfg, progress=progress, cache=cache, fetch=False)
        out.checked.append("model file and sha256")
    except StartupError as exc:  # the demo model, not fetched yet: serve fetches it
        out.notes.append(f"the demo model will be fetched at the first start: {exc}")
    except LlamagateError as exc:
        out.problems.append(str(exc))
    if model is not None:
        devices = devices_for(cfg, binary)
        if devices is not None and devices.note:
            out.notes.append(f"the device's memory is not checked: {devices.note}")
        budget = budget_for(cfg, model, devices=devices)
        if budget.fits:
            out.checked.append("memory budget")
        else:
            out.problems.append(budget.refusal())
    elif not out.problems:
        out.notes.append("the memory budget is checked once the model is there (`llamagate plan`)")
    return out
