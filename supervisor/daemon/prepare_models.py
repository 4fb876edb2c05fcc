"""``prepare`` for every served model, and the one memory budget they share.

Each model is verified and budgeted alone first (``prepare``: a model that cannot fit by itself is
refused with its own numbers). Then the set: every ``always`` model is resident at once, and of the
``on_demand`` ones at least the largest must fit beside them (smaller ones may take its place; the
daemon unloads the least recently used idle one to make room). A set that cannot fit is refused at
start, with the numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from supervisor.budget.plan import MIB
from supervisor.config.models import ServedModel, as_model_path, served_models
from supervisor.config.schema import Config
from supervisor.daemon.prepare import Prepared, prepare
from supervisor.errors import Misconfigured
from supervisor.progress import Progress


@dataclass(frozen=True)
class PreparedModel:
    served: ServedModel
    prepared: Prepared

    @property
    def required_bytes(self) -> int:
        return self.prepared.budget.required_bytes


def _mib(n: int) -> str:
    return f"{n / MIB:,.0f} MiB"


def joint_budget_lines(models: tuple[PreparedModel, ...]) -> list[str]:
    """Every model's need and the sum the set must fit in, for the log and the refusal."""
    always = [m for m in models if not m.served.on_demand]
    on_demand = [m for m in models if m.served.on_demand]
    largest = max(on_demand, key=lambda m: m.required_bytes, default=None)
    lines = [f"{m.served.name} ({m.served.residency}): {_mib(m.required_bytes)}" for m in models]
    need = sum(m.required_bytes for m in always) + (largest.required_bytes if largest else 0)
    what = "every always model" + (f" + the largest on_demand one ({largest.served.name})" if largest else "")
    usable = usable_bytes(models)
    budget = models[0].prepared.budget
    lines.append(
        f"{what}: {_mib(need)} needed; {_mib(usable)} usable "
        f"({_mib(budget.available_bytes)} available - {_mib(budget.headroom_bytes)} headroom)"
    )
    return lines


def thread_warning(models: tuple[PreparedModel, ...], cores: int) -> str | None:
    """Decode threads of the children resident at once (every always model and the largest on_demand
    one) beyond the cores: they take turns on the same cores, so every model's time per token grows."""
    always = [m for m in models if not m.served.on_demand]
    largest = max((m for m in models if m.served.on_demand), key=lambda m: m.required_bytes, default=None)
    resident = [*always, *([largest] if largest else [])]
    threads = sum(m.prepared.spec.threads for m in resident)
    if threads <= cores:
        return None
    each = ", ".join(f"{m.served.name} {m.prepared.spec.threads}" for m in resident)
    return (
        f"the resident children's decode threads add up to {threads} ({each}) on {cores} cores: they"
        " compete, and every model's time per output token grows; lower models[].threads"
    )


def usable_bytes(models: tuple[PreparedModel, ...]) -> int:
    # Each model's budget measured the memory available a moment apart: the least is the honest one.
    return min(m.prepared.budget.usable_bytes for m in models)


def joint_need(models: tuple[PreparedModel, ...]) -> int:
    always = sum(m.required_bytes for m in models if not m.served.on_demand)
    largest = max((m.required_bytes for m in models if m.served.on_demand), default=0)
    return always + largest


def prepare_models(
    cfg: Config, *, progress: Progress, cache: Path | None = None, fetch: bool = True
) -> tuple[PreparedModel, ...]:
    """Verify and budget every model; ``Misconfigured`` with the numbers when the set cannot fit."""
    out = []
    for i, served in enumerate(served_models(cfg)):
        try:
            prepared = prepare(served.cfg, progress=progress, cache=cache, fetch=fetch)
        except Misconfigured as exc:
            if not cfg.models:
                raise  # the llama: section is where the operator wrote it: its path names the field
            raise Misconfigured(f"model {served.name!r}: {as_model_path(str(exc), i)}") from None
        out.append(PreparedModel(served, prepared))
    models = tuple(out)
    if joint_need(models) > usable_bytes(models):
        lines = "\n  ".join(joint_budget_lines(models))
        raise Misconfigured(
            f"the models do not fit in memory together:\n  {lines}\n"
            "lower slots or ctx_per_slot, make a model on_demand, or serve fewer models"
        )
    return models
